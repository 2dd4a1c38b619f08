"""LoHa: Hadamard product of two low-rank products."""

from __future__ import annotations

from collections.abc import Mapping

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
    _require,
)
from app.adapters.errors import AdapterFormatError


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

    def _row_axes(self) -> dict[str, int]:
        axis = 1 if self.t1 is not None else 0  # Tucker factors are (r, out)
        return {"w1a": axis, "w2a": axis}

    def _weight_delta(self, w0: Tensor) -> Tensor:
        dev, tucker = w0.device, self.t1 is not None
        cores = [None if t is None else _f32(t, dev) for t in (self.t1, self.t2)]
        first = _low_rank(_f32(self.w1a, dev), _f32(self.w1b, dev), cores[0], out_rank_first=tucker)
        second = _low_rank(_f32(self.w2a, dev), _f32(self.w2b, dev), cores[1], out_rank_first=tucker)
        return first * second * _low_rank_scale(self.alpha, self.rank)


