"""Per-layer tensors of every adapter algorithm, for synthetic adapter files (app/adapters/synthetic.py).

An *algorithm* is one small function that, given a target layer (its kind and float32 weight), a
rank and a random source, returns that layer's tensors under their kohya/LyCORIS suffixes
(`lora_down.weight`, `hada_w1_a`, `oft_blocks`, …), or None where it does not apply (a Tucker core
on a linear layer, a norm adapter on a conv). Sizes are chosen so that at strength 1 every
algorithm changes a layer by about `strength` times the weight's RMS: a bf16 model sees every
delta, and the tiny model's image changes visibly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

Draw = Callable[..., Tensor]  # draw(*shape) -> standard-normal float32 tensor
Tensors = dict[str, Tensor]
LAYER_KINDS = ((torch.nn.Linear, "linear"), (torch.nn.Conv2d, "conv"),
               ((torch.nn.GroupNorm, torch.nn.LayerNorm), "norm"))


@dataclass(frozen=True, eq=False)
class Layer:
    """What an algorithm function sees of its target: kind, float32 weight (and bias) copies."""

    kind: str  # "linear" | "conv" | "norm"
    weight: Tensor
    bias: Tensor | None

    @property
    def out_dim(self) -> int:
        return self.weight.shape[0]

    @property
    def in_dim(self) -> int:
        return self.weight.shape[1]

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(self.weight.shape[2:])

    @property
    def ones(self) -> tuple[int, ...]:
        """Trailing 1s that give a factor the weight's number of dimensions."""
        return (1,) * len(self.kernel)

    def amp(self, strength: float) -> float:
        """Target RMS of ΔW: `strength` times the weight's RMS."""
        return strength * float(self.weight.pow(2).mean().sqrt())


# ----------------------------------------------------------------------------- algorithm helpers
def _chain_scale(rank: int, factors: int) -> float:
    """Per-factor scale that makes a product of `factors` normal factors over rank r have RMS 1."""
    return rank ** (-(factors - 1) / (2 * factors))


def _split(n: int) -> tuple[int, int]:
    """n = a·b with a the largest divisor not above √n (LyCORIS puts the small factor first)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


def _weighty(layer: Layer) -> bool:
    return layer.kind in ("linear", "conv")


def _has_kernel(layer: Layer) -> bool:
    return layer.kind == "conv" and math.prod(layer.kernel) > 1


# ----------------------------------------------------------------------------------- algorithms
def _lora(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """LoRA / LoCon: down carries the conv kernel (3×3 down, 1×1 up)."""
    if not _weighty(layer):
        return None
    k = _chain_scale(rank, 2)
    return {
        "lora_down.weight": draw(rank, layer.in_dim, *layer.kernel) * k,
        "lora_up.weight": draw(layer.out_dim, rank, *layer.ones) * k * layer.amp(strength),
    }


def _lora_tucker(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if not _has_kernel(layer):
        return None
    k = _chain_scale(rank, 3)
    return {
        "lora_down.weight": draw(rank, layer.in_dim, 1, 1) * k,
        "lora_mid.weight": draw(rank, rank, *layer.kernel) * k,
        "lora_up.weight": draw(layer.out_dim, rank, 1, 1) * k * layer.amp(strength),
    }


def _loha(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """LoHa with conv factors flattened to (r, in·kh·kw), as LyCORIS stores them."""
    if not _weighty(layer):
        return None
    k, cols = _chain_scale(rank, 2), layer.in_dim * math.prod(layer.kernel)
    return {
        "hada_w1_a": draw(layer.out_dim, rank) * k * layer.amp(strength),
        "hada_w1_b": draw(rank, cols) * k,
        "hada_w2_a": draw(layer.out_dim, rank) * k,
        "hada_w2_b": draw(rank, cols) * k,
    }


def _loha_tucker(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if not _has_kernel(layer):
        return None
    k = _chain_scale(rank, 3)
    out = {}
    for i, amp in ((1, layer.amp(strength)), (2, 1.0)):
        out[f"hada_t{i}"] = draw(rank, rank, *layer.kernel) * k * amp
        out[f"hada_w{i}_a"] = draw(rank, layer.out_dim) * k
        out[f"hada_w{i}_b"] = draw(rank, layer.in_dim) * k
    return out


def _lokr(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """LoKr with both Kronecker factors stored whole."""
    if not _weighty(layer):
        return None
    (a, b), (c, d) = _split(layer.out_dim), _split(layer.in_dim)
    return {"lokr_w1": draw(a, c) * layer.amp(strength), "lokr_w2": draw(b, d, *layer.kernel)}


def _lokr_factorised(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if not _weighty(layer):
        return None
    (a, b), (c, d), k = _split(layer.out_dim), _split(layer.in_dim), _chain_scale(rank, 2)
    return {
        "lokr_w1_a": draw(a, rank) * k * layer.amp(strength),
        "lokr_w1_b": draw(rank, c) * k,
        "lokr_w2_a": draw(b, rank) * k,
        "lokr_w2_b": draw(rank, d, *layer.kernel) * k,
    }


def _lokr_tucker(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if not _has_kernel(layer):
        return None
    (a, b), (c, d), k = _split(layer.out_dim), _split(layer.in_dim), _chain_scale(rank, 3)
    return {
        "lokr_w1": draw(a, c) * layer.amp(strength),
        "lokr_t2": draw(rank, rank, *layer.kernel) * k,
        "lokr_w2_a": draw(rank, b) * k,
        "lokr_w2_b": draw(rank, d) * k,
    }


def _glora(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """GLoRA, LyCORIS 4.x layout; W·a1·a2 sums over the input channels, hence the 1/√in."""
    if not _weighty(layer):
        return None
    k, amp = _chain_scale(rank, 2), layer.amp(strength)
    a_scale = amp / (math.sqrt(layer.in_dim) * max(layer.amp(1.0), 1e-12))
    return {
        "a1.weight": draw(layer.in_dim, rank, *layer.ones) * k * a_scale,
        "a2.weight": draw(rank, layer.in_dim, *layer.ones) * k,
        "b1.weight": draw(layer.out_dim, rank, *layer.ones) * k * amp,
        "b2.weight": draw(rank, layer.in_dim, *layer.kernel) * k,
    }


def _glora_old(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """GLoRA as LyCORIS ≤ 2.x stored it (transposed factors, linear layers only)."""
    if layer.kind != "linear":
        return None
    new = _glora(layer, rank, draw, strength)
    return {
        "a1.weight": new["a2.weight"],
        "a2.weight": new["a1.weight"],
        "b1.weight": new["b2.weight"],
        "b2.weight": new["b1.weight"],
    }


def _dora(axis: str) -> Callable[[Layer, int, Draw, float], Tensors | None]:
    """LoRA plus a `dora_scale` per output row (`out`) or per input column (legacy `in`)."""

    def build(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
        tensors = _lora(layer, rank, draw, strength)
        if tensors is None:
            return None
        dims = tuple(d for d in range(layer.weight.dim()) if d != (0 if axis == "out" else 1))
        norm = torch.linalg.vector_norm(layer.weight, dim=dims, keepdim=True)
        tensors["dora_scale"] = norm * (1 + 0.5 * strength * torch.tanh(draw(*norm.shape)))
        return tensors

    return build


def _full(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    out = {"diff": draw(*layer.weight.shape) * layer.amp(strength)}
    if layer.bias is not None:
        out["diff_b"] = draw(*layer.bias.shape) * _bias_amp(layer, strength)
    return out


def _bias_amp(layer: Layer, strength: float) -> float:
    rms = float(layer.bias.pow(2).mean().sqrt())
    return strength * (rms if rms > 0 else float(layer.weight.pow(2).mean().sqrt()))


def _norm(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if layer.kind != "norm":
        return None
    out = {"w_norm": draw(*layer.weight.shape) * layer.amp(strength)}
    if layer.bias is not None:
        out["b_norm"] = draw(*layer.bias.shape) * _bias_amp(layer, strength)
    return out


def _ia3(on_input: bool) -> Callable[[Layer, int, Draw, float], Tensors | None]:
    def build(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
        if not _weighty(layer):
            return None
        shape = (1, layer.in_dim) if on_input else (layer.out_dim, 1)
        return {"weight": draw(*shape, *layer.ones) * strength, "on_input": torch.tensor(int(on_input))}

    return build


def _oft(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """Diagonal OFT with blocks of up to 2·rank rows; R ≈ I + 2Q for small blocks."""
    if not _weighty(layer):
        return None
    size = max(d for d in range(1, 2 * rank + 1) if layer.out_dim % d == 0)
    if size == 1:
        return None  # a 1×1 skew block is zero: nothing to rotate
    sigma = strength / (2 * math.sqrt(2 * size))
    return {"oft_blocks": draw(layer.out_dim // size, size, size) * sigma}


@dataclass(frozen=True)
class Algorithm:
    """One entry of the table: its per-layer builder and whether files of it carry `alpha`."""

    build: Callable[[Layer, int, Draw, float], Tensors | None]
    alpha: bool = True


ALGORITHMS: dict[str, Algorithm] = {
    "lora": Algorithm(_lora),
    "lora_tucker": Algorithm(_lora_tucker),
    "loha": Algorithm(_loha),
    "loha_tucker": Algorithm(_loha_tucker),
    "lokr": Algorithm(_lokr),
    "lokr_factorised": Algorithm(_lokr_factorised),
    "lokr_tucker": Algorithm(_lokr_tucker),
    "glora": Algorithm(_glora),
    "glora_old": Algorithm(_glora_old),
    "dora": Algorithm(_dora("out")),
    "dora_in": Algorithm(_dora("in")),
    "full": Algorithm(_full, alpha=False),
    "norm": Algorithm(_norm, alpha=False),
    "ia3": Algorithm(_ia3(False), alpha=False),
    "ia3_in": Algorithm(_ia3(True), alpha=False),
    "oft": Algorithm(_oft, alpha=False),
}


