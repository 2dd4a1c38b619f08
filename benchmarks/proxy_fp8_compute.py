"""The fp8-compute CPU proxy: what one denoiser call does with its fp8 weights, counted by op and
dtype instead of timed (a CPU has no fp8 tensor cores, so its time says nothing of a GPU's).

Why this is the proxy: fp8 storage runs below bf16 speed because every stored layer widens its
weight to the compute dtype in every forward (one weight-sized `_to_copy` from fp8 per layer per
call) and then multiplies in bf16. `--weights fp8-compute` removes both for the Linear layers that
qualify: no widening cast, and the product runs as `_scaled_mm` on fp8 operands. Counted per call:
widening casts (fp8 → wider; how many elements they write), quantising casts (→ fp8, the per-token
input quantisation), and matrix products by op and operand dtype. A widening cast that comes back
for a qualifying layer shows here as a count above the layers that are meant to widen
(tests/test_fp8_matmul.py asserts it).
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import torch

from app.engine import storage
from app.engine.placement import STORAGE_DTYPES
from app.families import family
from app.hooks import HookRegistry
from benchmarks.config import PRESETS
from benchmarks.denoiser import call_inputs, meta_denoiser
from benchmarks.measure import OpCounter
from benchmarks.proxy_ops import latent_side

_NARROW = frozenset(STORAGE_DTYPES.values())
_PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_scaled_mm", "convolution"})


class Fp8OpCounter(OpCounter):
    """`OpCounter` that also sorts casts and matrix products by dtype (see the module docstring)."""

    def __init__(self, denoiser: torch.nn.Module) -> None:
        super().__init__(denoiser)
        self.kinds: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = str(func.overloadpacket).removeprefix("aten."), kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "_to_copy" and source is not None:
            target = kwargs.get("dtype", source.dtype)
            if source.dtype in _NARROW and target not in _NARROW:
                self.kinds["widen"] += 1
                self.kinds["widened elements"] += source.numel()
            elif target in _NARROW:
                self.kinds["quantise"] += 1
        elif name in _PRODUCTS and source is not None:
            self.kinds[f"{name} {str(source.dtype).removeprefix('torch.')}"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def kinds_per_call(self) -> dict[str, float]:
        return {kind: count / self.calls for kind, count in sorted(self.kinds.items())} if self.calls else {}


def _stored_denoiser(family_name: str, weights: str) -> torch.nn.Module:
    """The full-size denoiser on the meta device in bf16, its large weights stored as `weights` stores
    them and its `quant.dequant` hooks (or fp8 forwards) installed, as the engine's load does."""
    fam = family(family_name)
    config = fam.denoiser_class.load_config(fam.files.config_dir / fam.denoiser)
    denoiser = meta_denoiser(family_name, config, torch.bfloat16)
    pipe = SimpleNamespace(**{**dict.fromkeys(fam.components, torch.nn.Module()), fam.denoiser: denoiser})
    stored = {fam.denoiser: storage.layers_to_store(pipe, fam, weights).get(fam.denoiser, {})}
    matmul = storage.matmul_layers(pipe, stored, weights, torch.bfloat16)
    storage.store(pipe, stored, matmul)
    storage.install_dequant(HookRegistry(), pipe, stored, {fam.denoiser: torch.bfloat16}, matmul)
    return denoiser


def fp8_compute_section(family_name: str, config) -> dict[str, Any]:
    """Casts and matrix products per call of the full-size denoiser at the GPU bench's resolution (meta
    device, batch 1): fp8 storage against fp8-compute."""
    side = latent_side(family_name)
    counts = {}
    for weights in ("fp8", "fp8-compute"):
        denoiser = _stored_denoiser(family_name, weights)
        inputs = call_inputs(family_name, denoiser, 1, side)
        counter = Fp8OpCounter(denoiser)
        try:
            with torch.no_grad():
                denoiser(**inputs)
        finally:
            counter.remove()
        counts[weights] = counter.kinds_per_call()
    return {"family": family_name, "resolution": PRESETS["full"].resolution[family_name], "latent_side": side,
            "per_call": counts}
