"""Scheduled LoRA strengths changed between denoising steps, exactly, and back to rest after the pass.

One `StepStrengths` lives for one denoising pass of a stack holding LoRAs with a `schedule`. Before
each step it asks every schedule for the step's strength and, only where one changed since the step
before, rewrites the denoiser layers those LoRAs touch (the text encoders keep the step-0 strength:
the prompt is encoded once, before the first step):

* **fused layers**: W = B + Σ sᵢ(step)·ΔWᵢ, where B = W0 + Σ (constant LoRAs' contributions) and each
  scheduled ΔWᵢ are computed ONCE per pass from the exact backup W0 (never from a patched weight), in
  float32 on the compute device, and kept there (`SteppedLayer`). A step then costs, per layer, one
  float32 multiply-add per scheduled LoRA and one cast-and-`copy_` into the weight: no matmul, no read of
  the backup, no host transfer. The price is memory: (1 + k)·4 bytes per weight element of the layers
  touched (k: scheduled LoRAs on the layer), asked of the device before it is taken; where it does not
  fit, each step recomputes the layers from their backups as a slider move does (`rewrite`): the same
  W0 + Σ s·ΔW, slower.
* **bypass layers** (weights streamed per forward, or stored in 8 bits): the hook's list gets the new
  strength; nothing is re-fused, the stored bytes never change.

`close()` rewrites every layer it touched from the backups at the resting strengths (a schedule's
step-0 strength), the very computation that fused them before the pass, so the model is bit for bit
what it was. Nothing here chooses a device or moves a tensor: weights are written in place with `copy_`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from app.adapters.keys import Target
from app.adapters.strength_schedule import StrengthSchedule

log = logging.getLogger(__name__)


@dataclass
class SteppedLayer:
    """One fused layer's float32 parts for a scheduled pass, on the compute device."""

    module: torch.nn.Module
    base: torch.Tensor  # W0 + Σ constant contributions
    base_bias: torch.Tensor | None  # the same for the bias, where any adapter changes it
    deltas: tuple[tuple[str, torch.Tensor, torch.Tensor | None], ...]  # (LoRA, ΔW, Δb) at strength 1

    @property
    def nbytes(self) -> int:
        tensors = [self.base, self.base_bias, *(t for _, dw, db in self.deltas for t in (dw, db))]
        return sum(t.nbytes for t in tensors if t is not None)

    def write(self, strengths: Mapping[str, float]) -> None:
        """W = B + Σ sᵢ·ΔWᵢ in float32, cast once and written in place (bias likewise)."""
        weight, bias = self.base, self.base_bias
        with torch.no_grad():
            for name, dw, db in self.deltas:
                weight = torch.add(weight, dw, alpha=strengths[name])
                if db is not None:
                    bias = torch.add(bias, db, alpha=strengths[name])
            _write(self.module.weight, weight)
            if bias is not None:
                _write(self.module.bias, bias)


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    """Cast on the device the value was computed on (half the bytes across for 16-bit weights), then copy in."""
    target.copy_(value if value.device == target.device else value.to(target.dtype))


class StepStrengths:
    """The scheduled strengths of one denoising pass of `total` steps (see the module docstring).

    `fused`/`bypassed`: the denoiser layers the scheduled LoRAs touch; `build(target, names)` makes a fused
    layer's `SteppedLayer`; `rewrite(targets, strengths)` recomputes layers from the backups with the named
    LoRAs at `strengths` ({}: at rest); `room()`: bytes the compute device may still give the cache."""

    def __init__(self, total: int, schedules: Mapping[str, StrengthSchedule], fused: Sequence[Target],
                 bypassed: Sequence[Target], *, build: Callable[[Target, frozenset[str]], SteppedLayer],
                 rewrite: Callable[[Sequence[Target], Mapping[str, float]], None], room: Callable[[], int]) -> None:
        self.total = total
        self._schedules = dict(schedules)
        self._fused, self._bypassed = tuple(fused), tuple(bypassed)
        self._build, self._rewrite, self._room = build, rewrite, room
        self._resting = {name: schedule.start for name, schedule in self._schedules.items()}
        self._current = dict(self._resting)
        self._cache: dict[Target, SteppedLayer] | None = None
        self._fits: bool | None = None  # whether the cache fit the device (None: not built yet)
        self.changes = 0  # steps before which the strengths changed (the layers were rewritten)
        self.cached_bytes = 0  # what the cache holds (0: none, or the per-step recompute from backups runs)

    def before_step(self, step: int) -> None:
        """Set the strengths of step `step` (from 0) where they differ from the step before."""
        wanted = {name: schedule.at(step, self.total) for name, schedule in self._schedules.items()}
        if wanted == self._current:
            return
        self._current = wanted
        self.changes += 1
        if self._bypassed:
            self._rewrite(self._bypassed, wanted)
        if not self._fused:
            return
        cache = self._cached()
        if cache is None:
            self._rewrite(self._fused, wanted)
            return
        for layer in cache.values():
            layer.write(wanted)

    def _cached(self) -> dict[Target, SteppedLayer] | None:
        """The fused layers' parts, built at the first change; None (and the recompute path) when they do
        not fit the room the device has. A layer whose parts exceed the room is caught before the next."""
        if self._fits is not None:
            return self._cache
        names, room, cache, size = frozenset(self._schedules), self._room(), {}, 0
        for target in self._fused:
            layer = cache[target] = self._build(target, names)
            size += layer.nbytes
            if size > room:
                log.info("scheduled LoRAs: the float32 parts of %d layers do not fit the %d MiB free; each step "
                         "recomputes them from the backups instead", len(self._fused), room >> 20)
                self._fits = False
                return None
        self._fits, self._cache, self.cached_bytes = True, cache, size
        return cache

    def close(self) -> None:
        """Every layer written during the pass back to the resting strengths, from the backups (bit-exact)."""
        self._cache, self.cached_bytes = None, 0
        if self.changes:
            self._rewrite(self._fused + self._bypassed, {})
            self._current = dict(self._resting)
