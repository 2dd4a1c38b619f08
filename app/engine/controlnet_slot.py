"""The ControlNets of a generation as a component of the loaded model, for `ModelLifecycle` (a base of it).

Why a component and not a side model: a ControlNet computes beside the denoiser at every step, which is
where the seeds' bug class lives (a control model left on the CPU under offload, residuals in another
dtype). Attached to the loaded pipeline (`EnginePipeline.attach`) as `ControlNetKit.component`, the stack
of a generation's ControlNets is planned, moved, offloaded under every mode, stored in fp8 with the
model's `weights`, strict-checked in every forward, verified after every transition and shown in
Diagnostics by the same code as the denoiser, in the engine's dtype. Attaching re-places the model under
its current offload mode (tensors already in place do not move), so another ControlNet never reloads the
checkpoint; a failed attach puts the previous stack and placement back, so nothing is left half-loaded.
Each model is read once and kept while a later stack names it (same file, same size and mtime).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from app.controlnet import loading
from app.controlnet.files import ControlNetEntry, ControlNetFileError, families_of_shapes
from app.engine import compiled, offload, storage, strict
from app.engine.memory import release_memory
from app.families import Family, family
from app.safetensors_files import FileIdentity, read_shapes

if TYPE_CHECKING:
    from app.engine.lifecycle import _Loaded

log = logging.getLogger(__name__)

CONTROL_STAGE = "control:"  # stage-pipeline cache keys of the control pipelines: "control:txt2img", …


@dataclass(frozen=True)
class AttachedControlNets:
    """What is attached: per unit the model's name and file identity, the stack, and the nets by name."""

    key: tuple[tuple[str, FileIdentity], ...]
    stack: torch.nn.Module
    nets: dict[str, torch.nn.Module]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.key)


def refuse_foreign(entry: ControlNetEntry, fam: Family) -> None:
    """Refuse, by name, a ControlNet made for another family (or for none here): running the generation
    without it would hand back a picture the unit did not shape."""
    try:
        made_for = families_of_shapes(read_shapes(entry.weights))
    except ValueError as exc:
        raise ControlNetFileError(f"ControlNet {entry.name}: {exc}") from exc
    if not made_for:
        raise ControlNetFileError(f"ControlNet {entry.name} is not a ControlNet any model family here takes")
    if fam not in made_for:
        raise ControlNetFileError(f"ControlNet {entry.name} is made for {made_for[0].label} models; the loaded model "
                                  f"is {fam.label}: choose a {fam.label} ControlNet")


class ControlNetSlot:
    """The ControlNet half of `ModelLifecycle`: reads `_loaded` (its `control`, plan, hooks, strategy, stored
    layers) and uses `Placing`'s `_plan`, `_place`, `_restore_placement` and `_sync_compile`."""

    @property
    def controlnets(self) -> AttachedControlNets | None:
        return None if self._loaded is None else self._loaded.control

    def ensure_controlnets(self, entries: Sequence[ControlNetEntry]) -> AttachedControlNets:
        """Have one ControlNet per entry (unit order) attached to the loaded model as its stack."""
        loaded = self._loaded
        if loaded is None:
            raise RuntimeError("no model loaded: load a checkpoint first")
        fam = family(loaded.model.family)
        if fam.controlnet is None:
            raise ValueError(f"{fam.label} models take no ControlNet")
        if loaded.compile is not None:
            raise ValueError("ControlNet units run on the eager model: turn the compiled path (--compile) off")
        key = tuple((e.name, FileIdentity.of(e.weights)) for e in entries)
        if loaded.control is not None and loaded.control.key == key:
            return loaded.control
        t0 = time.perf_counter()
        nets = self._nets_for(loaded, fam, entries)
        attached = AttachedControlNets(key, fam.controlnet.stack_class([nets[e.name] for e in entries]), nets)
        self._attach(loaded, fam, attached)
        self._timers.record("load controlnet", time.perf_counter() - t0)
        log.info("ControlNets attached: %s", ", ".join(attached.names))
        return attached

    def release_controlnets(self) -> None:
        """Detach the stack and give its memory back (the model stays as it was)."""
        loaded = self._loaded
        if loaded is None or loaded.control is None:
            return
        self._attach(loaded, family(loaded.model.family), None)
        release_memory()

    def _nets_for(self, loaded: _Loaded, fam: Family, entries: Sequence[ControlNetEntry]) -> dict:
        """Each distinct model of `entries`: the attached one where its file is unchanged, else read now."""
        kept = {} if loaded.control is None else loaded.control.nets
        known = {} if loaded.control is None else dict(loaded.control.key)
        nets = {}
        for entry in entries:
            if entry.name in nets:
                continue
            if entry.name in kept and known.get(entry.name) == FileIdentity.of(entry.weights):
                nets[entry.name] = kept[entry.name]
                continue
            refuse_foreign(entry, fam)
            nets[entry.name] = loading.load(entry, fam, loaded.plan.dtype)
        return nets

    def _attach(self, loaded: _Loaded, fam: Family, attached: AttachedControlNets | None) -> None:
        """Swap the attached stack (None: none) and place the model anew under its offload mode; on failure
        the previous stack, stored layers and placement come back."""
        pipe, name = loaded.model.pipe, fam.controlnet.component
        previous, old_stored = loaded.control, dict(loaded.stored)
        stored = {k: v for k, v in loaded.stored.items() if k != name}
        if attached is not None:
            layers = storage.component_layers(attached.stack, name, fam, loaded.weights)
            if layers:
                storage.store(pipe=_Holder(name, attached.stack), layers={name: layers})
                stored[name] = layers
        self._unhook(loaded, previous)
        pipe.attach(name, None if attached is None else attached.stack)
        loaded.stored = stored
        try:
            self._replace(loaded, name)
        except BaseException:
            self._unhook(loaded, attached)
            pipe.attach(name, None if previous is None else previous.stack)
            loaded.stored = old_stored
            self._restore_placement(loaded)
            if name in loaded.stored:
                self._hook_stored(loaded, name)
            self._sync_compile(loaded)
            raise
        loaded.control = attached
        loaded.stage_pipes = {k: v for k, v in loaded.stage_pipes.items() if not k.startswith(CONTROL_STAGE)}
        loaded.shown = None

    def _replace(self, loaded: _Loaded, name: str) -> None:
        """The model placed by a new plan under its own offload mode (the new component in it)."""
        plan = self._plan(loaded.model.pipe, loaded.plan.dtype, loaded.plan.offload, loaded.stored, loaded.matmul)
        compiled.disable(loaded.model.pipe)
        loaded.strategy.remove()
        strategy = self._place(loaded.model.pipe, plan, loaded.hooks, reason="attach ControlNet")
        loaded.plan, loaded.strategy = plan, strategy
        loaded.stack.set_bypass(offload.bypass_components(plan))
        if name in loaded.stored:
            self._hook_stored(loaded, name)

    @staticmethod
    def _hook_stored(loaded: _Loaded, name: str) -> None:
        pipe = loaded.model.pipe
        storage.install_dequant(loaded.hooks, pipe, {name: loaded.stored[name]}, pipe.compute_dtypes)

    @staticmethod
    def _unhook(loaded: _Loaded, attached: AttachedControlNets | None) -> None:
        """Every hook on a stack's modules off (dequant, offload, strict), so a detached stack is plain again."""
        if attached is None:
            return
        for module in attached.stack.modules():
            for hook in loaded.hooks.names(module):
                loaded.hooks.remove(module, hook)
        loaded.hooks.remove_all(strict.HOOK)  # put back on every component by the next `_place`


class _Holder:
    """`storage.store` reads a component as `getattr(pipe, name)`: one stack under its name, before attaching."""

    def __init__(self, name: str, module: torch.nn.Module) -> None:
        setattr(self, name, module)
