"""FLUX.2 Klein names: diffusers' `Flux2Transformer2DModel`, `AutoencoderKLFlux2` and `Qwen3ForCausalLM`
versus the files Black Forest Labs and ComfyUI ship.

Transformer (BFL's `flux-2-klein-4b.safetensors`, ComfyUI's `diffusion_models/`, bare or under
`model.diffusion_model.`): the FLUX.1 naming scheme (`double_blocks.N`, `single_blocks.N`, `img_in`,
`txt_in`, `time_in`, RMS-norm `scale`, the final modulation's (shift, scale) halves swapped), with
FLUX.2's differences: modulation is shared per stream at the top (`double_stream_modulation_img.lin`,
`…_txt.lin`, `single_stream_modulation.lin`), the MLPs are SwiGLU (`img_mlp.0` = `ff.linear_in`), and
diffusers keeps a single block fused as BFL does (`linear1` = `attn.to_qkv_mlp_proj`, `linear2` =
`attn.to_out`). Only a double block's `img_attn.qkv` / `txt_attn.qkv` are cut into diffusers' q, k, v,
by rows, as diffusers' own converter cuts them (`convert_flux2_transformer_checkpoint_to_diffusers`).

VAE (BFL's `flux2-vae.safetensors`): the LDM layout (`encoder.down.0.block.0…`), with the quant convs
inside their halves (`encoder.quant_conv`, `decoder.post_quant_conv`) and the latent batch-norm
statistics at the top (`bn.running_mean`, `bn.running_var`).

Qwen3 (ComfyUI's `qwen_3_4b.safetensors`, `qwen_3_8b*.safetensors`): transformers' own names. Its
`lm_head` is never read (the pipeline takes hidden states), so the bundled configs tie it to the
embedding, as InvokeAI does, and a file's own `lm_head` is left unread.
"""

from __future__ import annotations

import torch

from app.families.file_layout import FileTensor, Layout
from app.families.flux_layout import DOUBLE_ATTENTION, DOUBLE_FUSED, BflNames, bfl_layout
from app.families.ldm_layout import vae_layout as ldm_vae_layout

_TOP = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
_DOUBLE = {
    **DOUBLE_ATTENTION,
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
_SINGLE = {
    "attn.to_qkv_mlp_proj": "linear1",
    "attn.to_out": "linear2",
    "attn.norm_q": "norm.query_norm",
    "attn.norm_k": "norm.key_norm",
}
FLUX2 = BflNames(_TOP, (("transformer_blocks", "double_blocks", _DOUBLE, DOUBLE_FUSED),
                        ("single_transformer_blocks", "single_blocks", _SINGLE, {})), "FLUX.2")
# BFL's FLUX.2 VAE keeps the quant convs inside the encoder and decoder (LDM puts them at the top).
_VAE_MOVED = {"quant_conv.": "encoder.quant_conv.", "post_quant_conv.": "decoder.post_quant_conv."}


def transformer_layout(transformer: torch.nn.Module) -> Layout:
    """A `Flux2Transformer2DModel`'s tensors under their BFL keys (double-block q/k/v as row slices)."""
    return bfl_layout(transformer, FLUX2)


def vae_layout(vae: torch.nn.Module) -> Layout:
    """An `AutoencoderKLFlux2`'s tensors under BFL's `flux2-vae.safetensors` keys."""
    layout = {}
    for name, where in ldm_vae_layout(vae).items():
        moved = next((new + where.key[len(old):] for old, new in _VAE_MOVED.items() if where.key.startswith(old)),
                     where.key)
        layout[name] = FileTensor(moved, where.rows, where.unit_dims)
    return layout
