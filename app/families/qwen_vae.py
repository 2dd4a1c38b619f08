"""Qwen-Image's VAE (`AutoencoderKLQwenImage`, Qwen-Image 1.0's, Wan 2.1's) as a part of a family: its latent
space, its file, its tiny config. Why here: Qwen-Image and Krea 2 decode with it; one latent format per VAE, stated
once (Qwen-Image 2.1's own 16× RGBA VAE is another one, in its family file).

* 16 latent channels at 1/8, a frame axis (images are one frame), per-channel mean and std from its config,
  the std applied as its reciprocal in the latents' dtype, as the pipelines compute it (`inverse_std_stats`);
* its file (`qwen_image_vae.safetensors` in ComfyUI's `models/vae`) is the Wan 2.1 VAE as Wan's own code names
  it (`decoder.middle.0.residual.0.gamma`, `decoder.upsamples.3.resample.1.weight`, `conv1`, …): `wan_layout`
  is diffusers' `convert_wan_vae_to_diffusers` read backwards, built from the model's blocks (the converter's
  indices are the full-size model's: three resnets and an upsampler per decoder stage), so the tiny demo VAE and
  the full one go through the same code. Its marker is Wan's name of the decoder's middle block, which Qwen-Image
  2.1's VAE (diffusers' names) has not, so a folder holding both VAEs offers each checkpoint its own.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from diffusers import AutoencoderKLQwenImage

from app.families import ComponentFile, LatentFormat, inverse_std_stats
from app.families.file_layout import FileTensor, Layout

# diffusers' name -> Wan's, by prefix (middle blocks, heads, the latent convolutions), then inside a resnet
_WHOLE = tuple((f"{side}.{ours}", f"{side}.{theirs}") for side in ("encoder", "decoder") for ours, theirs in (
    ("mid_block.resnets.0.", "middle.0."), ("mid_block.attentions.0.", "middle.1."),
    ("mid_block.resnets.1.", "middle.2."), ("norm_out.", "head.0."), ("conv_out.", "head.2."), ("conv_in.", "conv1."),
    ("down_blocks.", "downsamples."))) + (
    ("quant_conv.", "conv1."), ("post_quant_conv.", "conv2."))
_RESNET = ((".norm1.", ".residual.0."), (".conv1.", ".residual.2."), (".norm2.", ".residual.3."),
           (".conv2.", ".residual.6."), (".conv_shortcut.", ".shortcut."))


def _resnet_names(name: str) -> str:
    for ours, theirs in _RESNET:
        name = name.replace(ours, theirs)
    return name


def _decoder_stages(vae: torch.nn.Module) -> dict[str, str]:
    """`decoder.up_blocks.I.resnets.J.` / `.upsamplers.0.` -> Wan's flat `decoder.upsamples.N.` (each stage's
    resnets, then its upsampler)."""
    out, index = {}, 0
    for i, block in enumerate(vae.decoder.up_blocks):
        for j in range(len(block.resnets)):
            out[f"decoder.up_blocks.{i}.resnets.{j}."], index = f"decoder.upsamples.{index}.", index + 1
        if block.upsamplers is not None:
            out[f"decoder.up_blocks.{i}.upsamplers.0."], index = f"decoder.upsamples.{index}.", index + 1
    return out


def wan_layout(vae: torch.nn.Module) -> Layout:
    """Every tensor of an `AutoencoderKLQwenImage` -> its key in Wan's (ComfyUI's) VAE file."""
    renames = (*_WHOLE, *_decoder_stages(vae).items())
    layout = {}
    for name in vae.state_dict():
        ours, theirs = next(((o, t) for o, t in renames if name.startswith(o)), ("", ""))
        key = theirs + name[len(ours):]
        layout[name] = FileTensor(_resnet_names(key) if "resnets." in name or "down_blocks." in name else key)
    return layout


QWEN_IMAGE_LATENTS = LatentFormat(stats=inverse_std_stats, frames=True)  # preview: fitted from the VAE (preview.py)
QWEN_IMAGE_VAE_PART = ComponentFile("vae", "VAE (qwen_image_vae.safetensors)", AutoencoderKLQwenImage, ("vae.", ""),
                                    "decoder.middle.0.residual.0.gamma", wan_layout, folder="vae_dir")
# Tiny: the real 16 channels and 8× (three 2× steps, no temporal ones), widths 8-16, one resnet per stage.
TINY_QWEN_IMAGE_VAE = MappingProxyType(dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                            temperal_downsample=[False, False, False]))
