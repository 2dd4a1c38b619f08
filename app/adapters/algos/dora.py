"""DoRA: a magnitude/direction modifier around another low-rank algorithm."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from app.adapters.algos.base import Adapter, _algorithm, _f32, _require
from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError


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
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor], inner: Adapter | None = None) -> DoRA:
        """`inner` is the algorithm parsed from the other tensors (`parse_layer` does that)."""
        _require(layer, cls.algo, tensors, ("dora_scale",))
        if inner is None:
            raise AdapterFormatError(
                f"{layer}: dora_scale without the LoRA/LoHa/LoKr/GLoRA tensors it modifies"
            )
        return cls(inner, tensors["dora_scale"], layer=layer)

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

    def rows(self, index: Tensor) -> DoRA:
        """Per-row magnitudes (out, 1) split with their rows; a per-column one normalises across
        every part of a fused layer at once and cannot be split."""
        if self._axes()[1] != 1:
            raise AdapterFormatError(f"{self._where}: a per-input-column dora_scale on a fused layer cannot be split "
                                     "onto its parts; not supported, nothing applied")
        scale = self.dora_scale.reshape(self.dora_scale.shape[0], -1).index_select(0, index.to(self.dora_scale.device))
        return dataclasses.replace(self, inner=self.inner.rows(index), dora_scale=scale)

    def _weight_delta(self, w0: Tensor) -> Tensor:
        w = w0.to(torch.float32)
        merged = w + self.inner._weight_delta(w0).reshape(w.shape)
        magnitude = _f32(self.dora_scale, w0.device).reshape(*self._axes(), *[1] * (w.dim() - 2))
        norm_dims = tuple(d for d in range(w.dim()) if magnitude.shape[d] == 1)
        norm = torch.linalg.vector_norm(merged, dim=norm_dims, keepdim=True) + torch.finfo(torch.float32).eps
        return merged * (magnitude / norm) - w

    def _bias_delta(self, device: torch.device) -> Tensor | None:
        return self.inner._bias_delta(device)


