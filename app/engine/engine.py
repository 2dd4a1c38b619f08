"""The engine state machine: one worker thread owns the pipeline; everything else asks.

Why: the seed crashes were races between code paths that each moved or patched tensors on
their own. Here every mutation (load, dtype, offload, LoRAs, unload) and every generation is a
command on one queue, served by one worker. Each command runs as a transition: enter its
working state, verify/repair placement *before* (so a stray tensor never reaches a forward
pass), run the body, verify/repair *after*, record a history row, publish an immutable
snapshot. A body that fails leaves the pipeline as it was (each body owns its undo); if an
undo itself fails the engine enters ERROR and only a load or unload leaves it.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import enum
import gc
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from app import diagnostics
from app.adapters.errors import AdapterError, LoraApplyError
from app.adapters.files import LoraLibrary
from app.adapters.patcher import LoraStack
from app.adapters.prompt import merge_prompt_loras
from app.adapters.specs import LoraSpec
from app.engine import compiled, embeddings, generate, models, offload, placement
from app.engine.generate import GeneratedImage, GenerateParams, RunContext
from app.settings import DTYPE_CHOICES, OFFLOAD_CHOICES, Settings

log = logging.getLogger(__name__)


class EngineState(str, enum.Enum):
    EMPTY = "EMPTY"
    LOADING = "LOADING"
    READY = "READY"
    PATCHING = "PATCHING"
    MOVING = "MOVING"
    GENERATING = "GENERATING"
    ERROR = "ERROR"


class RollbackFailed(RuntimeError):
    """An undo could not restore the last good state; the engine must enter ERROR."""


@dataclass(frozen=True)
class Transition:
    """One row of the bounded history."""

    command: str
    detail: str
    state: str
    started: float
    duration_s: float
    outcome: str  # "ok" | "failed, rolled back" | "failed, engine in ERROR"
    violations_found: int
    violations_repaired: int
    error: str | None = None


@dataclass(frozen=True)
class ErrorRecord:
    command: str
    message: str
    traceback: str
    at: float


@dataclass(frozen=True)
class Progress:
    phase: str
    step: int
    total: int


@dataclass(frozen=True)
class Snapshot:
    """An immutable picture of the engine, built by the worker after each transition."""

    state: str
    model: str | None = None
    arch: str | None = None
    model_hash: str | None = None
    native_size: int | None = None  # the side, in pixels, the model was trained at (UNet sample size × VAE factor)
    device: str = "cpu"
    dtype: str | None = None
    requested_dtype: str = "auto"
    offload: str = "none"
    loras: tuple[LoraSpec, ...] = ()
    lora_mode: str = "fused"  # or "on the fly" (streamed offload modes)
    placement: tuple[diagnostics.ModuleRow, ...] = ()
    violations: tuple[placement.Violation, ...] = ()  # found (and repaired) by the last transition
    violations_found_total: int = 0
    violations_repaired_total: int = 0
    lora_counters: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    timers: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    history: tuple[Transition, ...] = ()
    last_error: ErrorRecord | None = None
    progress: Progress | None = None
    embeddings: tuple[str, ...] = ()
    compile: compiled.CompileStatus | None = None
    taken_at: float = 0.0


@dataclass
class _Command:
    name: str
    detail: str
    state: EngineState
    body: Callable[[], Any]
    future: Future
    record: bool = True


@dataclass
class _Loaded:
    """The current model and what was applied to it (worker-private)."""

    model: models.LoadedModel
    plan: placement.PlacementPlan
    stack: LoraStack
    embeddings: tuple[str, ...]
    strategy: offload.OffloadStrategy
    compile: compiled.CompileState | None = None


def _release_memory() -> None:
    """Return freed RAM/VRAM to the OS/driver so "unload" really shows up in the numbers."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


class Engine:
    """Public, blocking API over the command queue. Thread-safe; every call waits for its result."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.device = placement.resolve_device(settings.device)
        self.library = LoraLibrary(settings.lora_dir)
        self._queue: collections.deque[_Command | None] = collections.deque()
        self._wake = threading.Condition()
        self._state = EngineState.EMPTY
        self._loaded: _Loaded | None = None
        self._requested_dtype = settings.dtype
        self._offload = settings.offload
        self._desired_loras: tuple[LoraSpec, ...] = ()
        self._unfit: set[str] = set()
        self._counters: dict[str, diagnostics.LoraCounters] = {}
        self._history: collections.deque[Transition] = collections.deque(maxlen=settings.history_size)
        self._timers = diagnostics.Timers()
        self._found_total = 0
        self._repaired_total = 0
        self._last_error: ErrorRecord | None = None
        self._progress: Progress | None = None
        self._last_violations: tuple[placement.Violation, ...] = ()
        self.timeline = diagnostics.MemoryTimeline()
        self._snapshot = Snapshot(state=EngineState.EMPTY.value, device=str(self.device),
                                  requested_dtype=settings.dtype, offload=settings.offload)
        diagnostics.set_debug_logging(settings.lora_debug, settings.move_debug)
        self._worker = threading.Thread(target=self._serve, name="engine-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ public API
    def load_model(self, name_or_path: str, dtype: str | None = None) -> Snapshot:
        if dtype is not None:
            self._check_choice("dtype", dtype, DTYPE_CHOICES)
        return self._call("load_model", f"{name_or_path} dtype={dtype or self._requested_dtype}",
                          EngineState.LOADING, lambda: self._do_load(name_or_path, dtype))

    def set_dtype(self, dtype: str) -> Snapshot:
        self._check_choice("dtype", dtype, DTYPE_CHOICES)
        return self._call("set_dtype", dtype, EngineState.LOADING, lambda: self._do_set_dtype(dtype))

    def set_offload(self, mode: str) -> Snapshot:
        self._check_choice("offload", mode, OFFLOAD_CHOICES)
        return self._call("set_offload", mode, EngineState.MOVING, lambda: self._do_set_offload(mode))

    def set_loras(self, specs: Sequence[LoraSpec]) -> Snapshot:
        specs = tuple(specs)
        self.library.validate_specs(specs)
        detail = ", ".join(f"{s.name}:{s.unet_strength:g}/{s.te_strength:g}" for s in specs) or "none"
        return self._call("set_loras", detail, EngineState.PATCHING, lambda: self._do_set_loras(specs))

    def generate(self, params: GenerateParams) -> list[GeneratedImage]:
        return self._call("generate", f"{params.steps} steps {params.width}x{params.height} x{params.batch}",
                          EngineState.GENERATING, lambda: self._do_generate(params), result=True)

    def inspect_lora(self, name: str):
        """Parse and shape-check a LoRA against the loaded model without applying it.

        Returns its `MatchReport`; raises the same error `set_loras` would. Runs on the worker
        (it reads the model) but is not a transition, so it leaves no history row.
        """
        def body():
            if self._loaded is None:
                raise RuntimeError("no model loaded")
            return self._loaded.stack.prepare(name, self.library.open(name), upload=False).report

        future = self.submit("inspect_lora", name, EngineState.READY, body, record=False)
        return future.result()

    def unload(self) -> Snapshot:
        return self._call("unload", "", EngineState.MOVING, self._do_unload)

    def set_debug(self, *, lora_debug: bool | None = None, move_debug: bool | None = None,
                  strict: bool | None = None) -> Settings:
        """Debug toggles take effect at once (they touch no tensor, so no queueing)."""
        changes = {k: v for k, v in {"lora_debug": lora_debug, "move_debug": move_debug,
                                     "strict": strict}.items() if v is not None}
        self.settings = self.settings.replace(**changes)
        diagnostics.set_debug_logging(self.settings.lora_debug, self.settings.move_debug)
        return self.settings

    def snapshot(self) -> Snapshot:
        """The last published snapshot with the live state and progress laid over it."""
        loaded = self._loaded
        status = loaded.compile.status() if loaded is not None and loaded.compile is not None else None
        return dataclasses.replace(self._snapshot, state=self._state.value, progress=self._progress, compile=status)

    def submit(self, name: str, detail: str, state: EngineState, body: Callable[[], Any],
               record: bool = True) -> Future:
        """Queue a command; `record=False` runs a read-only query on the worker, outside the state machine."""
        future: Future = Future()
        with self._wake:
            self._queue.append(_Command(name, detail, state, body, future, record))
            self._wake.notify()
        return future

    def close(self) -> None:
        with self._wake:
            self._queue.append(None)
            self._wake.notify()
        self._worker.join(timeout=60)

    @property
    def pipeline(self):
        """The live pipeline, for tests and benchmarks that must reach inside. Not for the UI."""
        return None if self._loaded is None else self._loaded.model.pipe

    # ------------------------------------------------------------------ queue plumbing
    @staticmethod
    def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise ValueError(f"{what} must be one of {', '.join(choices)}; got {value!r}")

    def _call(self, name: str, detail: str, state: EngineState, body: Callable[[], Any], result: bool = False):
        value = self.submit(name, detail, state, body).result()
        return value if result else self.snapshot()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
                command = self._queue.popleft()
            if command is None:
                return
            if command.record:
                self._run_transition(command)
            else:
                self._run_query(command)

    @staticmethod
    def _run_query(command: _Command) -> None:
        try:
            command.future.set_result(command.body())
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            command.future.set_exception(exc)

    def _run_transition(self, command: _Command) -> None:
        before = self._state
        self._state = command.state
        started, t0 = time.time(), time.perf_counter()
        found = repaired = 0
        outcome, error, value = "ok", None, None
        self._last_violations = ()  # the snapshot shows what this transition found (and repaired)
        try:
            found, repaired = self._verify_and_repair(f"before {command.name}")
            value = command.body()
            more_found, more_repaired = self._verify_and_repair(f"after {command.name}")
            found, repaired = found + more_found, repaired + more_repaired
            self._state = EngineState.READY if self._loaded else EngineState.EMPTY
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller's future
            error = exc
            rollback_failed = (isinstance(exc, RollbackFailed) or before == EngineState.ERROR
                               or not self._repair_after_failure(command.name))
            self._state = (EngineState.ERROR if rollback_failed
                           else EngineState.READY if self._loaded else EngineState.EMPTY)
            outcome = "failed, engine in ERROR" if rollback_failed else "failed, rolled back"
            self._last_error = ErrorRecord(command.name, f"{type(exc).__name__}: {exc}",
                                           traceback.format_exc(), time.time())
            # The traceback goes to the log as text: a live exc_info would keep its frames (and the
            # pipelines they reference) alive in any handler that keeps records.
            log.error("%s (%s) failed: %s\n%s", command.name, command.detail, str(exc), self._last_error.traceback)
        finally:
            self._progress = None
        duration = time.perf_counter() - t0
        self._timers.record(command.name, duration)
        self._history.append(Transition(command.name, command.detail, command.state.value, started, duration,
                                        outcome, found, repaired, None if error is None else str(error)))
        self.timeline.sample(command.name)
        self._publish()
        if error is None:
            command.future.set_result(value)
        else:
            command.future.set_exception(error)

    def _repair_after_failure(self, command: str) -> bool:
        """A failed body may have been cut off mid-move: verify and repair once more, never raising.
        Returns False when even that fails (the engine then enters ERROR)."""
        try:
            self._verify_and_repair(f"after failed {command}", strict=False)
            return True
        except Exception:  # noqa: BLE001 - reported through the ERROR state and the log
            log.exception("placement could not be repaired after failed %s", command)
            return False

    def _verify_and_repair(self, when: str, strict: bool | None = None) -> tuple[int, int]:
        """Find and repair placement violations; strict mode turns any finding into a failure."""
        if self._loaded is None:
            return 0, 0
        t0 = time.perf_counter()
        pipe, plan = self._loaded.model.pipe, self._loaded.plan
        found = placement.verify(pipe, plan)
        repaired = placement.sync(pipe, plan, reason=when) if found else 0
        self._timers.record("verify", time.perf_counter() - t0)
        self._last_violations += tuple(found)
        self._found_total += len(found)
        self._repaired_total += repaired
        if found:
            log.warning("%d placement violations %s, %d repaired; first: %s", len(found), when, repaired, found[0])
            if self.settings.strict if strict is None else strict:
                raise placement.PlacementError(
                    f"strict mode: {len(found)} placement violations {when} (repaired), first: {found[0]}")
        return len(found), repaired

    def _publish(self) -> None:
        loaded = self._loaded
        common = dict(
            state=self._state.value, device=str(self.device), requested_dtype=self._requested_dtype,
            offload=self._offload, violations=self._last_violations,
            violations_found_total=self._found_total, violations_repaired_total=self._repaired_total,
            lora_counters=MappingProxyType(dict(self._counters)),
            timers=MappingProxyType(self._timers.snapshot()), history=tuple(self._history),
            last_error=self._last_error, taken_at=time.time(),
        )
        if loaded is None:
            self._snapshot = Snapshot(**common)
            return
        rows = diagnostics.placement_rows(loaded.model.pipe, loaded.plan, loaded.stack.patched_modules(),
                                          list(self._last_violations))
        self._snapshot = Snapshot(
            model=loaded.model.info.name, arch=loaded.model.arch, model_hash=loaded.model.short_hash,
            native_size=loaded.model.pipe.unet.config.sample_size * loaded.model.pipe.vae_scale_factor,
            dtype=placement.dtype_name(loaded.plan.dtype), loras=loaded.stack.applied, placement=rows,
            lora_mode="on the fly" if loaded.stack.on_the_fly else "fused",
            embeddings=loaded.embeddings, **common)

    # ------------------------------------------------------------------ command bodies (worker only)
    def _resolved_dtype(self, requested: str) -> torch.dtype:
        return placement.resolve_dtype(requested, self.device)

    def _do_load(self, name_or_path: str, dtype: str | None) -> None:
        requested = dtype or self._requested_dtype
        info = models.resolve_checkpoint(name_or_path, self.settings.checkpoints_dir)
        self._progress = Progress(f"loading {info.name}", 0, 3)
        t0 = time.perf_counter()
        fresh = models.load_pipeline(info, self._resolved_dtype(requested))
        self._timers.record("load", time.perf_counter() - t0)
        self._progress = Progress(f"placing {info.name}", 1, 3)
        self._swap_in(fresh, self._resolved_dtype(requested))
        self._requested_dtype = requested
        self._enable_all_loras()
        self._progress = Progress("applying LoRAs", 2, 3)
        self._reapply_desired_loras()

    def _place(self, pipe, plan: placement.PlacementPlan, reason: str) -> offload.OffloadStrategy:
        """Apply a plan and install its offload strategy; on failure no hook of it stays behind."""
        t0 = time.perf_counter()
        placement.apply_plan(pipe, plan, reason=reason)
        pipe.execution_device = plan.device
        strategy = offload.make_strategy(pipe, plan, self.settings.vram_budget_gib, self.settings.balanced_watermark)
        try:
            strategy.install()
        except BaseException:
            strategy.remove()
            raise
        self._timers.record("move", time.perf_counter() - t0)
        return strategy

    def _swap_in(self, fresh: models.LoadedModel, dtype: torch.dtype) -> None:
        """Place a freshly loaded model and make it current; the old one stays usable until then.

        The old pipeline is parked on the CPU (hooks removed) so a large new model can fit on the
        GPU; if placing the new one fails, the old one is put back with its offload mode.
        """
        old = self._loaded
        plan = placement.plan_placement(fresh.pipe, dtype, self.device, self._offload)
        parked = False
        try:
            if old is not None and self.device.type != "cpu":
                compiled.disable(old.model.pipe)
                old.strategy.remove()
                parked = True
                cpu_plan = placement.plan_placement(old.model.pipe, old.plan.dtype, torch.device("cpu"), "none")
                placement.apply_plan(old.model.pipe, cpu_plan, reason="park previous model")
            embedded = embeddings.load_all(fresh.pipe, fresh.arch, self.settings.embeddings_dir)
            strategy = self._place(fresh.pipe, plan, reason="load")
        except BaseException:
            del fresh
            if parked:
                self._restore_placement(old)
            _release_memory()
            raise
        if old is not None:
            compiled.disable(old.model.pipe)
            old.strategy.remove()
            old.stack.release()
        fresh.pipe.set_progress_bar_config(disable=True)
        stack = LoraStack(fresh.pipe, fresh.arch, self.device, on_the_fly=strategy.streams_weights)
        self._loaded = _Loaded(fresh, plan, stack, embedded, strategy)
        self._sync_compile(self._loaded)
        del old
        _release_memory()

    def _sync_compile(self, loaded: _Loaded) -> None:
        """(Re)install the compiled UNet path when `--compile` is on. LoRA changes never call this:
        fused weights are written in place, so compiled graphs stay valid without a recompile."""
        compiled.disable(loaded.model.pipe)
        loaded.compile = None
        if self.settings.compile:
            loaded.compile = compiled.enable(loaded.model.pipe, offload=loaded.plan.offload, device=self.device,
                                             mode=self.settings.compile_mode,
                                             cache_dir=self.settings.compile_cache_dir,
                                             # CUDA-graph trees are per thread: record them on the worker.
                                             background=self.settings.compile_mode == "default")

    def _restore_placement(self, loaded: _Loaded) -> None:
        """Put a model back to its own plan and offload mode (the undo of parking or a failed move)."""
        try:
            loaded.strategy.remove()
            loaded.strategy = self._place(loaded.model.pipe, loaded.plan, reason="rollback")
            loaded.stack.set_on_the_fly(loaded.strategy.streams_weights)
        except BaseException as exc:
            raise RollbackFailed(f"could not put the model back to its previous placement: {exc}") from exc

    def _reapply_desired_loras(self) -> None:
        """After a (re)load, apply what the user asked for. A LoRA that does not fit this model is
        reported and set aside (`_unfit`) but stays in the user's list, so switching back to a model
        it fits re-applies it; generations meanwhile run without it."""
        self._unfit = set()
        fitting: list[LoraSpec] = []
        for spec in self._desired_loras:
            try:
                self._apply_loras((*fitting, spec))
                fitting.append(spec)
            except Exception as exc:  # reported per LoRA in counters; the load itself succeeded
                self._unfit.add(spec.name)
                log.warning("LoRA %s not re-applied after load: %s", spec.name, str(exc))

    def _do_set_dtype(self, dtype: str) -> None:
        """Reload from the checkpoint in the new dtype: casting back and forth would lose bits."""
        if self._loaded is None:
            self._requested_dtype = dtype
            return
        self._do_load(self._loaded.model.info.name, dtype)

    def _do_set_offload(self, mode: str) -> None:
        """Remove the old mode's hooks completely, apply the new plan, install the new hooks."""
        loaded = self._loaded
        if loaded is None:
            self._offload = mode
            return
        new_plan = placement.plan_placement(loaded.model.pipe, loaded.plan.dtype, self.device, mode)
        compiled.disable(loaded.model.pipe)
        loaded.strategy.remove()
        strategy = None
        try:
            strategy = self._place(loaded.model.pipe, new_plan, reason=f"offload {mode}")
            loaded.stack.set_on_the_fly(strategy.streams_weights)
        except BaseException:
            if strategy is not None:
                strategy.remove()
            self._restore_placement(loaded)
            self._sync_compile(loaded)
            raise
        loaded.plan, loaded.strategy, self._offload = new_plan, strategy, mode
        self._sync_compile(loaded)

    def _do_set_loras(self, specs: tuple[LoraSpec, ...]) -> None:
        """The desired list changes only if it applies: a LoRA that fails leaves the previous list."""
        self._enable_all_loras()
        if self._loaded is not None:
            self._apply_loras(specs)
        self._desired_loras, self._unfit = specs, set()

    def _apply_loras(self, specs: tuple[LoraSpec, ...]) -> None:
        """Reconcile the stack with `specs`, all or nothing, and update the per-LoRA counters."""
        assert self._loaded is not None
        t0 = time.perf_counter()
        try:
            files = {s.name: self._open_lora(s.name) for s in specs}
            report = self._loaded.stack.reconcile(specs, files, progress=self._patch_progress)
        except Exception as exc:
            name = getattr(exc, "lora_name", None)
            if name is not None:
                old = self._counters.get(name, diagnostics.LoraCounters())
                self._counters[name] = dataclasses.replace(old, apply_errors=old.apply_errors + 1, message=str(exc))
            raise
        finally:
            self._timers.record("patch", time.perf_counter() - t0)
        for name, match in report.items():
            old = self._counters.get(name, diagnostics.LoraCounters())
            self._counters[name] = dataclasses.replace(old, matched_layers=match.matched_layers,
                                                       unmatched_keys=match.unmatched_keys, message=match.message)

    def _patch_progress(self, done: int, total: int) -> None:
        self._progress = Progress("patching LoRA layers", done, total)

    def _open_lora(self, name: str):
        """Read a LoRA file; a read failure is that LoRA's apply error (counted under its name)."""
        try:
            return self.library.open(name)
        except (AdapterError, OSError) as exc:
            raise LoraApplyError(name, str(exc)) from exc

    def _usable(self, specs: tuple[LoraSpec, ...]) -> tuple[LoraSpec, ...]:
        """`specs` minus LoRAs disabled after runtime errors and those that do not fit this model."""
        disabled = {name for name, counters in self._counters.items() if counters.disabled}
        return tuple(s for s in specs if s.name not in self._unfit | disabled)

    def _do_generate(self, params: GenerateParams) -> list[GeneratedImage]:
        if self._loaded is None:
            raise RuntimeError("no model loaded: load a checkpoint first")
        params, wanted = merge_prompt_loras(params, self._desired_loras)
        self.library.validate_specs(wanted)
        wanted = self._usable(wanted)
        if wanted != self._loaded.stack.applied:
            self._state = EngineState.PATCHING
            self._apply_loras(wanted)
            self._state = EngineState.GENERATING
            self._verify_and_repair("before denoising")
        loaded = self._loaded
        seed = generate.resolve_seed(params.seed)
        applied = tuple((s.name, s.unet_strength, self.library.short_hash(s.name)) for s in loaded.stack.applied)
        ctx = RunContext(loaded.model.info.name, loaded.model.short_hash, applied)
        images = self._denoise(loaded, params, seed)
        out = []
        for i, image in enumerate(images):
            text = generate.infotext(params, seed + i, ctx)
            path = generate.save_png(image, text, self.settings.outputs_dir, seed + i)
            out.append(GeneratedImage(image, seed + i, text, path))
        return out

    def _denoise(self, loaded: _Loaded, params: GenerateParams, seed: int) -> list:
        self._progress = Progress("denoising", 0, params.steps)

        def on_step(step: int, total: int) -> None:
            self._progress = Progress("denoising", step, total)

        t0 = time.perf_counter()
        try:
            return generate.run(loaded.model.pipe, params, seed, on_step)
        except torch.cuda.OutOfMemoryError as exc:
            _release_memory()
            raise MemoryError(
                f"out of GPU memory generating {params.batch}x{params.width}x{params.height}: "
                "try a smaller batch or size, or an offload mode (model, balanced, sequential)") from exc
        except Exception as exc:
            self._attribute_runtime_error(loaded, exc)
            raise
        finally:
            self._timers.record("denoise+decode", time.perf_counter() - t0)
            loaded.strategy.settle()
            loaded.plan = loaded.plan.with_resident(loaded.strategy.resident())

    def _attribute_runtime_error(self, loaded: _Loaded, exc: Exception) -> None:
        """Count an error raised inside a patched layer against the LoRAs patched into it.

        Past `max_lora_errors` (and outside strict mode, where every error must surface as is) the
        LoRA is removed from the model and marked disabled, so one bad adapter cannot break every
        generation; an explicit set_loras or a model load re-enables it.
        """
        names = loaded.stack.culprits(exc)
        for name in names:
            old = self._counters.get(name, diagnostics.LoraCounters())
            errors = old.runtime_errors + 1
            disable = not self.settings.strict and errors >= self.settings.max_lora_errors
            message = (f"disabled after {errors} runtime errors; last: {exc}" if disable
                       else f"runtime error {errors}/{self.settings.max_lora_errors}: {exc}")
            self._counters[name] = dataclasses.replace(old, runtime_errors=errors, disabled=disable, message=message)
            log.error("LoRA %s: %s", name, message)
        disabled = {n for n in names if self._counters[n].disabled}
        if disabled:
            self._apply_loras(tuple(s for s in loaded.stack.applied if s.name not in disabled))

    def _enable_all_loras(self) -> None:
        for name, counters in self._counters.items():
            if counters.disabled:
                self._counters[name] = dataclasses.replace(counters, disabled=False, runtime_errors=0, message="")

    def _do_unload(self) -> None:
        if self._loaded is not None:
            compiled.disable(self._loaded.model.pipe)
            self._loaded.strategy.remove()
            self._loaded.stack.release()
        self._loaded = None
        _release_memory()
