"""Statistics for repeated measurements: medians with a distribution-free 95% interval, paired ratios
and the same-vs-same control that decides whether a ratio shows a difference at all.

Why order statistics and not a bootstrap: with the handful of repeats a GPU or a full-size CPU run
can afford (4-8), a bootstrap of the median only resamples the same few values and reports a falsely
tight interval; the binomial interval [x_(j), x_(n+1-j)] makes no assumption about the distribution
and states the coverage it actually achieves (below 95% when n <= 5, where it is the min-max range).

Why paired ratios: variants run in alternating (ABBA) order, so repeat i of ours and repeat i of the
baseline ran next to each other in time; their ratio cancels drift that a ratio of medians keeps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

CONFIDENCE = 0.95
METHOD = "median; 95% interval from order statistics (binomial, distribution-free), min-max when n <= 5"


@dataclass(frozen=True)
class Estimate:
    """A median and the order-statistic interval around it; `coverage` is the interval's real confidence."""

    median: float
    low: float
    high: float
    coverage: float
    n: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def _binomial_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate | None:
    """Median of `values` with the narrowest symmetric order-statistic interval reaching `confidence`
    (or the widest one, min-max, when too few values exist to reach it)."""
    data = sorted(v for v in values if v is not None)
    n = len(data)
    if n == 0:
        return None
    j = 0  # 0-based rank of the lower bound; [x_j, x_(n-1-j)] covers the median with 1 - 2·P(B <= j)
    while j + 1 < n - 2 - j and 1 - 2 * _binomial_cdf(j + 1, n) >= confidence:
        j += 1
    coverage = 1 - 2 * _binomial_cdf(j, n)
    return Estimate(statistics.median(data), data[j], data[n - 1 - j], coverage, n)


def paired_ratios(ours: Sequence[float], base: Sequence[float], higher_is_better: bool) -> list[float]:
    """Per-repeat ratios, > 1 meaning ours is better: ours/base for a speed, base/ours for a time."""
    pairs = [(o, b) for o, b in zip(ours, base, strict=False) if o and b]
    return [o / b if higher_is_better else b / o for o, b in pairs]


def verdict(ratio: float | None, band: tuple[float, float] | None) -> str:
    """"no difference" when the ratio lies inside the control's band (`control_band`); otherwise
    which side is better. Without a control the ratio is only reported."""
    if ratio is None:
        return "not measured"
    if band is None:
        return "no control"
    if band[0] <= ratio <= band[1]:
        return "no difference"
    return "ours better" if ratio > band[1] else "ours worse"


def control_band(control_ratios: Sequence[float]) -> tuple[float, float] | None:
    """The control's spread as a band around 1: its interval, mirrored (A/A' and A'/A are the same
    same-vs-same comparison, so a control at [0.95, 0.99] says ratios up to 1/0.95 mean nothing either)."""
    spread = median_interval(control_ratios)
    if spread is None:
        return None
    return min(spread.low, 1 / spread.high), max(spread.high, 1 / spread.low)


def compare(ours: Sequence[float], base: Sequence[float], control: Sequence[float] | None,
            higher_is_better: bool) -> dict[str, Any]:
    """One comparison: median paired ratio with its interval, the control's spread and the verdict.
    `control` holds the control pair's own per-repeat ratios (each near 1)."""
    ratio = median_interval(paired_ratios(ours, base, higher_is_better))
    band = control_band(control) if control else None
    return {"ratio": None if ratio is None else ratio.median,
            "ratio_interval": None if ratio is None else [ratio.low, ratio.high],
            "control_spread": None if band is None else list(band),
            "verdict": verdict(None if ratio is None else ratio.median, band)}
