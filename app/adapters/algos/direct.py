"""Adapters that store the difference itself: full fine-tune diffs and norm-layer diffs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from app.adapters.algos.base import Adapter, _algorithm, _check_fits, _f32, _require
from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError


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

    def _row_axes(self) -> dict[str, int]:
        return {"diff": 0, "diff_b": 0}

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

    def _row_axes(self) -> dict[str, int]:
        return {"w_norm": 0, "b_norm": 0}

    def _weight_delta(self, w0: Tensor) -> Tensor | None:
        return None if self.w_norm is None else _f32(self.w_norm, w0.device)

    def _bias_delta(self, device: torch.device) -> Tensor | None:
        return None if self.b_norm is None else _f32(self.b_norm, device)


