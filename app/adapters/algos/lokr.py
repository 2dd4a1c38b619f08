"""LoKr: Kronecker product of two (optionally low-rank) factors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from app.adapters.algos.base import (
    Shape,
    _algorithm,
    _f32,
    _Factored,
    _low_rank,
    _low_rank_dims,
    _low_rank_scale,
    _read_scalar,
    _same_rank,
    _strip_ones,
)
from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError

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


