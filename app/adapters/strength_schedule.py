"""A LoRA's strength by denoising step: the loractl extension's `weight@step, …` syntax.

`<lora:name:1@0,0@0.3>` asks for strength 1 at the first step falling linearly to 0 at 30% of the
pass, then held at 0 (as A1111 users type it for the sd-webui-loractl extension; Forge #1439 asks it
for step-distillation LoRAs that must act on the first steps only). The rules, loractl's:

* points are `weight@position`, separated by commas or semicolons, in any order;
* positions are fractions of the pass (0 = its first step, 1 = its last) when none exceeds 1, else
  absolute step numbers counted from 0 (`0@5,1@6`: off for steps 0–5, on from step 6);
* the strength is linear between two points and held before the first and after the last.

Step i of a pass of n steps sits at fraction i / (n − 1) (loractl divides by A1111's own counter,
n − 2, an artefact of when its callback runs: here the last step is exactly 1). Each pass of a job
(the hires pass, an img2img pass) runs the schedule over its own steps.

A schedule is a frozen, hashable value, so a `LoraSpec` carrying one still serves as the exact record
of what was applied. Its `text` is kept as the user typed it (the infotext writes it back) and takes
no part in equality: `1@0,0@0.3` and `1@0; 0@0.30` are the same schedule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from app.adapters.specs import check_strength

_SEPARATORS = re.compile(r"[,;]")


@dataclass(frozen=True)
class StrengthSchedule:
    """Strength at positions: `points` sorted by position; `absolute` when positions are step numbers."""

    points: tuple[tuple[float, float], ...]  # (position, strength)
    absolute: bool = False
    text: str = field(default="", compare=False)

    @property
    def start(self) -> float:
        """The strength at step 0: the resting strength between jobs, and the text encoder's."""
        return self.at(0, 1)

    def at(self, step: int, total: int) -> float:
        """The strength at step `step` (from 0) of a pass of `total` steps."""
        x = float(step) if self.absolute else (step / (total - 1) if total > 1 else 0.0)
        (x0, y0), (xn, yn) = self.points[0], self.points[-1]
        if x <= x0:
            return y0
        if x >= xn:
            return yn
        for (xa, ya), (xb, yb) in zip(self.points, self.points[1:], strict=False):
            if xa <= x <= xb:
                return ya + (yb - ya) * (x - xa) / (xb - xa)
        raise AssertionError("unreachable: x lies between the first and the last point")

    def strengths(self, total: int) -> tuple[float, ...]:
        """The strength at every step of a pass of `total` steps."""
        return tuple(self.at(step, total) for step in range(total))


def is_schedule(text: str) -> bool:
    """Whether a tag's weight field is a schedule (has an `@`) rather than a plain number."""
    return "@" in text


def parse_schedule(text: str, name: str, where: str) -> StrengthSchedule | float:
    """`weight@position, …` -> a schedule, or its one strength when every point has the same one (nothing
    then changes between steps). Raises ValueError naming `where` (the tag or field) for anything else."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"{where}: {text.strip()!r} is not a strength schedule ({why}); write weight@step "
                          "points, e.g. 1@0,0@0.3 (positions up to 1 are fractions of the steps, above 1 step numbers)")

    points = []
    for item in _SEPARATORS.split(text):
        weight, at, position = item.strip().partition("@")
        if not at:
            raise refuse(f"{item.strip() or 'an empty point'!r} has no @step")
        try:
            point = (float(position), float(weight))
        except ValueError:
            raise refuse(f"{item.strip()!r} is not a number@number") from None
        if not math.isfinite(point[0]) or point[0] < 0:
            raise refuse(f"position {position.strip()} must be a finite number ≥ 0")
        try:
            check_strength(name, "a scheduled weight", point[1])
        except ValueError as exc:
            raise refuse(str(exc)) from None
        points.append(point)
    points.sort()
    positions = [p for p, _ in points]
    if len(set(positions)) != len(positions):
        raise refuse("two points at the same position")
    if len({w for _, w in points}) == 1:
        return points[0][1]
    return StrengthSchedule(tuple(points), absolute=positions[-1] > 1, text=text.strip())
