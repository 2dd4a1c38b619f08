"""`Desired`: what the user asked the engine for, as one frozen value.

Why: every mutation is "change one field of what is wanted, then make the model match". The
worker builds the next `Desired` from the current one, realises it (the lifecycle diffs it
against what is loaded and runs only the steps that differ: reload for a new model or dtype,
re-place for an offload mode, re-patch for LoRAs), and only then commits it. A step that fails
leaves the previous `Desired` and the model as they were, so the two never drift apart.

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
    weights: str = "full"  # "full", or "fp8": the large weights rest in 8 bits (app/engine/storage.py)
    loras: tuple[LoraSpec, ...] = ()

    def replace(self, **changes) -> Desired:
        return dataclasses.replace(self, **changes)
