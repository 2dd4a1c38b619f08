"""`Desired`: what the user asked the engine for, as one frozen value.

Why: every mutation is "change one field of what is wanted, then make the model match". The
worker builds the next `Desired` from the current one, realises it (the lifecycle diffs it
against what is loaded and runs only the steps that differ: reload for a new model or dtype,
re-place for an offload mode, re-patch for LoRAs), and only then commits it. A step that fails
leaves the previous `Desired` and the model as they were, so the two never drift apart.

A generation carries the whole `Desired` it needs (a browser tab's panel, an API session's
choices, an A1111 request's checkpoint and prompt tags): the worker reconciles to it before the
job runs, so what one user asked for never reaches another user's image (`Engine.generate(...,
desired=...)`), and the queue groups waiting jobs by it (`app/engine/queue.py`).

Debug switches are not part of it: they touch no tensor and must take effect at once, also in
the middle of a long generation, so they stay in `Settings` (`Engine.set_debug`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from app.adapters.specs import LoraSpec


@dataclass(frozen=True)
class Desired:
    model: str | None = None  # checkpoint name relative to the checkpoint folder
    dtype: str = "auto"  # the request ("auto", "fp16", …), resolved per device by placement
    offload: str = "none"
    weights: str = "full"  # "full", "fp8": the large weights rest in 8 bits, "fp8-compute": and run fp8 matmuls,
    # "int8": they rest as int8 rows with a float32 scale each
    loras: tuple[LoraSpec, ...] = ()

    def replace(self, **changes) -> Desired:
        return dataclasses.replace(self, **changes)

    def model_key(self) -> tuple:
        """What a change of needs a reload: the checkpoint, its dtype and the weight storage."""
        return self.model, self.dtype, self.weights

    def loras_key(self) -> tuple[tuple[str, float, float, str], ...]:
        """The LoRA list by strengths (`LoraSpec("a", 1)` and `LoraSpec("a", 1, 1, 1)` are the same LoRA set)
        and step schedules (compared by their points, shown as typed)."""
        return tuple((s.name, s.unet_strength, s.te_strength, s.schedule) for s in self.loras)

    def same_as(self, other: Desired | None) -> bool:
        """Whether realising `other` after this one would change nothing."""
        return other is not None and (self.model_key(), self.offload, self.loras_key()) == (
            other.model_key(), other.offload, other.loras_key())

    def describe(self) -> str:
        """One line for the history and the status line: model, dtype, offload, storage, LoRAs."""
        loras = ", ".join(f"{s.name}:{s.schedule_text or format(s.unet_strength, 'g')}/{s.te_strength:g}"
                          for s in self.loras) or "no LoRAs"
        return f"{self.model or 'no model'} {self.dtype} offload {self.offload} weights {self.weights}; {loras}"
