"""The upscaler model as a component of the engine: loaded, placed, verified and repaired like the rest.

Why not a side path: an upscale between two diffusion passes is exactly where the SD.Next reports saw
devices and dtypes drift. Here the upscaler is one more component under a `PlacementPlan` (the
component `upscaler`): its rest and compute placements follow the engine's offload mode (on the
compute device only while it runs under model, balanced, sequential and group offload; resident
under none), its dtype is the engine's where the architecture declares it supported
(`arch.compute_dtype`), and the worker runs `verify_and_repair` on it before and after every
transition, as on the diffusion model. Its offload hooks are the engine's own strategies
(`offload.MODES`) on a one-component holder, so model offload brings it in whole, sequential streams
each layer, and the inputs of its forward are moved to the compute device by `offload.inputs`.

It is loaded on first use by name and kept until another is asked for, the engine's dtype changes
(then it is dropped and read again at the next use: casting back and forth would lose bits) or
`Engine.unload_upscaler`. Weights are cast once to the compute dtype on load; a wider rest dtype
(`Settings.rest_dtype`) is an exact widening of those.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app import diagnostics
from app.engine import offload, placement
from app.engine.memory import release_memory
from app.engine.placement import ComponentPlan, Placement, PlacementPlan
from app.hooks import HookRegistry
from app.safetensors_files import FileIdentity
from app.settings import Settings
from app.upscalers import arch, files

log = logging.getLogger(__name__)

COMPONENT = "upscaler"
FACE_COMPONENT = "face restorer"  # the face-restoration model: a second slot of this class (`Upscaling`)


@dataclass(frozen=True)
class UpscalerFacts:
    """What the snapshot shows about the loaded upscaler."""

    name: str
    arch: str
    scale: int
    dtype: str
    offload: str
    file: str
    mib: float


class _Parts:
    """A one-component holder: what `placement` and `offload` read from a pipeline (`components`)."""

    def __init__(self, module: torch.nn.Module, component: str) -> None:
        self.components = {component: module}


@dataclass
class _Loaded:
    name: str
    identity: FileIdentity
    descriptor: object  # spandrel's ImageModelDescriptor
    parts: _Parts
    requested: str  # the engine dtype request it was loaded for
    plan: PlacementPlan
    hooks: HookRegistry
    strategy: offload.OffloadStrategy | None = None  # installed by `_place`


class UpscalerSlot:
    """Holds at most one upscaler; only the worker calls it. The face restorer is a second slot under its own
    component name (`FACE_COMPONENT`) with its own file reader (`describe`: spandrel's face models), so a hires
    upscale and a face restoration in one job keep both models loaded, each placed and verified."""

    def __init__(self, settings: Settings, device: torch.device, timers: diagnostics.Timers,
                 component: str = COMPONENT, describe=arch.describe) -> None:
        self._settings, self._device, self._timers = settings, device, timers
        self.component, self._describe = component, describe
        self._loaded: _Loaded | None = None

    # ------------------------------------------------------------------ reading
    @property
    def plan(self) -> PlacementPlan | None:
        return None if self._loaded is None else self._loaded.plan

    @property
    def model(self) -> torch.nn.Module | None:
        """The live module, for tests. Not for the UI."""
        return None if self._loaded is None else self._loaded.descriptor.model

    @property
    def descriptor(self):
        """spandrel's descriptor of the loaded model (its size requirements, architecture)."""
        return self._require().descriptor

    @property
    def scale(self) -> int:
        return self._require().descriptor.scale

    def facts(self) -> UpscalerFacts | None:
        loaded = self._loaded
        if loaded is None:
            return None
        module = loaded.descriptor.model
        return UpscalerFacts(loaded.name, loaded.descriptor.architecture.name, loaded.descriptor.scale,
                             placement.dtype_name(loaded.plan.dtype), loaded.plan.offload,
                             Path(loaded.identity.path).name, round(placement.component_bytes(module) / 2**20, 3))

    def rows(self, violations) -> tuple[diagnostics.ModuleRow, ...]:
        loaded = self._loaded
        if loaded is None:
            return ()
        mine = [v for v in violations if v.component == self.component]
        return diagnostics.placement_rows(loaded.parts, loaded.plan, {}, mine, loaded.hooks)

    def verify_and_repair(self, when: str) -> tuple[list[placement.Violation], int]:
        if self._loaded is None:
            return [], 0
        found = placement.verify(self._loaded.parts, self._loaded.plan)
        return found, placement.sync(self._loaded.parts, self._loaded.plan, reason=when) if found else 0

    # ------------------------------------------------------------------ changing
    def ensure(self, name: str, path: Path, requested: str, mode: str) -> None:
        """Have `name` (the file at `path`) loaded for the engine's dtype request and offload `mode`."""
        loaded = self._loaded
        if loaded is not None and (loaded.name, loaded.identity) == (name, FileIdentity.of(path)):
            self.follow(requested, mode)
            if self._loaded is not None:
                return
        self.unload()
        self._load(name, path, requested, mode)

    def follow(self, requested: str, mode: str) -> None:
        """After an engine dtype or offload change: a new dtype drops the upscaler (read again at its next
        use), a new offload mode places it anew. A placement that fails drops it too: it is only a cache."""
        loaded = self._loaded
        if loaded is None:
            return
        if loaded.requested != requested:
            self.unload()
        elif loaded.plan.offload != mode:
            try:
                self._place(loaded, self._plan(loaded.plan.dtype, mode), f"offload {mode}")
            except Exception:  # noqa: BLE001 - logged; the next use loads it afresh and reports its own error
                log.exception("%s %s could not be placed for offload %s; unloaded", self.component, loaded.name,
                              mode)
                self.unload()

    def unload(self) -> None:
        if self._loaded is None:
            return
        if self._loaded.strategy is not None:
            self._loaded.strategy.remove()
        self._loaded = None
        release_memory()

    def _load(self, name: str, path: Path, requested: str, mode: str) -> None:
        t0 = time.perf_counter()
        identity = FileIdentity.of(path)
        descriptor = self._describe(files.read_state_dict(path), name)
        wanted = placement.resolve_dtype(requested, self._device)
        dtype = arch.compute_dtype(descriptor, wanted)
        parts = _Parts(descriptor.model, self.component)
        placement.move_component(descriptor.model, self.component, Placement(torch.device("cpu"), dtype), reason="load")
        loaded = _Loaded(name, identity, descriptor, parts, requested, self._plan(dtype, mode), HookRegistry())
        self._place(loaded, loaded.plan, f"load {self.component}")
        self._loaded = loaded
        self._timers.record(f"load {self.component}", time.perf_counter() - t0)
        log.info("%s %s loaded: %s x%d, %s, offload %s", self.component, name, descriptor.architecture.name,
                 descriptor.scale, placement.dtype_name(dtype), mode)

    def _plan(self, dtype: torch.dtype, mode: str) -> PlacementPlan:
        """The component's plan: resting on the CPU (in `Settings.rest_dtype` if set) under a mode that
        moves weights, on the compute device otherwise; computing on the compute device in `dtype`."""
        compute = Placement(self._device, dtype)
        rest_dtype = placement.DTYPES.get(self._settings.rest_dtype or "", dtype)
        rest = Placement(torch.device("cpu"), rest_dtype) if offload.MODES[mode].moves_weights else compute
        return PlacementPlan(self._device, dtype, mode, {self.component: ComponentPlan(rest=rest, compute=compute)})

    def _place(self, loaded: _Loaded, plan: PlacementPlan, reason: str) -> None:
        """Take the old strategy's hooks off, apply `plan`, install its mode's hooks (group offload streams
        tensors the model owns outside its blocks around its forward, as on a diffusion model)."""
        if loaded.strategy is not None:
            loaded.strategy.remove()
            loaded.strategy = None
        placement.apply_plan(loaded.parts, plan, reason=reason)
        strategy = offload.make_strategy(loaded.parts, plan, loaded.hooks, self._settings.vram_budget_gib,
                                         self._settings.balanced_watermark)
        strategy.install()
        loaded.plan, loaded.strategy = plan, strategy

    # ------------------------------------------------------------------ running
    def run_tile(self, tile: torch.Tensor) -> torch.Tensor:
        """spandrel's own call of the model on one tile ((1, 3, h, w) in [0, 1]), given on the compute
        device in the compute dtype; the result stays there."""
        loaded = self._require()
        compute = loaded.plan.components[self.component].compute
        return loaded.descriptor(tile.to(device=compute.device, dtype=compute.dtype))

    def settle(self) -> None:
        """After a run: every tensor back at rest (a run cut off by Interrupt included)."""
        loaded = self._loaded
        if loaded is not None and loaded.strategy is not None:
            loaded.strategy.settle()
            loaded.plan = loaded.plan.with_resident(loaded.strategy.resident())

    def _require(self) -> _Loaded:
        if self._loaded is None:
            raise RuntimeError(f"no {self.component} loaded")
        return self._loaded
