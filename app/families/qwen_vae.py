"""Qwen-Image's VAE (`AutoencoderKLQwenImage`, Qwen-Image 1.0's, Wan-style) as a part of a family: its latent
space, its file, its tiny config. Why here: Krea 2 decodes with it, and so would Qwen-Image 1.0 / Edit; one
latent format per VAE, stated once (Qwen-Image 2.1's own 16× RGBA VAE is another one, in its family file).

* 16 latent channels at 1/8, a frame axis (images are one frame), per-channel mean and std from its config,
  the std applied as its reciprocal in the latents' dtype, as the pipelines compute it (`inverse_std_stats`);
* its file (`qwen_image_vae.safetensors` in ComfyUI's `models/vae`) holds diffusers' names; its marker is an
  upsampler only this VAE names so (`up_blocks.0.upsamplers`; Qwen-Image 2.1's says `upsampler`), so a folder
  holding both VAEs offers each checkpoint its own.
"""

from __future__ import annotations

from types import MappingProxyType

from diffusers import AutoencoderKLQwenImage

from app.families import ComponentFile, LatentFormat, inverse_std_stats
from app.families.file_layout import own_names

QWEN_IMAGE_LATENTS = LatentFormat(stats=inverse_std_stats, frames=True)  # preview: fitted from the VAE (preview.py)
QWEN_IMAGE_VAE_PART = ComponentFile("vae", "VAE (qwen_image_vae.safetensors)", AutoencoderKLQwenImage, ("vae.", ""),
                                    "decoder.up_blocks.0.upsamplers.0.resample.1.weight", own_names, folder="vae_dir")
# Tiny: the real 16 channels and 8× (three 2× steps, no temporal ones), widths 8-16, one resnet per stage.
TINY_QWEN_IMAGE_VAE = MappingProxyType(dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                            temperal_downsample=[False, False, False]))
