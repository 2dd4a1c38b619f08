"""Krea 2 (base and Turbo): a single-stream DiT over 2×2 patches of Qwen-Image's 16-channel VAE latents, reading
twelve hidden states tapped from Qwen3-VL-4B's layers, fused by its own small text transformer; 1024² native
size (Krea AI; diffusers' `Krea2Pipeline`).

Guidance is CFG read as Krea writes it (`cond + g·(cond − uncond)`, on above 0), which is A1111's CFG at g + 1:
the page's CFG 5.5 is the model card's 4.5, CFG 1 runs no unconditional pass. The sigmas take the
resolution-aware exponential shift (the scheduler's, from the image's token count); Turbo (`is_distilled`: the
few-step TDM checkpoint) a fixed shift, 8 steps without guidance, filled in on load.

Files: a diffusers folder; or Krea's / ComfyUI's transformer (bf16, or fp8 with `weight_scale`; names:
`krea_layout.py`; Turbo where the file's name says "turbo", "tdm" or "distill") with the Qwen3-VL encoder in
`models/text_encoder` and Qwen-Image's VAE in `models/VAE` (`qwen_vae.py`), or an all-in-one under ComfyUI's
prefixes. No img2img or inpaint (diffusers has no such Krea 2 pipeline: refused by name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch
from diffusers import AutoencoderKLQwenImage, Krea2Pipeline, Krea2Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLModel

from app.families import (
    ASSETS_DIR,
    DEMO_SIDE,
    Adapters,
    BenchSpec,
    ComponentFile,
    Family,
    Files,
    Precision,
    TestKit,
    TextEncoder,
)
from app.families.file_layout import own_names
from app.families.flow_dit import DIT_PREFIXES, DIT_SHARED, FLOW_SAMPLING
from app.families.krea_layout import lora_aliases, transformer_layout
from app.families.pipelines import PackedPatches, VariedNoise
from app.families.qwen3 import QWEN3_TOKENIZER_DIR, BundledQwen3Tokenizer
from app.families.qwen3_vl import QWEN3_VL_PINNED, TINY_QWEN3_VL
from app.families.qwen_vae import QWEN_IMAGE_LATENTS, QWEN_IMAGE_VAE_PART, TINY_QWEN_IMAGE_VAE


class SteadyKrea2Pipeline(PackedPatches, VariedNoise, Krea2Pipeline):
    """Krea 2 txt2img. It packs 2×2 patches as FLUX.1 does; its unpacking adds the VAE's frame axis, which the
    engine's spatial latents leave out."""

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return latents if latents.dim() == 4 else self._unpack_latents(latents, height, width)[:, :, 0]


def _distilled_flag(path: Path) -> Mapping[str, object]:
    """A single file is Turbo (the TDM-distilled checkpoint) where its name says so; a folder states it."""
    return {"is_distilled": any(word in path.name.lower() for word in ("turbo", "tdm", "distill"))}


# The pipeline reads the prompt as text through its own template, padded to 512 tokens (`reads="text"`), and taps
# `Qwen3VLModel`'s hidden states (no LM head); a file holds transformers' names under `model.` (its `lm_head`, if
# any, unread), in an all-in-one under ComfyUI's `text_encoders.qwen3vl_4b.transformer.`.
QWEN3_VL_4B = TextEncoder("text_encoder", "tokenizer", Qwen3VLModel, "text_encoders.qwen3vl_4b.transformer.model.",
                          config_class=Qwen3VLConfig, tokenizer_class=BundledQwen3Tokenizer,
                          tokenizer_dir=QWEN3_TOKENIZER_DIR, reads="text", chunked=False)
_PARTS = (
    ComponentFile("transformer", "transformer", Krea2Transformer2DModel, ("model.diffusion_model.", ""),
                  "txtfusion.projector.weight", transformer_layout),
    ComponentFile("text_encoder", "Qwen3-VL text encoder (qwen3vl_4b.safetensors)", Qwen3VLModel,
                  (QWEN3_VL_4B.single_file_prefix, "model.", ""), "language_model.layers.0.self_attn.q_proj.weight",
                  own_names, folder="text_encoder_dir", config_class=Qwen3VLConfig),
    QWEN_IMAGE_VAE_PART,
)
# Tiny: the real 64 patch channels, 12 taps of a 36-layer encoder (the pipeline's own layer indices) and two
# fusion blocks of each kind; 2 blocks of 2 query heads × 8 and 1 key/value head, rope axes 2/2/4.
_TINY = MappingProxyType({
    "transformer": dict(in_channels=64, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=32,
                        num_text_layers=12, text_num_attention_heads=2, text_num_key_value_heads=2,
                        text_intermediate_size=32, axes_dims_rope=(2, 2, 4)),
    "vae": TINY_QWEN_IMAGE_VAE,
    "text_encoder": {**TINY_QWEN3_VL, "text_config": {**TINY_QWEN3_VL["text_config"], "num_hidden_layers": 36}},
})
# Every layer kind: attention (q, out, gate), the SwiGLU halves and its output, the text fusion's blocks and layer
# projector, the shared modulation, the embedders, the final layer, and Qwen3-VL's attention and MLP (layer 1: its
# output is the first tap).
_LORA_TARGETS = tuple(f"transformer.{m}" for m in (
    "transformer_blocks.0.attn.to_q", "transformer_blocks.*.attn.to_out.0", "transformer_blocks.1.attn.to_gate",
    "transformer_blocks.0.ff.gate", "transformer_blocks.1.ff.down", "text_fusion.layerwise_blocks.0.attn.to_k",
    "text_fusion.refiner_blocks.1.ff.up", "text_fusion.projector", "time_mod_proj", "txt_in.linear_1", "img_in",
    "final_layer.linear")) + tuple(f"text_encoder.{m}" for m in (
        "language_model.layers.0.self_attn.q_proj", "language_model.layers.1.mlp.down_proj"))
_DEMO_LORA_TARGETS = (
    ("transformer.*attn.to_[qkv]", "transformer.*attn.to_out.0", "text_encoder.*self_attn.[qkvo]_proj"),
    ("transformer.*ff.*", "text_encoder.*language_model*mlp.*_proj"),
)


def _call_inputs(_fam, cfg, rows: int, latent_side: int, empty) -> dict:
    """One transformer call for the bench's op counts: 2×2 latent patches as a sequence, the twelve tapped states
    of the 512-token padded prompt and its mask, 3 position axes over text and image (its shapes are static: it
    counts on the meta device)."""
    tokens, text = (latent_side // 2) ** 2, 512
    return {"hidden_states": empty(rows, tokens, cfg.in_channels),
            "encoder_hidden_states": empty(rows, text, cfg.num_text_layers, cfg.text_hidden_dim),
            "timestep": empty(rows), "position_ids": empty(text + tokens, 3), "return_dict": False}


# The bench LoRAs' layers: attention projections (gate included) and the SwiGLU in every block.
_BENCH = BenchSpec(1024, _call_inputs,
                   r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_gate|to_out\.0)|ff\.(gate|up|down))$")


def _groups(component: str, module: torch.nn.Module) -> list[torch.nn.Module] | None:
    """`group` offload's groups: `Qwen3VLModel` embeds the prompt itself (its `language_model.embed_tokens`)
    before it calls its language model, so the language model's parts are groups of their own; elsewhere the
    generic rule (None)."""
    if component != "text_encoder":
        return None
    language = module.language_model
    return [module.visual, language.embed_tokens, *language.layers, language.norm, language.rotary_emb]


def _trained_like(pipe) -> None:
    """A random tiny model's attention is flat and its gates nearly shut (the shared modulation's rows are small,
    the blocks' tables zero), so the prompt moves its image by a twentieth of an 8-bit level; a trained model's
    attention is sharp and its gates open. Query/key norms ×4 (zero-centred scales: 1 + 3), both gates of each
    block's table opened by 1: the image follows the prompt (the demo's rule)."""
    transformer = pipe.transformer
    fusion = transformer.text_fusion
    for block in (*transformer.transformer_blocks, *fusion.layerwise_blocks, *fusion.refiner_blocks):
        block.attn.norm_q.weight.fill_(3)
        block.attn.norm_k.weight.fill_(3)
    for block in transformer.transformer_blocks:
        block.scale_shift_table[2::3].add_(1)  # prescale, preshift, pregate, postscale, postshift, postgate


KREA_2 = Family(
    name="krea-2",
    label="Krea 2",
    pipeline_class=SteadyKrea2Pipeline,
    diffusers_pipeline="Krea2Pipeline",
    text_encoders=(QWEN3_VL_4B,),
    files=Files(ASSETS_DIR / "configs" / "krea-2", marker_prefixes=DIT_PREFIXES, parts=_PARTS,
                checkpoint_markers=("txtfusion.projector.weight", "blocks.0.mod.lin"), pipeline_kwargs=_distilled_flag,
                takes_embeddings=False),  # A1111 embeddings are CLIP vectors; Qwen3-VL has none
    denoiser_class=Krea2Transformer2DModel,
    vae_class=AutoencoderKLQwenImage,
    **{**DIT_SHARED,
       # 1024² as the model card makes it; a demo-size model (under 1024 wide) the demo's side
       "native_size": lambda pipe: 1024 if pipe.transformer.hidden_size >= 1024 else DEMO_SIDE},
    latent_format=QWEN_IMAGE_LATENTS,
    first_block="transformer_blocks.0",
    blocks=_groups,
    # the model card's 28 steps at Krea's guidance 4.5 (CFG 5.5); Turbo: 8 steps, no guidance
    sampling=dataclasses.replace(
        FLOW_SAMPLING, default_steps=28, default_guidance=5.5, guidance_call=lambda cfg: {"guidance_scale": cfg - 1},
        loaded_defaults=lambda pipe: (8, 1.0) if pipe.config.is_distilled else (28, 5.5),
        step_distilled=lambda pipe: bool(pipe.config.is_distilled)),
    precision=Precision(
        fp16_ok=False,
        # fp8 storage keeps the embedders, the shared modulation, the layer projector and the final layer
        high_precision=("img_in", "time_embed", "time_mod_proj", "txt_in", "text_fusion.projector", "final_layer"),
        # the RMSNorm scales stay fp32 on a bf16 load, as diffusers' `_keep_in_fp32_modules` keeps them
        pinned_dtypes={**QWEN3_VL_PINNED, "transformer.*norm*": torch.float32}),
    adapters=Adapters(markers=("krea-2", "krea_2", "krea2"), native_modules=lora_aliases),
    test_kit=TestKit(tiny_configs=_TINY, tiny_trained=_trained_like, lora_targets=_LORA_TARGETS,
                     demo_lora_targets=_DEMO_LORA_TARGETS, bench=_BENCH))
FAMILIES = (KREA_2,)
