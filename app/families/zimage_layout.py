"""Z-Image names: diffusers' `ZImageTransformer2DModel` versus the original (Tongyi / ComfyUI) layout.

The original code, and the ComfyUI files made from it (`z_image_turbo_bf16.safetensors`, bare or
under `model.diffusion_model.`), name every module as diffusers does but four: each attention
block stores `to_q`, `to_k`, `to_v` stacked by rows as one `attention.qkv`, its output projection
as `attention.out`, its q/k RMS norms as `q_norm`/`k_norm`; the patch embedder and the final layer
sit at the top level (`x_embedder`, `final_layer`) where diffusers keys them by patch size in a
ModuleDict (`all_x_embedder["2-1"]`). diffusers' own converter
(`convert_z_image_transformer_checkpoint_to_diffusers`) reads the same table; here it is built per
module from the model's shapes, so the tiny demo model and the 6B one go through the same code, and
the rows of the fused `qkv` are each projection's own out-features, not a guess that they are equal.
"""

from __future__ import annotations

import torch

from app.families.file_layout import FileTensor, Layout

_RENAMED = {"attention.to_out.0": "attention.out", "attention.norm_q": "attention.q_norm",
            "attention.norm_k": "attention.k_norm"}
_FUSED = ("attention.to_q", "attention.to_k", "attention.to_v")  # `attention.qkv`, in row order
_KEYED = {"all_x_embedder": "x_embedder", "all_final_layer": "final_layer"}  # ModuleDicts by "<patch>-<f patch>"


def _original_module(module: str, patch_key: str) -> str:
    """The original name of a diffusers module path (not a fused projection)."""
    head, _, rest = module.partition(".")
    if head in _KEYED:
        key, _, inner = rest.partition(".")
        if key != patch_key:
            raise ValueError(f"Z-Image transformer module {module!r}: only the {patch_key} patch size has an "
                             "original name")
        return ".".join(p for p in (_KEYED[head], inner) if p)
    for ours, theirs in _RENAMED.items():
        if module.endswith(ours):
            return module[: -len(ours)] + theirs
    return module


def transformer_layout(transformer: torch.nn.Module) -> Layout:
    """Every tensor of a `ZImageTransformer2DModel` -> its original key (and rows, inside `qkv`)."""
    config = transformer.config
    patch_key = f"{config.all_patch_size[0]}-{config.all_f_patch_size[0]}"
    layout = {}
    for name in transformer.state_dict():
        module, _, param = name.rpartition(".")
        block, _, proj = module.rpartition(".attention.")
        fused = f"attention.{proj}" if block else ""
        if fused in _FUSED:
            attention = transformer.get_submodule(f"{block}.attention")
            widths = [attention.get_submodule(p.removeprefix("attention.")).out_features for p in _FUSED]
            start = sum(widths[: _FUSED.index(fused)])
            layout[name] = FileTensor(f"{block}.attention.qkv.{param}", ((start, start + widths[_FUSED.index(fused)]),))
        else:
            layout[name] = FileTensor(f"{_original_module(module, patch_key)}.{param}" if module else name)
    return layout
