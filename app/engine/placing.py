"""Where the loaded model lives: its placement plan, its offload mode's hooks, strict forwards, the
compiled path, and parking, for `ModelLifecycle` (its base).

Why apart from the lifecycle: loading, swapping and patching decide *what* is loaded; this decides
*where* it is, and is what a second model needs of the first: the refiner (app/engine/refining.py)
and a newly loaded model park the current one (hooks off, every tensor on the CPU, verified against
that all-CPU plan) while they take the device, and `unpark` places it by its own plan again. Every
step here owns its undo: a failed move puts the previous mode back, or raises `RollbackFailed`.
"""

from __future__ import annotations

import logging
import time
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from app.engine import compiled, offload, placement, storage, strict
from app.hooks import HookRegistry

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from app.engine.lifecycle import _Loaded


class RollbackFailed(RuntimeError):
    """An undo could not restore the last good state; the engine must enter ERROR."""


class Placing:
    """The placement half of `ModelLifecycle`, which holds the state it reads: `_loaded` (the model, its
    plan, hooks, strategy, LoRA stack and compile state), `_parked`, `_settings`, `_device`, `_timers`,
    `strict_forwards`, `carry`, `_lora_writes` and `_rows_written`."""

    # ------------------------------------------------------------------ placement checks
    def verify_and_repair(self, when: str, after_lora_change: bool = False) -> tuple[list[placement.Violation], int]:
        """Violations of the plan (the all-CPU one while parked) found now, and how many tensors were moved
        back. Carried tensors follow the model's own plan: the next stage runs on its execution device.

        `after_lora_change` (the worker's verify after a LoRA change, whose body touches the model only
        through `realise`): when that realise did nothing but write LoRA layers in place, only those
        layers' tensors are verified. The rest cannot have moved: the full verify before the change
        found every tensor conforming (or repaired it) and `copy_` into existing storage keeps device,
        dtype and layout. On the full SD1.5 that spares a walk over ~1,100 tensors per slider move."""
        written, self._lora_writes = self._lora_writes, None
        if self._loaded is None:
            return [], 0
        pipe, plan, own = self._loaded.model.pipe, self._parked or self._loaded.plan, self._loaded.plan
        narrow = after_lora_change and written is not None and self._parked is None
        self._rows_written = written if narrow else None  # the rows `rows` must build again
        model_found = placement.verify_modules(plan, written) if narrow else placement.verify(pipe, plan)
        carried = self.carry.verify(own)
        repaired = placement.sync(pipe, plan, reason=when) if model_found else 0
        return model_found + carried, repaired + (self.carry.sync(own) if carried else 0)

    # ------------------------------------------------------------------ parking
    def park(self, reason: str = "park") -> None:
        """Make room on the GPU for another model (a refiner, a newly loaded one): hooks off, every tensor
        on the CPU, verified against that all-CPU plan until `unpark` places the model by its own again."""
        loaded = self._loaded
        if loaded is None or self._parked is not None:
            return
        self._release_hooks(loaded)
        self._parked = offload.plan_for(loaded.model.pipe, loaded.plan.dtype, torch.device("cpu"), "none",
                                        stored=storage.dtypes(loaded.stored),
                                        kept=storage.kept(loaded.stored, loaded.matmul))
        placement.apply_plan(loaded.model.pipe, self._parked, reason=reason)

    def unpark(self) -> None:
        """Place a parked model by its own plan and offload mode again (a no-op when it is not parked)."""
        if self._loaded is None or self._parked is None:
            return
        self._parked = None
        self._restore_placement(self._loaded)
        self._sync_compile(self._loaded)

    def _plan(self, pipe, dtype: torch.dtype, mode: str, stored: storage.Stored,
              matmul: storage.MatmulLayers) -> placement.PlacementPlan:
        rest = self._settings.rest_dtype
        conv_format = torch.channels_last if self._settings.channels_last else None
        return offload.plan_for(pipe, dtype, self._device, mode, None if rest is None else placement.DTYPES[rest],
                                storage.dtypes(stored), conv_format, storage.kept(stored, matmul))

    def _place(self, pipe, plan: placement.PlacementPlan, hooks: HookRegistry, reason: str) -> offload.OffloadStrategy:
        """Apply a plan and install its offload strategy; on failure no hook of it stays behind."""
        t0 = time.perf_counter()
        placement.apply_plan(pipe, plan, reason=reason)
        pipe.execution_device = plan.device
        pipe.compute_dtypes = MappingProxyType({name: c.compute.dtype for name, c in plan.components.items()})
        strategy = offload.make_strategy(pipe, plan, hooks, self._settings.vram_budget_gib,
                                         self._settings.balanced_watermark)
        try:
            strategy.install()
            strict.apply(self.strict_forwards, hooks, pipe, plan)
        except BaseException:
            strategy.remove()
            hooks.remove_all(strict.HOOK)
            raise
        self._timers.record("move", time.perf_counter() - t0)
        return strategy

    def set_strict_forwards(self, on: bool) -> None:
        """Switch the strict-forward check on or off, on the loaded model and every later one."""
        self.strict_forwards = on
        if self._loaded is not None:
            strict.apply(on, self._loaded.hooks, self._loaded.model.pipe, self._loaded.plan)

    @staticmethod
    def _release_hooks(loaded: _Loaded) -> None:
        compiled.disable(loaded.model.pipe)
        loaded.strategy.remove()
        loaded.hooks.remove_all(strict.HOOK)

    def _sync_compile(self, loaded: _Loaded) -> None:
        """(Re)install the compiled denoiser path when `--compile` is on. LoRA changes never call this:
        fused weights are written in place, so compiled graphs stay valid without a recompile."""
        compiled.disable(loaded.model.pipe)
        loaded.compile = None
        if self._settings.compile and loaded.stored:
            log.info("--compile: the denoiser runs eager: %s rest in storage codecs, widened in a hook per "
                     "forward that a compiled graph would bake in", ", ".join(storage.codec_counts(loaded.stored)))
        if self._settings.compile and not loaded.stored:  # stored weights widen in hooks: eager only
            loaded.compile = compiled.enable(loaded.model.pipe, offload=loaded.plan.offload, device=self._device,
                                             mode=self._settings.compile_mode, backend=self._settings.compile_backend,
                                             cache_dir=self._settings.compile_cache_dir,
                                             whole=self._settings.compile_whole,
                                             # CUDA-graph trees are per thread: record them on the worker.
                                             background=None)

    def _restore_placement(self, loaded: _Loaded) -> None:
        """Put a model back to its own plan and offload mode (the undo of parking or a failed move)."""
        try:
            loaded.strategy.remove()
            loaded.strategy = self._place(loaded.model.pipe, loaded.plan, loaded.hooks, reason="rollback")
            loaded.stack.set_bypass(offload.bypass_components(loaded.plan))
        except BaseException as exc:
            raise RollbackFailed(f"could not put the model back to its previous placement: {exc}") from exc

    def _set_offload(self, mode: str) -> None:
        """Remove the old mode's hooks completely, apply the new plan, install the new hooks."""
        loaded = self._loaded
        new_plan = self._plan(loaded.model.pipe, loaded.plan.dtype, mode, loaded.stored, loaded.matmul)
        compiled.disable(loaded.model.pipe)
        loaded.strategy.remove()
        strategy = None
        try:
            strategy = self._place(loaded.model.pipe, new_plan, loaded.hooks, reason=f"offload {mode}")
            loaded.stack.set_bypass(offload.bypass_components(new_plan))
        except BaseException:
            if strategy is not None:
                strategy.remove()
            self._restore_placement(loaded)
            self._sync_compile(loaded)
            raise
        loaded.plan, loaded.strategy = new_plan, strategy
        self._sync_compile(loaded)
