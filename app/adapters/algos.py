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

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError

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
    "parse_layer",
]

Shape = tuple[int, ...]
_A = TypeVar("_A", bound="Adapter")


@dataclass(frozen=True, eq=False)
class Delta:
    """What one adapter adds to one layer at strength 1: float32, on the base weight's device.

    `weight` is None for adapters that only touch the bias (a norm adapter with only `b_norm`).
    """

    weight: Tensor | None
    bias: Tensor | None = None


# --------------------------------------------------------------------------------------- helpers
def _f32(t: Tensor, device: torch.device) -> Tensor:
    """The one place adapter tensors change dtype/device: at calculation time, for calculation."""
    return t.to(device=device, dtype=torch.float32)


def _read_scalar(layer: str, key: str, tensors: Mapping[str, Tensor]) -> float | None:
    """A scalar stored as a tensor (alpha, constraint, on_input); `.float()` first because a 0-dim
    bf16/fp16 tensor is what many trainers write."""
    t = tensors.get(key)
    if t is None:
        return None
    if t.numel() != 1:
        raise AdapterFormatError(f"{layer}: {key} must be a single number, got shape {tuple(t.shape)}")
    return float(t.float())


def _low_rank_scale(alpha: float | None, rank: int | None) -> float:
    return alpha / rank if alpha and rank else 1.0


def _require(layer: str, algo: str, tensors: Mapping[str, Tensor], keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise AdapterFormatError(f"{layer}: {algo} needs {', '.join(missing)}; found keys {sorted(tensors)}")


def _same_rank(layer: str, name_a: str, rank_a: int, name_b: str, rank_b: int) -> None:
    if rank_a != rank_b:
        raise AdapterFormatError(
            f"{layer}: rank mismatch: {name_a} has rank {rank_a}, {name_b} has rank {rank_b}"
        )


def _strip_ones(shape: Sequence[int]) -> Shape:
    """Trailing 1s carry no layout information: (in, 1, 1) and (in,) lay out the same."""
    shape = tuple(shape)
    while shape and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def _as_matrix(shape: Sequence[int]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def _low_rank_dims(
    layer: str,
    out_factor: tuple[str, Shape],
    in_factor: tuple[str, Shape],
    core: tuple[str, Shape] | None = None,
    *,
    out_rank_first: bool = False,
) -> tuple[int, Shape]:
    """Check one product out·[core]·in and return ΔW's rows and per-row shape.

    `out_factor` is (out, r[, 1, 1]) — or (r, out) when `out_rank_first`, the layout LoHa and
    LoKr use for their Tucker factors; `in_factor` is (r, in[, kh, kw]); a Tucker `core` is
    (r_out, r_in, kh, kw) and then `in_factor` must be 1×1.
    """
    (out_name, out_shape), (in_name, in_shape) = out_factor, in_factor
    if len(out_shape) < 2 or any(d != 1 for d in out_shape[2:]):
        raise AdapterFormatError(
            f"{layer}: {out_name} must be a matrix (1×1 kernel at most), got {out_shape}"
        )
    if len(in_shape) < 2:
        raise AdapterFormatError(f"{layer}: {in_name} must have at least 2 dimensions, got {in_shape}")
    rows, out_rank = (out_shape[1], out_shape[0]) if out_rank_first else (out_shape[0], out_shape[1])
    if core is None:
        _same_rank(layer, in_name, in_shape[0], out_name, out_rank)
        return rows, in_shape[1:]
    core_name, core_shape = core
    if len(core_shape) < 2 or any(d != 1 for d in in_shape[2:]):
        raise AdapterFormatError(
            f"{layer}: Tucker layout needs {core_name} (r, r, kh, kw) and a 1×1 {in_name}; "
            f"got {core_name} {core_shape}, {in_name} {in_shape}"
        )
    _same_rank(layer, in_name, in_shape[0], core_name, core_shape[1])
    _same_rank(layer, out_name, out_rank, core_name, core_shape[0])
    return rows, (in_shape[1], *core_shape[2:])


def _low_rank(
    out_factor: Tensor, in_factor: Tensor, core: Tensor | None, *, out_rank_first: bool = False
) -> Tensor:
    """out·in as (out, in_flat), or with a Tucker core as (out, in, kh, kw); float32 inputs."""
    up = out_factor.flatten(1)
    up = up.T if out_rank_first else up
    down = in_factor.flatten(1)
    if core is None:
        return up @ down
    return torch.einsum("m n ..., i m, n j -> i j ...", core, up, down)


def _check_fits(layer: str, algo: str, rows: int, per_row: Shape, base_shape: Sequence[int]) -> None:
    """ΔW of shape (rows, *per_row) must reshape onto the base weight without scrambling it.

    Equal element counts per row are enough when the adapter is a plain matrix (a linear adapter
    on a 1×1 conv, LoHa's flattened conv factors); when it carries a real kernel, that kernel
    must be the base weight's.
    """
    base = tuple(base_shape)
    fits = len(base) >= 1 and rows == base[0] and math.prod(per_row) == math.prod(base[1:])
    if fits and len(_strip_ones(per_row)) > 1:
        fits = _strip_ones(per_row) == _strip_ones(base[1:])
    if not fits:
        raise IncompatibleAdapterError(
            f"{layer}: {algo} delta does not fit the target weight: expected {base}, got {(rows, *per_row)}"
        )


# ------------------------------------------------------------------------------------ interface
# eq=False: tensors have no truth value, so identity is the only sensible equality; repr=False:
# `Adapter.__repr__` shows shapes and dtypes instead of dumping tensor contents into logs.
_algorithm = dataclass(frozen=True, eq=False, repr=False)


@_algorithm
class Adapter(ABC):
    """One layer of one adapter file. Subclasses name their tensors; see the module docstring.

    `keys` lists every suffix the algorithm may carry, `markers` those that identify it; both
    drive `parse_layer`.
    """

    algo: ClassVar[str]
    keys: ClassVar[frozenset[str]]
    markers: ClassVar[frozenset[str]]
    accepts_dora: ClassVar[bool] = False
    reads_base: ClassVar[bool] = False  # ΔW depends on W0's values, not only its shape

    layer: str = field(default="", kw_only=True)

    @classmethod
    @abstractmethod
    def from_tensors(cls: type[_A], layer: str, tensors: Mapping[str, Tensor]) -> _A:
        """Build from one layer's suffix dict ("lora_down.weight", "alpha", …)."""

    @abstractmethod
    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        """Raise IncompatibleAdapterError unless ΔW fits the target weight; shapes only."""

    @abstractmethod
    def _weight_delta(self, w0: Tensor) -> Tensor | None:
        """ΔW in float32 on w0's device, any shape with w0's element count."""

    def _bias_delta(self, device: torch.device) -> Tensor | None:
        return None

    @property
    def rank(self) -> int | None:
        """The low-rank dimension, for algorithms that have one."""
        return None

    def to(self: _A, device: torch.device) -> _A:
        """The same adapter with its tensors on `device`, dtype untouched (the file's, until calculation)."""
        moved = {f.name: value.to(device) for f in fields(self)
                 if isinstance(value := getattr(self, f.name), (Tensor, Adapter))}
        return dataclasses.replace(self, **moved)

    @property
    def num_params(self) -> int:
        return sum(v.numel() for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor))

    def __repr__(self) -> str:
        def show(value: object) -> str:
            if isinstance(value, Tensor):
                return f"Tensor{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
            return repr(value)

        shown = ", ".join(f"{f.name}={show(getattr(self, f.name))}" for f in fields(self))
        return f"{type(self).__name__}({shown})"

    @property
    def _where(self) -> str:
        return self.layer or type(self).__name__

    @torch.no_grad()
    def delta(self, base_weight: Tensor, base_bias: Tensor | None = None) -> Delta:
        """ΔW (and Δb) at strength 1, float32 on `base_weight`'s device, shaped like weight and bias.

        `base_weight` must be the layer's original W0 (the patcher's backup), not a weight other
        adapters already changed: GLoRA, DoRA, IA3 and OFT read it. no_grad, so a Parameter base
        never makes ΔW carry an autograd graph.
        """
        self.validate_against(base_weight.shape)
        weight = self._weight_delta(base_weight)
        bias = self._bias_delta(base_weight.device)
        if bias is not None:
            if base_bias is None:
                raise IncompatibleAdapterError(
                    f"{self._where}: {self.algo} changes a bias but the layer has none"
                )
            if bias.numel() != base_bias.numel():
                raise IncompatibleAdapterError(
                    f"{self._where}: {self.algo} bias delta does not fit: "
                    f"expected {tuple(base_bias.shape)}, got {tuple(bias.shape)}"
                )
            bias = bias.reshape(base_bias.shape)
        return Delta(None if weight is None else weight.reshape(base_weight.shape), bias)

    def accumulate(self, acc: Tensor, base_weight: Tensor, base_bias: Tensor | None, strength: float) -> Tensor | None:
        """acc += strength·ΔW in place (acc: float32, shaped like the weight); returns Δb at
        strength 1 (or None). The patcher sums every adapter of a layer this way; algorithms that
        can add their product without materialising ΔW override it."""
        delta = self.delta(base_weight, base_bias)
        if delta.weight is not None:
            acc.add_(delta.weight, alpha=strength)
        return delta.bias


# ----------------------------------------------------------------------------------- algorithms
@_algorithm
class _Factored(Adapter):
    """Algorithms whose ΔW is built from factors: the shape check is the same for all of them."""

    @abstractmethod
    def _dims(self) -> tuple[int, Shape]:
        """(rows, per-row shape) of the ΔW the factors build."""

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        _check_fits(self._where, self.algo, *self._dims(), base_weight_shape)


@_algorithm
class LoRA(_Factored):
    """LoRA / LoCon: ΔW = s · up · down, or s · up ×₁ mid ×₂ down with a Tucker `mid`.

    down (r, in[, kh, kw]), up (out, r[, 1, 1]); Tucker: mid (r, r, kh, kw) and a 1×1 down.
    """

    down: Tensor
    up: Tensor
    mid: Tensor | None = None
    alpha: float | None = None

    algo = "LoRA"
    keys = frozenset({"lora_down.weight", "lora_up.weight", "lora_mid.weight", "alpha"})
    markers = frozenset({"lora_down.weight", "lora_up.weight", "lora_mid.weight"})
    accepts_dora = True

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> LoRA:
        _require(layer, cls.algo, tensors, ("lora_down.weight", "lora_up.weight"))
        return cls(
            tensors["lora_down.weight"],
            tensors["lora_up.weight"],
            tensors.get("lora_mid.weight"),
            _read_scalar(layer, "alpha", tensors),
            layer=layer,
        )

    def __post_init__(self) -> None:
        self._dims()

    def _dims(self) -> tuple[int, Shape]:
        mid = None if self.mid is None else ("lora_mid", tuple(self.mid.shape))
        return _low_rank_dims(
            self._where, ("lora_up", tuple(self.up.shape)), ("lora_down", tuple(self.down.shape)), mid
        )

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def accumulate(self, acc: Tensor, base_weight: Tensor, base_bias: Tensor | None, strength: float) -> Tensor | None:
        """One fused multiply-add, acc += (m·s)·up·down, instead of building ΔW, scaling it and
        adding it: a third of the memory passes a re-weight of a large layer costs."""
        if self.mid is not None or not acc.is_contiguous():
            return super().accumulate(acc, base_weight, base_bias, strength)
        self.validate_against(base_weight.shape)
        dev = acc.device
        with torch.no_grad():
            up, down = _f32(self.up, dev).flatten(1), _f32(self.down, dev).flatten(1)
        acc.view(acc.shape[0], -1).addmm_(up, down, alpha=strength * _low_rank_scale(self.alpha, self.rank))
        return None

    def _weight_delta(self, w0: Tensor) -> Tensor:
        dev = w0.device
        mid = None if self.mid is None else _f32(self.mid, dev)
        return _low_rank(_f32(self.up, dev), _f32(self.down, dev), mid) * _low_rank_scale(
            self.alpha, self.rank
        )


@_algorithm
class LoHa(_Factored):
    """LoHa: ΔW = s · (w1a·w1b) ⊙ (w2a·w2b), s = alpha / rank with rank = hada_w1_b's rows.

    Plain: w_a (out, r), w_b (r, in·kh·kw) — LyCORIS stores conv factors flattened. Tucker
    (`hada_t1`/`hada_t2`, (r, r, kh, kw)): w_a (r, out), w_b (r, in). Scaled once (see module doc).
    """

    w1a: Tensor
    w1b: Tensor
    w2a: Tensor
    w2b: Tensor
    t1: Tensor | None = None
    t2: Tensor | None = None
    alpha: float | None = None

    algo = "LoHa"
    keys = frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "alpha"})
    markers = keys - {"alpha"}
    accepts_dora = True

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> LoHa:
        _require(layer, cls.algo, tensors, ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
        return cls(
            *(tensors[k] for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")),
            tensors.get("hada_t1"),
            tensors.get("hada_t2"),
            _read_scalar(layer, "alpha", tensors),
            layer=layer,
        )

    def __post_init__(self) -> None:
        self._dims()

    def _factor_dims(self, i: int) -> tuple[int, Shape]:
        a, b, t = (self.w1a, self.w1b, self.t1) if i == 1 else (self.w2a, self.w2b, self.t2)
        core = None if t is None else (f"hada_t{i}", tuple(t.shape))
        return _low_rank_dims(
            self._where,
            (f"hada_w{i}_a", tuple(a.shape)),
            (f"hada_w{i}_b", tuple(b.shape)),
            core,
            out_rank_first=t is not None,
        )

    def _dims(self) -> tuple[int, Shape]:
        if (self.t1 is None) != (self.t2 is None):
            raise AdapterFormatError(f"{self._where}: LoHa Tucker needs both hada_t1 and hada_t2, found one")
        first, second = self._factor_dims(1), self._factor_dims(2)
        if first != second:
            raise AdapterFormatError(
                f"{self._where}: LoHa factors disagree: hada_w1 builds {(first[0], *first[1])}, "
                f"hada_w2 builds {(second[0], *second[1])}"
            )
        return first

    @property
    def rank(self) -> int:
        return self.w1b.shape[0]

    def _weight_delta(self, w0: Tensor) -> Tensor:
        dev, tucker = w0.device, self.t1 is not None
        cores = [None if t is None else _f32(t, dev) for t in (self.t1, self.t2)]
        first = _low_rank(_f32(self.w1a, dev), _f32(self.w1b, dev), cores[0], out_rank_first=tucker)
        second = _low_rank(_f32(self.w2a, dev), _f32(self.w2b, dev), cores[1], out_rank_first=tucker)
        return first * second * _low_rank_scale(self.alpha, self.rank)


# In the order of LoKr's tensor fields.
_LOKR_KEYS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


@_algorithm
class LoKr(_Factored):
    """LoKr: ΔW = s · (w1 ⊗ w2) reshaped onto W.

    w1 (a, c) is `lokr_w1` or `lokr_w1_a`·`lokr_w1_b`; w2 (b, d[, kh, kw]) is `lokr_w2`,
    `lokr_w2_a`·`lokr_w2_b` (w2_b may carry the kernel), or Tucker `lokr_t2` (r, r, kh, kw) with
    w2_a (r, b) and w2_b (r, d). out = a·b, in = c·d. s = alpha / rank of the decomposed factor;
    with no decomposed factor s = 1 whatever alpha says (LyCORIS writes alpha = dim there).
    """

    w1: Tensor | None = None
    w1a: Tensor | None = None
    w1b: Tensor | None = None
    w2: Tensor | None = None
    w2a: Tensor | None = None
    w2b: Tensor | None = None
    t2: Tensor | None = None
    alpha: float | None = None

    algo = "LoKr"
    keys = frozenset({*_LOKR_KEYS, "alpha"})
    markers = frozenset(_LOKR_KEYS)
    accepts_dora = True

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> LoKr:
        return cls(*(tensors.get(k) for k in _LOKR_KEYS), _read_scalar(layer, "alpha", tensors), layer=layer)

    def __post_init__(self) -> None:
        self._dims()

    def _factor_dims(self, i: int) -> tuple[int, Shape]:
        """Rows and per-row shape of factor i, checking it is given exactly one way."""
        full, a, b = (self.w1, self.w1a, self.w1b) if i == 1 else (self.w2, self.w2a, self.w2b)
        core = None if i == 1 or self.t2 is None else ("lokr_t2", tuple(self.t2.shape))
        if full is not None and a is None and b is None and core is None:
            if full.dim() < 2:
                raise AdapterFormatError(
                    f"{self._where}: lokr_w{i} must be a matrix, got {tuple(full.shape)}"
                )
            return full.shape[0], tuple(full.shape[1:])
        if full is None and a is not None and b is not None:
            return _low_rank_dims(
                self._where,
                (f"lokr_w{i}_a", tuple(a.shape)),
                (f"lokr_w{i}_b", tuple(b.shape)),
                core,
                out_rank_first=core is not None,
            )
        tucker = " (lokr_t2 goes with lokr_w2_a/_b)" if i == 2 else ""
        raise AdapterFormatError(
            f"{self._where}: LoKr needs either lokr_w{i} or both lokr_w{i}_a and lokr_w{i}_b{tucker}; "
            f"found {[key for key, t in zip(_LOKR_KEYS, self._factors(), strict=True) if t is not None]}"
        )

    def _factors(self) -> tuple[Tensor | None, ...]:
        """The tensor fields in `_LOKR_KEYS` order."""
        return self.w1, self.w1a, self.w1b, self.w2, self.w2a, self.w2b, self.t2

    def _dims(self) -> tuple[int, Shape]:
        (a, w1_cols), (b, w2_cols) = self._factor_dims(1), self._factor_dims(2)
        if len(_strip_ones(w1_cols)) > 1:
            raise AdapterFormatError(f"{self._where}: lokr_w1 cannot carry a kernel, got columns {w1_cols}")
        if self.w1b is not None and self.w2b is not None:
            _same_rank(self._where, "lokr_w1_b", self.w1b.shape[0], "lokr_w2_b", self.w2b.shape[0])
        c = math.prod(w1_cols)
        if len(_strip_ones(w2_cols)) > 1:
            return a * b, (c * w2_cols[0], *w2_cols[1:])
        return a * b, (c * math.prod(w2_cols),)

    @property
    def rank(self) -> int | None:
        factor_b = self.w2b if self.w2b is not None else self.w1b
        return None if factor_b is None else factor_b.shape[0]

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        super().validate_against(base_weight_shape)
        w2_cols = self._factor_dims(2)[1]
        kernel = math.prod(base_weight_shape[2:])
        if len(_strip_ones(w2_cols)) <= 1 and math.prod(w2_cols) % kernel:
            # A flattened (b, d·kh·kw) w2 only lands right if each of its rows holds whole kernels.
            raise IncompatibleAdapterError(
                f"{self._where}: LoKr w2 has {math.prod(w2_cols)} columns, not a multiple of the target's "
                f"kernel size {kernel} (target {tuple(base_weight_shape)})"
            )

    def _weight_delta(self, w0: Tensor) -> Tensor:
        dev = w0.device
        if self.w1 is not None:
            w1 = _f32(self.w1, dev).flatten(1)
        else:
            w1 = _low_rank(_f32(self.w1a, dev), _f32(self.w1b, dev), None)
        if self.w2 is not None:
            w2 = _f32(self.w2, dev)
        else:
            core = None if self.t2 is None else _f32(self.t2, dev)
            w2 = _low_rank(_f32(self.w2a, dev), _f32(self.w2b, dev), core, out_rank_first=core is not None)
        return torch.kron(w1, w2.flatten(1)) * _low_rank_scale(self.alpha, self.rank)


def _glora_layout_fits(shapes: Mapping[str, Shape], old: bool) -> bool:
    """Shape test for one GLoRA layout, on (rows, cols) views of a1, a2, b1, b2.

    New (what LyCORIS 4.x writes): a1 (in, r), a2 (r, in), b1 (out, r), b2 (r, in·k).
    Old (LyCORIS ≤ 2.x):           a1 (r, in), a2 (in, r), b1 (r, in), b2 (out, r).
    """
    a1, a2, b1, b2 = (_as_matrix(shapes[k]) for k in ("a1", "a2", "b1", "b2"))
    if old:
        return a1[0] == a2[1] == b1[0] == b2[1] and a1[1] == a2[0] == b1[1]
    return a1[1] == a2[0] == b1[1] == b2[0] and a1[0] == a2[1]


@_algorithm
class GLoRA(_Factored):
    """GLoRA: W′ = W + s·(W·A + B), so ΔW depends on the base weight.

    New layout: ΔW = s·(W ×ᵢ a1 ×ᵢ a2 + b1·[bm]·b2), where a1/a2 act on W's input-channel axis (1×1
    kernels) and `bm` is LyCORIS's optional Tucker core for the B branch. Old layout (≤ 2.x):
    ΔW = s·(W_flat·a2·a1 + b2·b1). The layouts are told apart by shape alone; when both fit
    (square factors) the reading whose rank is below its layer width wins (new on a tie).
    """

    a1: Tensor
    a2: Tensor
    b1: Tensor
    b2: Tensor
    bm: Tensor | None = None
    alpha: float | None = None
    old_layout: bool = False

    algo = "GLoRA"
    reads_base = True
    keys = frozenset({"a1.weight", "a2.weight", "b1.weight", "b2.weight", "bm.weight", "alpha"})
    markers = keys - {"alpha"}
    accepts_dora = True

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> GLoRA:
        names = ("a1.weight", "a2.weight", "b1.weight", "b2.weight")
        _require(layer, cls.algo, tensors, names)
        shapes = {k.split(".")[0]: tuple(tensors[k].shape) for k in names}
        bm = tensors.get("bm.weight")
        # The Tucker core only exists in the new layout; new is also what a failed fit reports on.
        old = bm is None and _glora_layout_fits(shapes, old=True)
        if old and _glora_layout_fits(shapes, old=False):
            old = shapes["a1"][0] < _as_matrix(shapes["a1"])[1]  # old reads rank = a1 rows
        return cls(*(tensors[k] for k in names), bm, _read_scalar(layer, "alpha", tensors), old, layer=layer)

    def __post_init__(self) -> None:
        self._dims()

    def _dims(self) -> tuple[int, Shape]:
        shapes = {n: tuple(getattr(self, n).shape) for n in ("a1", "a2", "b1", "b2")}
        if not _glora_layout_fits(shapes, self.old_layout) or (self.old_layout and self.bm is not None):
            raise AdapterFormatError(
                f"{self._where}: GLoRA shapes fit neither layout: a1 {shapes['a1']}, a2 {shapes['a2']}, "
                f"b1 {shapes['b1']}, b2 {shapes['b2']}; expected new a1 (in, r), a2 (r, in), b1 (out, r), "
                f"b2 (r, in[, kh, kw]) or old a1 (r, in), a2 (in, r), b1 (r, in), b2 (out, r)"
            )
        if self.old_layout:
            return shapes["b2"][0], (_as_matrix(shapes["b1"])[1],)
        for name in ("a1", "a2"):
            if any(d != 1 for d in shapes[name][2:]):
                raise AdapterFormatError(
                    f"{self._where}: GLoRA {name} must have a 1×1 kernel, got {shapes[name]}"
                )
        core = None if self.bm is None else ("bm", tuple(self.bm.shape))
        return _low_rank_dims(self._where, ("b1", shapes["b1"]), ("b2", shapes["b2"]), core)

    @property
    def rank(self) -> int:
        return self.a1.shape[0] if self.old_layout else self.a2.shape[0]

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        super().validate_against(base_weight_shape)
        channels = self.a1.shape[0]
        if not self.old_layout and (len(base_weight_shape) < 2 or base_weight_shape[1] != channels):
            raise IncompatibleAdapterError(
                f"{self._where}: GLoRA a1/a2 act on {channels} input channels but the target weight "
                f"is {tuple(base_weight_shape)}"
            )

    def _weight_delta(self, w0: Tensor) -> Tensor:
        dev, w = w0.device, w0.to(torch.float32)
        a1, a2 = _f32(self.a1, dev).flatten(1), _f32(self.a2, dev).flatten(1)
        scale = _low_rank_scale(self.alpha, self.rank)
        if self.old_layout:
            return (w.flatten(1) @ a2 @ a1 + _low_rank(_f32(self.b2, dev), _f32(self.b1, dev), None)) * scale
        wa = torch.einsum("o i ..., i r -> o r ...", w, a1)
        wa = torch.einsum("o r ..., r j -> o j ...", wa, a2)
        bm = None if self.bm is None else _f32(self.bm, dev)
        b = _low_rank(_f32(self.b1, dev), _f32(self.b2, dev), bm)
        return (wa + b.reshape(w.shape)) * scale


@_algorithm
class Full(Adapter):
    """Full fine-tune difference: ΔW = diff, Δb = diff_b (LyCORIS "full"; no scale)."""

    diff: Tensor
    diff_b: Tensor | None = None

    algo = "Full"
    keys = frozenset({"diff", "diff_b"})
    markers = keys

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> Full:
        _require(layer, cls.algo, tensors, ("diff",))
        return cls(tensors["diff"], tensors.get("diff_b"), layer=layer)

    def __post_init__(self) -> None:
        if self.diff.dim() == 0:
            raise AdapterFormatError(f"{self._where}: diff must have at least one dimension")
        if self.diff_b is not None and self.diff_b.numel() != self.diff.shape[0]:
            raise AdapterFormatError(
                f"{self._where}: diff_b has {self.diff_b.numel()} values, diff has {self.diff.shape[0]} rows"
            )

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        _check_fits(self._where, self.algo, self.diff.shape[0], tuple(self.diff.shape[1:]), base_weight_shape)

    def _weight_delta(self, w0: Tensor) -> Tensor:
        return _f32(self.diff, w0.device)

    def _bias_delta(self, device: torch.device) -> Tensor | None:
        return None if self.diff_b is None else _f32(self.diff_b, device)


@_algorithm
class Norm(Adapter):
    """Norm-layer adapter (LyCORIS `w_norm`/`b_norm`): ΔW = w_norm, Δb = b_norm, either optional."""

    w_norm: Tensor | None = None
    b_norm: Tensor | None = None

    algo = "Norm"
    keys = frozenset({"w_norm", "b_norm"})
    markers = keys

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> Norm:
        return cls(tensors.get("w_norm"), tensors.get("b_norm"), layer=layer)

    def __post_init__(self) -> None:
        if self.w_norm is None and self.b_norm is None:
            raise AdapterFormatError(f"{self._where}: Norm needs w_norm or b_norm")

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        if self.w_norm is not None and tuple(self.w_norm.shape) != tuple(base_weight_shape):
            raise IncompatibleAdapterError(
                f"{self._where}: w_norm does not fit the target weight: "
                f"expected {tuple(base_weight_shape)}, got {tuple(self.w_norm.shape)}"
            )

    def _weight_delta(self, w0: Tensor) -> Tensor | None:
        return None if self.w_norm is None else _f32(self.w_norm, w0.device)

    def _bias_delta(self, device: torch.device) -> Tensor | None:
        return None if self.b_norm is None else _f32(self.b_norm, device)


@_algorithm
class IA3(Adapter):
    """(IA)³: W′ = W ⊙ (1 + w) with w broadcast along the output rows or, with `on_input`, the
    input columns; ΔW = W ⊙ w."""

    weight: Tensor
    on_input: bool = False

    algo = "IA3"
    reads_base = True
    keys = frozenset({"weight", "on_input"})
    markers = keys

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> IA3:
        _require(layer, cls.algo, tensors, ("weight", "on_input"))
        return cls(tensors["weight"], bool(_read_scalar(layer, "on_input", tensors)), layer=layer)

    def __post_init__(self) -> None:
        if sum(d != 1 for d in self.weight.shape) > 1:
            raise AdapterFormatError(
                f"{self._where}: IA3 weight must be a vector, got {tuple(self.weight.shape)}"
            )

    def _axis(self) -> int:
        return 1 if self.on_input else 0

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        axis = self._axis()
        if len(base_weight_shape) < 2 or base_weight_shape[axis] != self.weight.numel():
            side = "input channels" if self.on_input else "output rows"
            raise IncompatibleAdapterError(
                f"{self._where}: IA3 scales {self.weight.numel()} {side} but the target weight is "
                f"{tuple(base_weight_shape)}"
            )

    def _weight_delta(self, w0: Tensor) -> Tensor:
        view = [1] * w0.dim()
        view[self._axis()] = -1
        return w0.to(torch.float32) * _f32(self.weight, w0.device).reshape(view)


@_algorithm
class OFT(Adapter):
    """Diagonal OFT: W′ = rescale ⊙ (blockdiag(R)ᵀ · W), R = (I + Q)(I − Q)⁻¹, Q = B − Bᵀ per block.

    `blocks` (n, b, b) split the out axis into n blocks of b rows. R is orthogonal (Cayley
    transform of a skew matrix); `rotation()` exposes it. `constraint` bounds ‖Q‖_F over all
    blocks (COFT): Q is scaled down to that norm when it exceeds it. From a file it is the
    `constraint` tensor if present, else `alpha` × out_dim — the bound LyCORIS's Diag-OFT and
    kohya's OFT enforced while training (they store the per-row factor as `alpha`); ComfyUI
    clamps at `alpha` itself, which shrinks rotations the trainer allowed. 0 or absent: none.
    """

    blocks: Tensor
    rescale: Tensor | None = None
    constraint: float | None = None

    algo = "OFT"
    reads_base = True
    keys = frozenset({"oft_blocks", "rescale", "alpha", "constraint"})
    markers = frozenset({"oft_blocks"})

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> OFT:
        _require(layer, cls.algo, tensors, ("oft_blocks",))
        blocks = tensors["oft_blocks"]
        constraint = _read_scalar(layer, "constraint", tensors)
        if constraint is None and (alpha := _read_scalar(layer, "alpha", tensors)):
            constraint = alpha * math.prod(blocks.shape[:2])
        return cls(blocks, tensors.get("rescale"), constraint or None, layer=layer)

    def __post_init__(self) -> None:
        shape = tuple(self.blocks.shape)
        if len(shape) != 3 or shape[1] != shape[2]:
            raise AdapterFormatError(f"{self._where}: oft_blocks must be (blocks, size, size), got {shape}")
        if self.rescale is not None and (
            self.rescale.shape[0] != self.out_dim or any(d != 1 for d in self.rescale.shape[1:])
        ):
            raise AdapterFormatError(
                f"{self._where}: rescale must be ({self.out_dim}, 1, …), got {tuple(self.rescale.shape)}"
            )

    @property
    def out_dim(self) -> int:
        return self.blocks.shape[0] * self.blocks.shape[1]

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        if len(base_weight_shape) < 1 or base_weight_shape[0] != self.out_dim:
            n, b = self.blocks.shape[:2]
            raise IncompatibleAdapterError(
                f"{self._where}: OFT rotates {n}×{b} = {self.out_dim} output rows but the target weight is "
                f"{tuple(base_weight_shape)}"
            )

    def rotation(self, device: torch.device | None = None) -> Tensor:
        """The per-block orthogonal matrices R (n, b, b), float32, after the constraint."""
        blocks = _f32(self.blocks, self.blocks.device if device is None else device)
        q = blocks - blocks.transpose(1, 2)
        if self.constraint:
            # Scale Q down to the bound when ‖Q‖_F (all blocks together) exceeds it; clamp, not an
            # `if`, so a GPU tensor is never synchronised to the host here.
            q = q * torch.clamp(self.constraint / torch.linalg.vector_norm(q), max=1.0)
        eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype)
        # (I + Q) and (I − Q)⁻¹ commute, so R = solve(I − Q, I + Q): no explicit inverse.
        return torch.linalg.solve(eye - q, eye + q)

    def _weight_delta(self, w0: Tensor) -> Tensor:
        w = w0.to(torch.float32)
        r = self.rotation(w0.device)
        n, b = self.blocks.shape[:2]
        rotated = torch.einsum("k n m, k n x -> k m x", r, w.reshape(n, b, -1)).reshape(w.shape)
        if self.rescale is not None:
            rotated = rotated * _f32(self.rescale, w0.device).reshape(-1, *[1] * (w.dim() - 1))
        return rotated - w


@_algorithm
class DoRA(Adapter):
    """DoRA modifier: W′ = (W + ΔW_inner) · dora_scale / ‖W + ΔW_inner‖; ΔW = W′ − W.

    The norm is taken along the axes where `dora_scale` is 1: (out, 1, …) normalises each output
    row (LyCORIS with `wd_on_out`, PEFT's magnitude vector; a 1-D vector is read this way), legacy
    (1, in, …) each input column (LyCORIS without `wd_on_out`, the only reading ComfyUI has).
    Strength m interpolates W0 → W′ linearly (module docstring). A float32 eps keeps an all-zero
    row from dividing by zero.
    """

    inner: Adapter
    dora_scale: Tensor

    algo = "DoRA"
    reads_base = True
    keys = frozenset({"dora_scale"})
    markers = keys

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> DoRA:
        _require(layer, cls.algo, tensors, ("dora_scale",))
        rest = {k: v for k, v in tensors.items() if k != "dora_scale"}
        if not rest:
            raise AdapterFormatError(
                f"{layer}: dora_scale without the LoRA/LoHa/LoKr/GLoRA tensors it modifies"
            )
        return cls(parse_layer(layer, rest), tensors["dora_scale"], layer=layer)

    def __post_init__(self) -> None:
        if not self.inner.accepts_dora:
            raise AdapterFormatError(
                f"{self._where}: dora_scale cannot accompany a {self.inner.algo} adapter"
            )
        self._axes()

    def _axes(self) -> tuple[int, int]:
        """(rows, cols) of dora_scale: one of them is 1 (or both, for a 1-row or 1-column layer)."""
        shape = tuple(self.dora_scale.shape)
        rows, cols = (shape + (1,))[:2] if shape else (1, 1)
        if any(d != 1 for d in shape[2:]) or (rows != 1 and cols != 1):
            raise AdapterFormatError(
                f"{self._where}: dora_scale must be (out, 1, …) or (1, in, …), got {shape}"
            )
        return rows, cols

    @property
    def rank(self) -> int | None:
        return self.inner.rank

    @property
    def num_params(self) -> int:
        return self.inner.num_params + self.dora_scale.numel()

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        self.inner.validate_against(base_weight_shape)
        base = tuple(base_weight_shape)
        if len(base) < 2:
            raise IncompatibleAdapterError(
                f"{self._where}: DoRA needs a matrix or conv weight, target is {base}"
            )
        if self._axes() not in ((base[0], 1), (1, base[1])):
            raise IncompatibleAdapterError(
                f"{self._where}: dora_scale does not fit the target weight {base}: expected "
                f"{(base[0], 1)} or {(1, base[1])}, got {tuple(self.dora_scale.shape)}"
            )

    def _weight_delta(self, w0: Tensor) -> Tensor:
        w = w0.to(torch.float32)
        merged = w + self.inner._weight_delta(w0).reshape(w.shape)
        magnitude = _f32(self.dora_scale, w0.device).reshape(*self._axes(), *[1] * (w.dim() - 2))
        norm_dims = tuple(d for d in range(w.dim()) if magnitude.shape[d] == 1)
        norm = torch.linalg.vector_norm(merged, dim=norm_dims, keepdim=True) + torch.finfo(torch.float32).eps
        return merged * (magnitude / norm) - w

    def _bias_delta(self, device: torch.device) -> Tensor | None:
        return self.inner._bias_delta(device)


# ------------------------------------------------------------------------------------- registry
# Marker sets are disjoint, so at most one algorithm can claim a key set; DoRA is not listed
# because it is a modifier: `parse_layer` peels it off and parses what it wraps.
_ALGORITHMS: tuple[type[Adapter], ...] = (LoRA, LoHa, LoKr, GLoRA, Full, Norm, IA3, OFT)


def parse_layer(layer: str, tensors: Mapping[str, Tensor]) -> Adapter:
    """Pick the algorithm for one layer's suffix dict (kohya/LyCORIS suffixes plus `alpha`).

    Diffusers/PEFT spellings are normalised before they get here; anything unrecognised is an
    AdapterFormatError that lists the keys found, never a silent skip.
    """
    if "dora_scale" in tensors:
        return DoRA.from_tensors(layer, tensors)
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
