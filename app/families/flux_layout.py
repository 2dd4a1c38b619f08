"""FLUX.1 names: diffusers' `FluxTransformer2DModel` versus Black Forest Labs' original layout.

BFL's files (and ComfyUI/Forge, which keep them) name blocks `double_blocks.N` / `single_blocks.N`
and fuse projections diffusers keeps apart: a double block's `img_attn.qkv` is diffusers'
`attn.to_q`, `to_k`, `to_v` stacked by rows (`txt_attn.qkv` the `add_*_proj` ones), a single
block's `linear1` is `to_q`, `to_k`, `to_v` and `proj_mlp`; RMS norms store `scale` where diffusers
says `weight`; the final modulation stores (shift, scale) where diffusers' AdaLayerNormContinuous
reads (scale, shift). The table below is per module; row ranges come from the model's own module
shapes, in the fused order, so the same code serves the 12B model and the tiny demo.

xlabs LoRAs name the same fused projections after their attention processors
(`double_blocks.N.processor.qkv_lora1` = `img_attn.qkv`, `…lora2` the text stream, `proj_lora1/2` the
output projections; `single_blocks.N.processor.qkv_lora` = the q/k/v rows of `linear1`, `proj_lora` =
`linear2`, diffusers' `proj_out`, as diffusers' xlabs converter reads them): `xlabs_modules` spells them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from app.families.file_layout import FileTensor, Layout, Rows, module_parts
from app.families.ldm_layout import LYCORIS

KOHYA_BFL = "kohya (BFL block names)"
BFL = "BFL/ComfyUI (diffusion_model.)"

_TOP = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
# diffusers module (inside a block) -> BFL module; fused ones list their parts in row order.
# A double block's attention, the same in FLUX.1 and FLUX.2 (klein_layout): norms, output projections, fused q/k/v.
DOUBLE_ATTENTION = {
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
}
DOUBLE_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_DOUBLE = {
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    **DOUBLE_ATTENTION,
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
}
_SINGLE = {
    "norm.linear": "modulation.lin",
    "attn.norm_q": "norm.query_norm",
    "attn.norm_k": "norm.key_norm",
    "proj_out": "linear2",
}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_BLOCKS = (("transformer_blocks", "double_blocks", _DOUBLE, DOUBLE_FUSED),
           ("single_transformer_blocks", "single_blocks", _SINGLE, _SINGLE_FUSED))
_XLABS_DOUBLE = {"processor.qkv_lora1": "img_attn.qkv", "processor.qkv_lora2": "txt_attn.qkv",
                 "processor.proj_lora1": "img_attn.proj", "processor.proj_lora2": "txt_attn.proj"}
_XLABS_SINGLE = {"processor.qkv_lora": "linear1", "processor.proj_lora": "linear2"}


@dataclass(frozen=True)
class BflNames:
    """One BFL transformer layout: top-level modules, and per block list (diffusers list, BFL list,
    plain modules, fused modules with their parts in row order). FLUX.1's below; FLUX.2's in klein_layout."""

    top: Mapping[str, str]
    blocks: tuple[tuple[str, str, Mapping[str, str], Mapping[str, tuple[str, ...]]], ...]
    label: str  # what an error calls the model


FLUX1 = BflNames(_TOP, _BLOCKS, "Flux")


def _module_rows(transformer: torch.nn.Module, names: BflNames) -> dict[str, tuple[str, Rows | None]]:
    """diffusers module path -> (BFL module path, its rows there, None for the whole tensor)."""
    table: dict[str, tuple[str, Rows | None]] = dict((k, (v, None)) for k, v in names.top.items())
    if "norm_out.linear" in names.top:  # a ControlNet has no final layer
        half = transformer.norm_out.linear.out_features // 2
        table["norm_out.linear"] = (names.top["norm_out.linear"], ((half, 2 * half), (0, half)))
    for ours, theirs, plain, fused in names.blocks:
        for i, block in enumerate(getattr(transformer, ours)):
            table.update({f"{ours}.{i}.{k}": (f"{theirs}.{i}.{v}", None) for k, v in plain.items()})
            for bfl, parts in fused.items():
                start = 0
                for part in parts:
                    stop = start + block.get_submodule(part).out_features
                    table[f"{ours}.{i}.{part}"] = (f"{theirs}.{i}.{bfl}", ((start, stop),))
                    start = stop
    return table


def bfl_layout(transformer: torch.nn.Module, names: BflNames) -> Layout:
    """Every tensor of a diffusers Flux transformer -> its BFL key (and rows); refuses a module the
    table does not know, so a changed diffusers layout fails loudly instead of dropping weights."""
    rows = _module_rows(transformer, names)
    layout = {}
    for name, _tensor in transformer.state_dict().items():
        module, _, param = name.rpartition(".")
        if module not in rows:
            raise ValueError(f"{names.label} transformer tensor {name!r} has no BFL name")
        bfl, cut = rows[module]
        file_param = "scale" if bfl.endswith(("query_norm", "key_norm")) else param
        layout[name] = FileTensor(f"{bfl}.{file_param}", cut)
    return layout


def transformer_layout(transformer: torch.nn.Module) -> Layout:
    """A `FluxTransformer2DModel`'s tensors under their BFL keys."""
    return bfl_layout(transformer, FLUX1)


def xlabs_controlnet_layout(controlnet: torch.nn.Module) -> Layout:
    """A `FluxControlNetModel` read from an XLabs ControlNet file (x-flux's `ControlNetFlux`): BFL names for
    the embedders and double blocks (no single blocks, no final layer), `pos_embed_input` for diffusers'
    `controlnet_x_embedder`, and the hint encoder as one `Sequential` whose convolutions sit at every other
    index (SiLUs between): diffusers' `conv_in`, `blocks.*`, `conv_out`."""
    hint = len(controlnet.input_hint_block.blocks)
    top = {k: v for k, v in _TOP.items() if k not in ("proj_out", "norm_out.linear")}
    top |= {"controlnet_x_embedder": "pos_embed_input", "input_hint_block.conv_in": "input_hint_block.0",
            "input_hint_block.conv_out": f"input_hint_block.{2 * hint + 2}",
            **{f"input_hint_block.blocks.{i}": f"input_hint_block.{2 * i + 2}" for i in range(hint)},
            **{f"controlnet_blocks.{i}": f"controlnet_blocks.{i}" for i in range(len(controlnet.controlnet_blocks))}}
    return bfl_layout(controlnet, BflNames(top, _BLOCKS[:1], "XLabs Flux ControlNet"))


def bfl_aliases(transformer: torch.nn.Module, layout: Layout):
    """(key, parts, spelling) for every BFL module of `layout` as kohya (`lora_unet_double_blocks_0_img_attn_qkv`),
    LyCORIS over BFL names and ComfyUI (`diffusion_model.double_blocks.0.img_attn.qkv`) spell it; a fused
    module lists its row slices, so a LoRA on it is cut exactly into the diffusers modules it covers."""
    for bfl, found in module_parts(layout).items():
        targets = tuple((("transformer", path), rows) for path, rows in found)
        flat = bfl.replace(".", "_")
        yield f"lora_unet_{flat}", targets, KOHYA_BFL
        yield f"lycoris_{flat}", targets, LYCORIS
        yield f"diffusion_model.{bfl}", targets, BFL


def xlabs_modules(transformer: torch.nn.Module) -> dict[str, str]:
    """xlabs LoRA layer names -> the BFL module they patch (a single block's `qkv_lora` covers only
    the q/k/v rows of `linear1`, which the caller cuts)."""
    names = {}
    for blocks, bfl, table in ((transformer.transformer_blocks, "double_blocks", _XLABS_DOUBLE),
                               (transformer.single_transformer_blocks, "single_blocks", _XLABS_SINGLE)):
        for i in range(len(blocks)):
            names.update({f"{bfl}.{i}.{k}": f"{bfl}.{i}.{v}" for k, v in table.items()})
    return names
