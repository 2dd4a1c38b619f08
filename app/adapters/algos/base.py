"""The shared part of every algorithm: the `Adapter` interface, `Delta`, and the shape helpers.

See the package docstring for the contract; each algorithm lives in its own file beside this one.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError
from app.adapters.layer_ops import LayerOp

# An adapter's bypass prepared for one strength and compute placement: (module, x, op, output) -> its share.
BypassForward = Callable[[torch.nn.Module, Tensor, LayerOp, Tensor], "Tensor | None"]

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

    def to(self: _A, device: torch.device, floating: torch.dtype | None = None) -> _A:
        """The same adapter with its tensors on `device`, dtype untouched (the file's, until calculation)
        unless `floating` names one for its floating tensors (the patcher's float32 copies, see
        `LoraStack.prepare`)."""
        def moved(value):
            if isinstance(value, Adapter):
                return value.to(device, floating)
            recast = floating is not None and value.is_floating_point()
            return value.to(device, floating) if recast else value.to(device)
        return dataclasses.replace(self, **{f.name: moved(value) for f in fields(self)
                                            if isinstance(value := getattr(self, f.name), (Tensor, Adapter))})

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

    def bypass_forward(self, strength: float, dtype: torch.dtype, device: torch.device) -> BypassForward:
        """This adapter's share of a layer's output at `strength`, for a layer computing in `dtype` on
        `device`: a function (module, x, op, output) -> strength·(op(x, ΔW) + Δb) in `dtype` (see
        app/adapters/bypass.py). Built once per re-weight and compute placement, so what can be
        prepared ahead is not redone on every forward. This default prepares nothing: it
        materialises ΔW in float32 from the weight the forward has in hand (exact for the
        algorithms whose ΔW reads W) and rounds it once; low-rank algorithms run their factors on x."""

        def forward(module: torch.nn.Module, x: Tensor, op: LayerOp, output: Tensor) -> Tensor | None:
            bias = getattr(module, "bias", None)
            delta = self.delta(module.weight.detach(), None if bias is None else bias.detach())
            weight = (delta.weight * strength).to(dtype)
            return op(module, x, weight, None if delta.bias is None else (delta.bias * strength).to(dtype), output)

        return forward

    @property
    def joins_bypass(self) -> bool:
        """Whether this adapter's bypass can share one pair of matmuls with the layer's other plain
        LoRAs (`LoRA.joined`): only a plain up·down can; every other algorithm runs its own forward."""
        return False

    def rows(self, index: Tensor) -> Adapter:
        """This adapter restricted to output rows `index` of its ΔW: a fused file module (Flux's
        `img_attn.qkv`) split into the model's modules (`to_q`, `to_k`, `to_v`). Algorithms whose
        output rows each come from their own factor rows select those (`_row_axes`); the others
        whose ΔW does not read W0 compute the fused ΔW and keep the rows (`RowsOf`); the rest refuse."""
        axes = self._row_axes()
        if axes is not None:
            cut = {name: t.index_select(axis, index.to(t.device))
                   for name, axis in axes.items() if (t := getattr(self, name)) is not None}
            return dataclasses.replace(self, **cut)
        if not self.reads_base:
            return RowsOf(self, index, layer=self.layer)
        raise AdapterFormatError(f"{self._where}: this {self.algo} adapter targets a fused layer and cannot be "
                                 "split onto its parts exactly; not supported, nothing applied")

    def _row_axes(self) -> Mapping[str, int] | None:
        """Tensor field -> the axis holding ΔW's output rows, where each row depends on its own only."""
        return None

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
class RowsOf(Adapter):
    """Rows `index` of another adapter's ΔW, computed whole and then cut (for algorithms whose
    factors do not map rows one to one, such as LoKr's Kronecker product); exact, at the cost of
    the fused ΔW at calculation time."""

    inner: Adapter
    index: Tensor

    algo = "rows of a fused layer"
    keys = frozenset()
    markers = frozenset()

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> RowsOf:
        raise AdapterFormatError(f"{layer}: RowsOf is built by Adapter.rows, not read from a file")

    @property
    def rank(self) -> int | None:
        return self.inner.rank

    def _fused_rows(self) -> tuple[int, Shape]:
        return self.inner._dims()  # every algorithm without `_row_axes` is a `_Factored` one

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        _check_fits(self._where, self.inner.algo, len(self.index), self._fused_rows()[1], base_weight_shape)

    def _weight_delta(self, w0: Tensor) -> Tensor:
        rows, per_row = self._fused_rows()
        full = self.inner._weight_delta(w0.new_empty(0)).reshape(rows, -1)
        return full.index_select(0, self.index.to(full.device))
