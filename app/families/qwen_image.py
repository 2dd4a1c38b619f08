"""Qwen-Image 2.1 (and its Turbo): a single-stream, block-causal DiT over the 64-channel RGBA latents of its own
16× VAE, with the Qwen3-VL-8B encoder, 1024² native size (Qwen, Apache-2.0; diffusers' `QwenImage21Pipeline`).

One pipeline generates from a prompt and edits or combines reference pictures (Qwen3-VL reads each in its
vision slots; its VAE latents join the sequence ahead of the image). Sampled without guidance (CFG 1, 40 steps);
CFG above 1 runs the unconditional pass with the negative prompt, as A1111 computes it. Turbo is a folder
stating the author's `sample_sigmas`: its steps are their count.

Files: a diffusers folder; or ComfyUI's transformer (bf16, or fp8 with `weight_scale`; names:
`qwen_image_layout.py`) with the Qwen3-VL encoder in `models/text_encoder` (`qwen3_vl.py`) and the VAE in
`models/VAE` (diffusers' names), or an all-in-one under ComfyUI's prefixes. No img2img or inpaint (refused).
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from app.families import ASSETS_DIR, Adapters, BenchSpec, ComponentFile, Family, Files, LatentFormat, Precision, TestKit
from app.families.file_layout import own_names
from app.families.flow_dit import DIT_PREFIXES, DIT_SHARED
from app.families.pipelines import PackedPatches, VariedNoise
from app.families.qwen3_vl import QWEN3_VL, QWEN3_VL_PART, QWEN3_VL_PINNED, TINY_QWEN3_VL
from app.families.qwen_dit import QWEN_SAMPLING, TrueCfg, native_size
from app.families.qwen_image_layout import lora_aliases, transformer_layout


class SteadyQwenImage21Pipeline(PackedPatches, TrueCfg, VariedNoise, QwenImage21Pipeline):
    """Qwen-Image 2.1 txt2img and reference editing (`image=[…]`). It denoises the latents unpatched, as a
    (batch, rows·columns, 64) sequence (FLUX.1's latent grid, without its patches); the engine's spatial latents are
    (batch, 64, rows, columns)."""

    def __call__(self, *args, num_inference_steps: int = 40, sigmas=None, height: int | None = None,
                 width: int | None = None, output_resolution: int | None = None, **kwargs):
        """The author's `sample_sigmas` where the steps are their count, else the pipeline's linear schedule (the
        engine runs the steps asked for); references resized to the image's area (the pipeline's
        `output_resolution`: 1024 at the native 1024²)."""
        if sigmas is None:
            authored = self.config.get("sample_sigmas")
            sigmas = (authored if authored and len(authored) == num_inference_steps
                      else np.linspace(1.0, 1 / num_inference_steps, num_inference_steps))
        side = output_resolution or (round(math.sqrt(height * width)) if height and width else 1024)
        return super().__call__(*args, num_inference_steps=num_inference_steps, sigmas=sigmas, height=height,
                                width=width, output_resolution=side, **kwargs)

    def pack_noise(self, noise: torch.Tensor) -> torch.Tensor:
        return noise.flatten(2).transpose(1, 2)

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        if latents.dim() == 4:
            return latents
        return latents.transpose(1, 2).reshape(latents.shape[0], latents.shape[2], *self.latent_grid(height, width))

    def prepare_latents(self, images, batch_size, num_channels_latents, height, width, dtype, device, generator,
                        latents=None):
        """A variation seed's first noise is mixed spatially (`VariedNoise`) and packed; the pipeline draws the
        same numbers with a frames axis of 1."""
        if latents is None and self.variation is not None:
            shape = (batch_size, num_channels_latents, *self.latent_grid(height, width))
            latents = self.pack_noise(self.variation.noise(shape, self.latent_grid, dtype, device, generator))
        return QwenImage21Pipeline.prepare_latents(self, images, batch_size, num_channels_latents, height, width,
                                                   dtype, device, generator, latents)

    def _encode_vae_image(self, image: torch.Tensor, generator):
        """References are encoded in the VAE's compute dtype (diffusers hands them over in the text encoder's)."""
        dtype = self.compute_dtypes.get("vae") or image.dtype
        return super()._encode_vae_image(image.to(dtype=dtype), generator).to(image.dtype)


_PARTS = (
    ComponentFile("transformer", "transformer", QwenImage21Transformer2DModel, ("model.diffusion_model.", ""),
                  "txt_in.text_norm.weight", transformer_layout),
    QWEN3_VL_PART,
    ComponentFile("vae", "VAE (qwen_image_2.1_vae.safetensors)", AutoencoderKLQwenImage21, ("vae.", ""),
                  "decoder.norm_out.gamma", own_names, folder="vae_dir"),
)
# Tiny: the real 64 latent channels, 16× VAE (five stages, four downsamples) and RGBA pictures; 2 blocks of 2
# heads x 8 with rope axes 2/2/4; the tiny Qwen3-VL (`qwen3_vl.py`).
_TINY = MappingProxyType({
    "transformer": dict(in_channels=64, out_channels=64, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                        context_in_dim=32, axes_dims_rope=(2, 2, 4)),
    "vae": dict(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, False, False, False]),
    "text_encoder": TINY_QWEN3_VL,
})
# Every layer kind: attention (q, out), both SwiGLU halves and its output, the shared modulation, the text and
# image embedders, the final layer, and Qwen3-VL's attention, MLP and vision tower.
_LORA_TARGETS = tuple(f"transformer.{m}" for m in (
    "transformer_blocks.0.attn.to_q", "transformer_blocks.*.attn.to_out.0", "transformer_blocks.1.img_mlp.gate_layer",
    "transformer_blocks.0.img_mlp.proj", "transformer_blocks.0.img_mlp.out", "modulation.1", "txt_in.in_layer",
    "img_in", "norm_out.linear")) + tuple(f"text_encoder.model.{m}" for m in (
    "language_model.layers.0.self_attn.q_proj", "language_model.layers.1.mlp.down_proj", "visual.blocks.0.attn.qkv"))
_DEMO_LORA_TARGETS = (
    ("transformer.*attn.to_[qkv]", "transformer.*attn.to_out.0", "text_encoder.*self_attn.[qkvo]_proj"),
    ("transformer.*img_mlp.*", "text_encoder.*language_model*mlp.*_proj"),
)


def _call_inputs(_fam, cfg, rows: int, latent_side: int, empty) -> dict:
    """One later-step transformer call for the bench's counts: the target's latent tokens after the bench prompt's
    19 (its tokens through the pipeline's template), whose keys and values the first step cached; the image-slot
    mask is a real CPU tensor, as the model lays out its sequence from it on the host (benchmarks/denoiser.py)."""
    tokens, text, heads = latent_side ** 2, 19, (cfg.num_attention_heads, cfg.attention_head_dim)
    cache = QwenImage21KVCache(cfg.num_layers)
    for layer in cache.layer_caches:
        layer.store(empty(rows, text, *heads), empty(rows, text, *heads))
    slots = torch.cat([torch.zeros(rows, text, dtype=torch.bool), torch.ones(rows, tokens // 4, dtype=torch.bool)], 1)
    return {"hidden_states": empty(rows, tokens, cfg.in_channels), "timestep": empty(rows), "img_mask": slots,
            "encoder_hidden_states": empty(rows, text, cfg.context_in_dim), "kv_cache": cache,
            "img_shapes": [[(1, latent_side, latent_side)]] * rows, "kv_cache_mode": "cached", "return_dict": False}


# The bench LoRAs' layers: attention and the SwiGLU in every block (224 of 232 linears).
_BENCH = BenchSpec(1024, _call_inputs, r"^transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0)|img_mlp\.\w+)$",
                   check=("--sections", "throughput,fp8", "--batches", "1", "--loras", "0,3", "--repeats", "2",
                          "--steps", "8"), check_s=200, check_order=5, offload_check_s=420,
                   check_title="Qwen-Image 2.1 1024² bf16, 8 steps, no CFG, vs QwenImage21Pipeline (none, 3 fused "
                               "LoRAs, PEFT), fp8 storage with none and 3 LoRAs as bypass; resting VRAM")


def _trained_like(pipe) -> None:
    """A random tiny model's attention is flat and its shared gates nearly shut, so the prompt moves its image
    by a tenth of an 8-bit level; a trained model's attention is sharp and its gates open. Query/key norms ×4,
    gate rows of the shared modulation ×10: the image follows the prompt (the demo's rule)."""
    transformer = pipe.transformer
    for block in transformer.transformer_blocks:
        block.attn.norm_q.weight.mul_(4)
        block.attn.norm_k.weight.mul_(4)
    gates = transformer.modulation[1].weight.view(4, transformer.inner_dim, -1)  # scale1, gate1, scale2, gate2
    gates[1::2].mul_(10)


QWEN_IMAGE_21 = Family(
    name="qwen-image-2.1",
    label="Qwen-Image 2.1",
    pipeline_class=SteadyQwenImage21Pipeline,
    diffusers_pipeline="QwenImage21Pipeline",
    text_encoders=(QWEN3_VL,),
    files=Files(ASSETS_DIR / "configs" / "qwen-image-2.1", marker_prefixes=DIT_PREFIXES, parts=_PARTS,
                checkpoint_markers=("txt_in.text_norm.weight", "transformer_blocks.0.img_mlp.gate_up.weight"),
                takes_embeddings=False),  # A1111 embeddings are CLIP vectors; Qwen3-VL has none
    denoiser_class=QwenImage21Transformer2DModel,
    vae_class=AutoencoderKLQwenImage21,
    **{**DIT_SHARED, "size_multiple": 32, "native_size": native_size},
    latent_format=LatentFormat(frames=True),  # the VAE's own per-channel statistics; preview fitted (preview.py)
    first_block="transformer_blocks.0",
    # 40 steps without guidance, true CFG above 1; Turbo: its `sample_sigmas`' count, a step-distilled model
    sampling=dataclasses.replace(
        QWEN_SAMPLING, default_steps=40, default_guidance=1.0,
        loaded_defaults=lambda pipe: (len(pipe.config.get("sample_sigmas") or ()) or 40, 1.0),
        step_distilled=lambda pipe: bool(pipe.config.get("sample_sigmas"))),
    reference_images=4,  # each adds 4,096 tokens (1024² / 16²) to every attention; the pipeline takes up to 10
    precision=Precision(
        fp16_ok=False,
        # fp8 storage keeps the embedders, the shared modulation and the final layers in the compute dtype
        high_precision=("img_in", "txt_in", "time_text_embed", "modulation", "norm_out", "proj_out", "lm_head"),
        # the timestep embedding's frequencies stay fp32 on a bf16 load, as diffusers' `from_pretrained` keeps them
        pinned_dtypes={**QWEN3_VL_PINNED, "transformer.time_text_embed.time_proj.freqs": torch.float32}),
    adapters=Adapters(markers=("qwen_image_2.1", "qwen-image-2.1", "qwen_image_21", "qwenimage21"),
                      native_modules=lora_aliases),
    test_kit=TestKit(tiny_configs=_TINY, tiny_trained=_trained_like, lora_targets=_LORA_TARGETS,
                     demo_lora_targets=_DEMO_LORA_TARGETS, bench=_BENCH))
FAMILIES = (QWEN_IMAGE_21,)
