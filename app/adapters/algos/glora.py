"""GLoRA: a delta that depends on the base weight (both LyCORIS layouts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from app.adapters.algos.base import (
    Shape,
    _algorithm,
    _as_matrix,
    _f32,
    _Factored,
    _low_rank,
    _low_rank_dims,
    _low_rank_scale,
    _read_scalar,
    _require,
)
from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError


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

    def _row_axes(self) -> dict[str, int]:
        return {"b2": 0} if self.old_layout else {"b1": 0}  # W's own rows come with the module

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


