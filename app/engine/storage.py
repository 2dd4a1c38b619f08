"""Weights stored in 8 bits, computed in the compute dtype: which layers, the cast, the hook.

Why: a model whose large matrices rest in fp8 takes about half the memory of bf16, at rest and on
the bus. The engine never computes in fp8: a `quant.dequant` hook widens a stored weight to the
layer's compute dtype for its forward and points back to the stored bytes afterwards (the same
`.data` swap streaming uses, so the Parameter object stays). Those bytes never change while the
model is loaded: LoRAs on such layers are bypass forwards in the compute dtype (app/adapters/
bypass.py), never fused and re-quantised, so a LoRA delta is not rounded to 3 mantissa bits and
removing it is bit-exact by construction.

Which layers: the weights of linear and convolution layers of the denoiser and the text
encoders. They stay in the compute dtype where peers keep high precision too: every norm and
embedding (not linear/conv, so never chosen), the VAE, biases, and the family's sensitive first
and last layers (`Family.high_precision`: SD's conv_in, conv_out, time and class embeddings,
text projection). The cast is a plain round-to-nearest cast (ComfyUI's `fp8_e4m3fn` weight
dtype does the same): e4m3 keeps ~2 significant digits up to ±448, ample for these weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from app.engine.placement import STORAGE_DTYPES
from app.families import Family
from app.hooks import HookRegistry, ModelHook

WEIGHTS_CHOICES = ("full", *STORAGE_DTYPES)  # "full": every weight in the compute dtype
_STORABLE = (torch.nn.Linear, torch.nn.Conv2d)

Stored = dict[str, dict[str, torch.dtype]]  # component -> {module path: storage dtype}


def layers_to_store(pipe, family: Family, weights: str) -> Stored:
    """The layers whose weight rests in `weights`' storage dtype (none for "full")."""
    if weights == "full":
        return {}
    dtype = STORAGE_DTYPES[weights]
    keep = re.compile("|".join(f"(?:^|\\.){re.escape(name)}(?:\\.|$)" for name in family.high_precision))
    out: Stored = {}
    for component in family.components:
        for path, module in getattr(pipe, component).named_modules():
            pinned = family.pinned_dtype(component, path, "weight") is not None
            if isinstance(module, _STORABLE) and not pinned and not (family.high_precision and keep.search(path)):
                out.setdefault(component, {})[path] = dtype
    return out


def store(pipe, layers: Stored) -> None:
    """Cast each chosen weight to its storage dtype in place (the Parameter object stays)."""
    with torch.no_grad():
        for component, paths in layers.items():
            root = getattr(pipe, component)
            for path, dtype in paths.items():
                weight = root.get_submodule(path).weight
                weight.data = weight.data.to(dtype)


class _Widen:
    """The `quant.dequant` hook of one layer: widened copy for the forward, stored bytes after."""

    def __init__(self, compute_dtype: torch.dtype) -> None:
        self.compute_dtype = compute_dtype
        self.stash: list[torch.Tensor] = []

    def pre(self, module, _args, _kwargs) -> None:
        weight = module._parameters["weight"]
        self.stash.append(weight.data)
        weight.data = weight.data.to(self.compute_dtype)

    def after(self, module) -> None:
        if self.stash:
            module._parameters["weight"].data = self.stash.pop()


def install_dequant(hooks: HookRegistry, pipe, layers: Stored, compute_dtypes: Mapping[str, torch.dtype]) -> None:
    """Give every stored layer its `quant.dequant` hook, widening to its component's compute dtype."""
    for component, paths in layers.items():
        root = getattr(pipe, component)
        for path in paths:
            widen = _Widen(compute_dtypes[component])
            hooks.add(root.get_submodule(path), ModelHook("quant.dequant", pre=widen.pre, after=widen.after))


def bytes_saved(pipe, layers: Stored, compute_dtypes: Mapping[str, torch.dtype]) -> int:
    """How many bytes the stored weights save against holding them in the compute dtype."""
    saved = 0
    for component, paths in layers.items():
        wide = torch.empty((), dtype=compute_dtypes[component]).element_size()
        root = getattr(pipe, component)
        for path in paths:
            weight = root.get_submodule(path).weight
            saved += weight.numel() * (wide - weight.element_size())
    return saved
