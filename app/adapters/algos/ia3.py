"""(IA)³: per-row or per-column scaling of the base weight."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from app.adapters.algos.base import Adapter, _algorithm, _f32, _read_scalar, _require
from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError


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

    def _row_axes(self) -> dict[str, int]:
        return {} if self.on_input else {"weight": 0}  # W ⊙ w: a column scale keeps every row's own

    def _weight_delta(self, w0: Tensor) -> Tensor:
        view = [1] * w0.dim()
        view[self._axis()] = -1
        return w0.to(torch.float32) * _f32(self.weight, w0.device).reshape(view)


