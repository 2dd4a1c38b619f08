"""Delta-weight math for every LoRA-family algorithm.

Each algorithm is a frozen dataclass whose named fields hold the adapter's tensors exactly as
they came out of the file: dtype untouched, so a fp16 file costs fp16 memory while it waits;
`to(device)` moves them (the patcher uploads each LoRA to the compute device once). The
questions asked of it, in this order:

* `from_tensors(layer, tensors)` builds it from one layer's suffix dict and checks the tensors
  against each other (rank mismatch, missing partner keys): `AdapterFormatError`.
* `validate_against(base_weight_shape)` checks shapes only, no arithmetic, against the target
  weight: `IncompatibleAdapterError`. The patcher runs it on every layer before its first write,
  so a LoRA made for another model is refused whole instead of half-applied.
* `delta(base_weight, base_bias)` returns `Delta(weight=ΔW, bias=Δb)` in float32 on the base
  weight's device, shaped exactly like the base weight and bias. Adapter tensors are cast to
  (that device, float32) at this moment and never earlier, so a bf16 file, a bf16 model and a
  CPU-held file patched into a GPU weight all take the same path and none of them computes in
  half precision.
* `accumulate(acc, base_weight, base_bias, m)` adds m·ΔW into a float32 accumulator in place (what
  the patcher sums a layer with); plain LoRA does it as one multiply-add without building ΔW.
  `reads_base` marks the algorithms whose ΔW depends on W0's values (GLoRA, DoRA, IA3, OFT): for
  the others the patcher passes the accumulator itself as W0, whose shape is all they read.

`parse_layer` picks the class from the set of suffixes present (a registry of key sets, one entry
per algorithm); `dora_scale` is a modifier that wraps whichever low-rank algorithm it accompanies.

Strength convention. The patcher computes W = W0 + Σ mᵢ·ΔWᵢ with every ΔWᵢ taken against the
original W0 (never against another adapter's output). For algorithms whose ΔW depends on W
(GLoRA, DoRA, IA3, OFT) ΔW = W′ − W0 is the effective change at full strength, and a strength m
scales that effective change linearly:

* GLoRA, IA3 and OFT: this equals LyCORIS's own multiplier (ΔW·m; W ⊙ (1 + m·w);
  (m·R + (1 − m)·I)ᵀ·W are all linear in m).
* DoRA: m interpolates linearly between W0 (m = 0) and the DoRA-normalised weight W′ (m = 1),
  extrapolating beyond. LyCORIS instead scales the inner ΔW by m and blends the magnitude ratio,
  so tools agree at m = 1 and differ elsewhere; ours (also ComfyUI's) is the one that fits
  W0 + Σ m·ΔW.

Scale. Low-rank algorithms scale by s = alpha / rank; `alpha` absent or 0 means s = 1 (kohya and
LyCORIS write 0 for "alpha = rank"). LoHa and LoKr are scaled exactly once: LyCORIS's own merge
path applies alpha/rank a second time when alpha ≠ rank, which over- or under-shoots the trained
weights; we follow the training-time forward instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from app.adapters.algos.base import Adapter, Delta
from app.adapters.algos.direct import Full, Norm
from app.adapters.algos.dora import DoRA
from app.adapters.algos.glora import GLoRA
from app.adapters.algos.ia3 import IA3
from app.adapters.algos.loha import LoHa
from app.adapters.algos.lokr import LoKr
from app.adapters.algos.lora import LoRA
from app.adapters.algos.oft import OFT
from app.adapters.errors import AdapterFormatError

__all__ = [
    "IA3",
    "OFT",
    "Adapter",
    "Delta",
    "DoRA",
    "Full",
    "GLoRA",
    "LoHa",
    "LoKr",
    "LoRA",
    "Norm",
    "SUFFIXES",
    "parse_layer",
]


# ------------------------------------------------------------------------------------- registry
# Marker sets are disjoint, so at most one algorithm can claim a key set; DoRA is not listed
# because it is a modifier: `parse_layer` peels it off and parses what it wraps.
_ALGORITHMS: tuple[type[Adapter], ...] = (LoRA, LoHa, LoKr, GLoRA, Full, Norm, IA3, OFT)
# Every per-layer suffix some algorithm reads: what `app.adapters.keys` may cut off a tensor key.
SUFFIXES: frozenset[str] = frozenset().union(DoRA.keys, *(algo.keys for algo in _ALGORITHMS))


def parse_layer(layer: str, tensors: Mapping[str, Tensor]) -> Adapter:
    """Pick the algorithm for one layer's suffix dict (kohya/LyCORIS suffixes plus `alpha`).

    Diffusers/PEFT spellings are normalised before they get here; anything unrecognised is an
    AdapterFormatError that lists the keys found, never a silent skip.
    """
    if "dora_scale" in tensors:
        rest = {k: v for k, v in tensors.items() if k != "dora_scale"}
        return DoRA.from_tensors(layer, tensors, parse_layer(layer, rest) if rest else None)
    found = frozenset(tensors)
    for algo in _ALGORITHMS:
        if found & algo.markers and found <= algo.keys:
            return algo.from_tensors(layer, tensors)
    raise AdapterFormatError(_unknown_keys_message(layer, found))


def _unknown_keys_message(layer: str, found: frozenset[str]) -> str:
    for algo in _ALGORITHMS:
        if found & algo.markers:
            return (
                f"{layer}: keys {sorted(found)} look like {algo.algo} but "
                f"{sorted(found - algo.keys)} do not belong to it"
            )
    known = "; ".join(f"{a.algo}: {', '.join(sorted(a.markers))}" for a in _ALGORITHMS)
    return f"{layer}: unrecognised adapter keys {sorted(found)} (known formats — {known}; plus dora_scale)"
