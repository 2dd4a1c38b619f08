"""`LoraSpec`: one entry of the user's declared LoRA list.

The engine is declarative: callers send the *full* desired list and the patcher reconciles.
A spec is frozen so a list of them can serve as the exact record of what was applied (the
undo state), which SD.Next's shallow-copied "previous networks" list failed to be.

Strengths are bounded by `MAX_STRENGTH`: A1111 prompts and our API take any number, but past a
few units a LoRA's delta already dwarfs the weights it is added to, and a strength like -1e30
overflows the fused weights to Inf (a black image and no error). ±100 is fifty times the
sliders' default range: room for any deliberate use, none for a typo or an attack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schedule module imports `check_strength` from here
    from app.adapters.strength_schedule import StrengthSchedule

MAX_STRENGTH = 100.0


def check_strength(name: str, label: str, value: float) -> None:
    """Refuse a NaN/Inf strength or one beyond ±MAX_STRENGTH, naming the LoRA and the field."""
    if not math.isfinite(value):
        raise ValueError(f"LoRA {name!r}: {label} must be a finite number, got {value!r}")
    if abs(value) > MAX_STRENGTH:
        raise ValueError(f"LoRA {name!r}: {label} {value:g} is beyond ±{MAX_STRENGTH:g}, the largest strength accepted")


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA by library name with its strength; UNet/text-encoder strengths default to `weight`.

    `schedule`: the denoiser's strength by step (`app.adapters.strength_schedule`); it then rests at the
    schedule's step-0 strength (`unet_strength`), which is also what the text encoder gets unless `te_weight`
    says otherwise (the prompt is encoded once, before the first step)."""

    name: str
    weight: float = 1.0
    unet_weight: float | None = None
    te_weight: float | None = None
    schedule: StrengthSchedule | None = None

    def __post_init__(self) -> None:
        for label, value in (("weight", self.weight), ("unet_weight", self.unet_weight),
                             ("te_weight", self.te_weight)):
            if value is not None:
                check_strength(self.name, label, value)

    @property
    def unet_strength(self) -> float:
        """The denoiser's strength at rest (a schedule's step-0 strength)."""
        if self.schedule is not None:
            return self.schedule.start
        return self.weight if self.unet_weight is None else self.unet_weight

    @property
    def schedule_text(self) -> str:
        """The schedule as typed ("" for none): what the infotext writes back."""
        return "" if self.schedule is None else self.schedule.text

    def with_denoiser_strength(self, strength: float) -> LoraSpec:
        """This LoRA with the denoiser at `strength` and no schedule (one step of a scheduled pass)."""
        return LoraSpec(self.name, self.weight, strength, self.te_strength)

    @property
    def te_strength(self) -> float:
        return self.weight if self.te_weight is None else self.te_weight

    def strength_for(self, component: str) -> float:
        """Text-encoder strength for every text encoder, the UNet strength for the denoiser (a UNet
        or a DiT's transformer)."""
        return self.te_strength if component.startswith("text_encoder") else self.unet_strength
