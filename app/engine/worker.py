"""The engine state machine: one worker thread owns the model; everything else asks.

Why: the seed crashes were races between code paths that each moved or patched tensors on
their own. Here every mutation (load, dtype, offload, LoRAs, unload) and every generation is a
command on one queue, served by one worker. A mutation builds the next `Desired` and asks the
model lifecycle to realise it; each command runs as a transition: enter its working state,
verify/repair placement *before* (so a stray tensor never reaches a forward pass), run the body,
verify/repair *after*, record a history row, publish an immutable snapshot. A body that fails
leaves the model and the `Desired` as they were (each lifecycle step owns its undo); if an undo
itself fails the engine enters ERROR and only a load or unload leaves it.

A generation may carry its own `Desired` (a tab's panel, an API session's choices): before it
runs, a `reconcile` transition makes the model match it, and the engine then holds that state
for that owner (`Snapshot.desired`, `Snapshot.held_for`) until the next job asks for another.
The queue (`app/engine/queue.py`) takes waiting jobs grouped by what they need, fairly.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from app import diagnostics, gc_policy
from app.adapters.errors import AdapterError, LoraApplyError
from app.adapters.files import LoraLibrary
from app.adapters.specs import LoraSpec
from app.controlnet.files import ControlNetLibrary
from app.engine import job_memory, lora_options, part_choices, placement, timeline
from app.engine.control_runs import ControlRuns
from app.engine.desired import Desired
from app.engine.detailing import Detailing, DetailParams
from app.engine.file_scans import FileScans, ModelScan
from app.engine.generate import GeneratedImage, GenerateParams
from app.engine.generating import GENERATIONS, Generating, Job
from app.engine.lifecycle import ModelLifecycle
from app.engine.lora_counters import LoraCounterBook, capped
from app.engine.offload import MODES, idle_note
from app.engine.queue import Command, CommandQueue, EngineBusy
from app.engine.refining import Refining, refined
from app.engine.snapshot import EngineState, ErrorRecord, Progress, Snapshot, Transition
from app.engine.stage_params import HiresParams
from app.engine.storage import WEIGHTS_CHOICES
from app.engine.upscaler_slot import FACE_COMPONENT, UpscalerSlot
from app.engine.upscaling import Upscaling
from app.engine.verifying import Verifying
from app.engine.workflows import Workflows
from app.settings import DTYPE_CHOICES, Settings
from app.upscalers import faces
from app.upscalers.files import UpscalerLibrary

log = logging.getLogger(__name__)


__all__ = ["Engine", "EngineBusy"]


class Engine(Generating, Workflows, Detailing, Refining, Upscaling, ControlRuns, Verifying):
    """Public, blocking API over the command queue. Thread-safe; every call waits for its result.
    Generation, Interrupt and Skip come from `Generating` (app/engine/generating.py); img2img,
    inpaint and hires fix from `Workflows` (app/engine/workflows.py); the detail pass from `Detailing`
    (app/engine/detailing.py); the refiner from `Refining`
    (app/engine/refining.py); Extras and the upscaler models from `Upscaling` (app/engine/upscaling.py); the
    checks around every transition and the snapshot it publishes from `Verifying` (app/engine/verifying.py)."""

    def __init__(self, settings: Settings) -> None:
        gc_policy.freeze_startup_objects()
        self.settings = settings
        self.device = placement.resolve_device(settings.device)
        if (note := idle_note(settings.offload, self.device)) is not None:  # `--offload` on a machine without a GPU
            log.info(note)
        self.memory_budget = job_memory.budget_for(settings.memory_budget_gib, self.device)  # what one job may plan
        self.library = LoraLibrary(settings.lora_dir, cache_bytes=settings.lora_cache_mib * 2**20)
        self._queue = CommandQueue(settings.queue_size)
        self._account_of: Callable[[str | None], str | None] = lambda _owner: None  # all one account
        self._state = EngineState.EMPTY
        self._desired = Desired(dtype=settings.dtype, offload=settings.offload, weights=settings.weights)
        self._held_for: str | None = None  # the owner whose job last set `_desired` (None: a direct change)
        self._counters = LoraCounterBook(self.library.exists, settings.max_lora_errors)
        self._history: collections.deque[Transition] = collections.deque(maxlen=settings.history_size)
        self._timers = diagnostics.Timers()
        self._scans = FileScans()
        self._lifecycle = ModelLifecycle(settings, self.device, self._timers, self._open_lora, self._set_progress,
                                         self._scans)
        self.upscalers = UpscalerLibrary(settings.data_dir / "models")
        self.controlnet_library = ControlNetLibrary(settings.controlnet_dir)  # units' models (control_runs.py)
        self._upscaler = UpscalerSlot(settings, self.device, self._timers)  # a component verified with the model
        self._face_restorer = UpscalerSlot(settings, self.device, self._timers, FACE_COMPONENT, faces.describe)
        self._found_total = 0
        self._repaired_total = 0
        self._last_error: ErrorRecord | None = None
        self._progress: Progress | None = None
        self._last_violations: tuple[placement.Violation, ...] = ()
        self._job: Job | None = None
        self._last_generation: timeline.JobTimeline | None = None  # where the last generation's time went
        self.timeline = diagnostics.MemoryTimeline()
        # The published snapshot and its model's file read, as one pair: the hash may come after publishing.
        self._published: tuple[Snapshot, ModelScan | None] = (
            Snapshot(state=EngineState.EMPTY.value, device=str(self.device), requested_dtype=settings.dtype,
                     offload=settings.offload), None)
        diagnostics.set_debug_logging(settings.lora_debug, settings.move_debug)
        self._worker = threading.Thread(target=self._serve, name="engine-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ public API
    def load_model(self, name_or_path: str, dtype: str | None = None) -> Snapshot:
        """Load a checkpoint (a no-op when that file is already loaded in that dtype)."""
        if dtype is not None:
            self._check_choice("dtype", dtype, DTYPE_CHOICES)
        return self._change("load_model", f"{name_or_path} dtype={dtype or self._desired.dtype}", EngineState.LOADING,
                            lambda d: d.replace(model=name_or_path, dtype=dtype or d.dtype), enable_loras=True)

    def set_dtype(self, dtype: str) -> Snapshot:
        """Reload in the new dtype (casting back and forth would lose bits)."""
        self._check_choice("dtype", dtype, DTYPE_CHOICES)
        return self._change("set_dtype", dtype, EngineState.LOADING, lambda d: d.replace(dtype=dtype))

    def set_weights(self, weights: str) -> Snapshot:
        """Reload with the large weights stored in `weights` ("fp8"; "fp8-compute": and Linear layers computed
        as fp8 matmuls) or all in the compute dtype ("full")."""
        self._check_choice("weights", weights, WEIGHTS_CHOICES)
        return self._change("set_weights", weights, EngineState.LOADING, lambda d: d.replace(weights=weights))

    def set_model_parts(self, parts: Mapping[str, str | None]) -> Snapshot:
        """Choose the separate text-encoder/VAE files (names in `models/text_encoder`, `models/VAE`;
        None forgets a choice) the loaded checkpoint is assembled from; remembered per checkpoint,
        and the model reloads with them. A choice that fails to load is forgotten again."""
        def body() -> None:
            facts = self._lifecycle.facts()
            if facts is None:
                raise RuntimeError("no model loaded: load the checkpoint whose parts you choose first")
            before = part_choices.chosen(self.settings, facts.model)
            part_choices.choose(self.settings, facts.family, facts.model, parts)
            try:
                self._realise(self._desired, self._desired.loras)
            except BaseException:
                part_choices.choose(self.settings, facts.family, facts.model,
                                    {c: before.get(c) for c in {*before, *parts}})
                raise
        detail = ", ".join(f"{c}={n}" for c, n in parts.items())
        return self._call("set_model_parts", capped(detail), EngineState.LOADING, body)

    def set_offload(self, mode: str) -> Snapshot:
        self._check_choice("offload", mode, tuple(MODES))
        snap = self._change("set_offload", mode, EngineState.MOVING, lambda d: d.replace(offload=mode))
        note = idle_note(mode, self.device)
        if note is not None:
            log.info(note)
        return snap

    def set_loras(self, specs: Sequence[LoraSpec], *, set_aside_unfit: bool = False) -> Snapshot:
        """The full wanted list. By default applied all or nothing: a LoRA that does not fit fails the
        command and leaves the previous list. With `set_aside_unfit` (the UI's way) the list becomes
        the wanted one and a LoRA that does not fit is set aside, its reason in the snapshot's
        `lora_states`; the others apply."""
        specs = tuple(specs)
        self.library.validate_specs(specs)
        detail = ", ".join(f"{s.name}:{s.unet_strength:g}/{s.te_strength:g}" for s in specs) or "none"
        return self._change("set_loras", capped(detail), EngineState.PATCHING, lambda d: d.replace(loras=specs),
                            enable_loras=True, retry_set_aside=True, set_aside_unfit=set_aside_unfit)

    def set_lora_partial(self, name: str, allowed: bool) -> Snapshot:
        """Allow (or no longer allow) the LoRA `name` to apply when less than half of its tensors match
        the loaded model; remembered per LoRA in the data folder. The wanted list is applied again at
        once the page's way: a LoRA now allowed leaves the set-aside list, one no longer allowed joins it."""
        self.library.path_for(name)  # only a LoRA of the library is remembered
        allowed = bool(allowed)

        def body() -> None:
            before = lora_options.allows_partial(self.settings, name)
            lora_options.set_allow_partial(self.settings, name, allowed)
            if self._lifecycle.pipeline is None:
                return
            try:
                self._realise(self._desired, self._desired.loras, set_aside_unfit=True)
            except BaseException:
                lora_options.set_allow_partial(self.settings, name, before)
                raise
        return self._call("set_lora_partial", capped(f"{name}={allowed}"), EngineState.PATCHING, body)

    def lora_partial_allowed(self, name: str) -> bool:
        """Whether `name` may apply in part (what `set_lora_partial` remembered); reads no tensor."""
        return lora_options.allows_partial(self.settings, name)

    def unload(self) -> Snapshot:
        return self._change("unload", "", EngineState.MOVING, lambda d: d.replace(model=None))

    def generate(self, params: GenerateParams, *, owner: str | None = None, hires: HiresParams | None = None,
                 desired: Desired | None = None, details: DetailParams | None = None) -> list[GeneratedImage]:
        """Generate `params.n_iter` × `params.batch` images; `owner` names who may interrupt it. With
        `hires` each run is A1111's hires fix, one transition per stage (`Workflows.txt2img_hires`); with
        a refiner checkpoint in `params`, A1111's refiner (`Refining.txt2img_refined`). With `desired` the
        model is first made to match it (None: as the engine holds it now). With `details` the images then go
        through the detail passes (`Detailing`, app/engine/detailing.py)."""
        if hires is None:
            self._admit("txt2img", params, desired)
        self._check_units(params.controlnet_units, self._family_for(desired), "txt2img")
        if refined(params):
            if params.controlnet_units:
                raise ValueError("ControlNet units and the refiner do not run together yet: use one of them")
            if hires is not None:
                raise ValueError("the refiner and the hires fix do not run together yet: use one of them")
            return self.txt2img_refined(params, owner=owner, desired=desired, details=details)
        if hires is not None:
            return self.txt2img_hires(params, hires, owner=owner, desired=desired, details=details)
        if details is not None:
            return self.txt2img_detailed(params, details, owner=owner, desired=desired)
        detail = f"{params.steps} steps {params.width}x{params.height} x{params.batch}x{params.n_iter}"
        future = self.submit("generate", detail, EngineState.GENERATING, lambda: self._do_generate(params), owner=owner,
                             desired=desired)
        return future.result()

    def inspect_lora(self, name: str):
        """Parse and shape-check a LoRA against the loaded model without applying it.

        Returns its `MatchReport`; raises the same error `set_loras` would. Runs on the worker
        (it reads the model) but is not a transition, so it leaves no history row.
        """
        return self.submit("inspect_lora", name, EngineState.READY,
                           lambda: self._lifecycle.inspect(name, self._read_lora(name)), record=False).result()

    def set_debug(self, *, lora_debug: bool | None = None, move_debug: bool | None = None,
                  strict: bool | None = None, strict_forwards: bool | None = None) -> Settings:
        """Debug toggles take effect at once: logging and strict need no queueing (they touch no
        tensor); strict forwards add or remove hooks, so that one is a command of the worker's."""
        changes = {k: v for k, v in {"lora_debug": lora_debug, "move_debug": move_debug, "strict": strict,
                                     "strict_forwards": strict_forwards}.items() if v is not None}
        if strict_forwards is not None and strict_forwards != self.settings.strict_forwards:
            self.submit("strict_forwards", "on" if strict_forwards else "off", self._state,
                        lambda: self._set_strict_forwards(strict_forwards), record=False).result()
        self.settings = self.settings.replace(**changes)
        diagnostics.set_debug_logging(self.settings.lora_debug, self.settings.move_debug)
        return self.settings

    def snapshot(self, wait_for_hash: bool = False) -> Snapshot:
        """The last published snapshot with the live state, progress, queue length and holder laid over it,
        and its model's hash once the background read of its file has it (after a first load it is None
        until then, unless `wait_for_hash`: for what names a model by its hash, as A1111's API does)."""
        published, scan = self._published
        return dataclasses.replace(published, state=self._state.value, progress=self._progress,
                                   compile=self._lifecycle.compile_status(), queued=len(self._queue),
                                   generating=self._job is not None, held_for=self._held_for,
                                   last_generation=self._last_generation,
                                   model_hash=published.model_hash or (scan and scan.short_hash(wait_for_hash)))

    def snapshots(self) -> tuple[Snapshot, ...]:
        """One snapshot per engine: this one (an `EnginePool` has several)."""
        return (self.snapshot(),)

    def submit(self, name: str, detail: str, state: EngineState, body: Callable[[], Any],
               record: bool = True, owner: str | None = None, desired: Desired | None = None) -> Future:
        """Queue a command; `record=False` runs a read-only query on the worker, outside the state machine.
        A command with `desired` runs after a `reconcile` transition has made the model match it."""
        future: Future = Future()
        self._queue.put(Command(name, detail, state, body, future, record, owner, desired,
                                account=self._account_of(owner)))
        return future

    def take_turns_by(self, account_of: Callable[[str | None], str | None]) -> None:
        """Serve the accounts in turn (`app/engine/queue.py`): `account_of(owner)` names the login a job of
        `owner` counts against (`Accounts.of_owner`), read when the job is queued."""
        self._account_of = account_of

    def close(self) -> None:
        self._queue.close()
        self._worker.join(timeout=60)
        self._scans.close()

    @property
    def pipeline(self):
        """The live pipeline, for tests and benchmarks that must reach inside. Not for the UI."""
        return self._lifecycle.pipeline

    @property
    def lora_stack(self):
        """The live LoRA stack (backups, bypass layers), for tests. Not for the UI."""
        return self._lifecycle.stack

    @property
    def placement_plan(self):
        """The live placement plan (which components balanced mode keeps resident), for tests."""
        return self._lifecycle.plan

    # ------------------------------------------------------------------ queue plumbing
    @staticmethod
    def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise ValueError(f"{what} must be one of {', '.join(choices)}; got {capped(repr(value), 80)}")

    def _run_stage(self, name: str, detail: str, state: EngineState, body: Callable[[], Any]) -> Any:
        """Run `body` now, on the worker, as a transition of its own: one stage of a workflow command
        (verify/repair before and after, its history row, a published snapshot); raises its error."""
        command = Command(name, detail, state, body, Future(), stage=True)
        self._run_transition(command)
        return command.future.result()

    def _call(self, name: str, detail: str, state: EngineState, body: Callable[[], Any], result: bool = False):
        value = self.submit(name, detail, state, body).result()
        return value if result else self.snapshot()

    def _change(self, name: str, detail: str, state: EngineState, change: Callable[[Desired], Desired], *,
                enable_loras: bool = False, **realise_options: bool) -> Snapshot:
        """A mutation: realise the next `Desired` and commit it only if that succeeded."""
        def body() -> None:
            want = change(self._desired)
            if want.model is None:
                self._release_refiner()
            if enable_loras:
                self._counters.enable_all()
            self._realise(want, want.loras, **realise_options)
            self._upscaler.follow(want.dtype, want.offload)
            self._face_restorer.follow(want.dtype, want.offload)
            self._desired, self._held_for = want, None
        return self._call(name, detail, state, body)

    def _realise(self, want: Desired, loras: tuple[LoraSpec, ...], **options: bool) -> None:
        """Realise `want` with `loras` (minus disabled ones); counters record what was matched,
        set aside or refused."""
        disabled = self._counters.disabled()
        try:
            reports, set_aside = self._lifecycle.realise(want, tuple(s for s in loras if s.name not in disabled),
                                                         **options)
        except LoraApplyError as exc:
            self._counters.apply_failed(exc.lora_name, str(exc))
            self.library.forget(exc.lora_name)  # a refused file leaves nothing resident
            raise
        for name, reason in set_aside.items():
            self._counters.set_aside(name, reason)
            self.library.forget(name)
        self._counters.matched(reports)

    def _serve(self) -> None:
        while True:
            command = self._queue.take(self._desired, self._taken)
            if command is None:
                return
            with timeline.clocked(timeline.JobClock(command.name, command.detail,
                                                    time.perf_counter() - command.queued_at)):
                self._serve_one(command)
            del command  # what it holds (an img2img's decoded pictures) must not wait for the next command

    def _serve_one(self, command: Command) -> None:
        if command.desired is not None:
            with timeline.phase("reconcile"):
                if not self._reconciled(command, self._job):
                    return
        if command.record:
            self._run_transition(command)
        else:
            self._run_query(command)

    def _run_query(self, command: Command) -> None:
        """Run a command outside the state machine (a query, or a workflow whose stages are the
        transitions); a workflow's job ends with it, before its caller hears back."""
        try:
            value, error = command.body(), None
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            value, error = None, exc
        self._job = None
        self._answer(command, value, error)

    def _answer(self, command: Command, value: Any, error: BaseException | None) -> None:
        """Hand the result to the caller; a generation's timeline is kept first, so the snapshot its
        caller reads next shows where its time went."""
        clock = timeline.current()
        if clock is not None and command.name in GENERATIONS and not command.stage:
            self._last_generation = clock.finish()
        if error is None:
            command.future.set_result(value)
        else:
            command.future.set_exception(error)

    def _run_transition(self, command: Command) -> None:
        before = self._state
        self._state = command.state
        started, t0 = time.time(), time.perf_counter()
        found = repaired = 0
        error, value = None, None
        self._last_violations = ()  # the snapshot shows what this transition found (and repaired)
        try:
            try:
                with timeline.phase("verify before"):
                    found, repaired = self._verify_and_repair(f"before {command.name}")
                value = command.body()
                with timeline.phase("verify after"):
                    more_found, more_repaired = self._verify_and_repair(f"after {command.name}",
                                                                        after_lora_change=command.name == "set_loras")
                found, repaired = found + more_found, repaired + more_repaired
                outcome = "interrupted" if self._job is not None and self._job.interrupted else "ok"
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller's future
                error = exc
                outcome = self._fail(command, exc, before)
            if outcome != "failed, engine in ERROR":
                self._state = EngineState.READY if self._lifecycle.pipeline is not None else EngineState.EMPTY
            duration = time.perf_counter() - t0
            with timeline.phase("history"):
                self._timers.record(command.name, duration)
                self._history.append(Transition(command.name, command.detail, command.state.value, started,
                                                duration, outcome, found, repaired,
                                                None if error is None else self.shown_folders()(capped(str(error)))))
                self.timeline.sample(command.name)
            with timeline.phase("publish"):
                self._publish()
        finally:
            # Only now, with its history row published: a snapshot that shows the job ended shows how.
            self._progress = None
            if not command.stage:
                self._job = None  # set when a generation left the queue
        self._answer(command, value, error)
        self._scans.begin()  # a model this step loaded: its files are read once its caller has the answer

    # ------------------------------------------------------------------ command bodies (worker only)
    def _set_progress(self, phase: str, step: int, total: int, preview=None, preview_step: int | None = None) -> None:
        """Publish progress; a step without a new preview keeps showing the last one (of `preview_step`)."""
        if preview is None and self._progress is not None and self._progress.phase == phase:
            preview, preview_step = self._progress.preview, self._progress.preview_step
        self._progress = Progress(phase, step, total, preview, preview_step)

    def _open_lora(self, name: str):
        """Read a LoRA file; a read failure is that LoRA's apply error (counted under its name)."""
        try:
            return self._read_lora(name)
        except LoraApplyError:
            raise
        except (AdapterError, OSError) as exc:
            raise LoraApplyError(name, str(exc)) from exc

    def _read_lora(self, name: str):
        """A file not read yet is first matched against the model from its header alone, so one that
        does not fit is refused without a byte of its tensors read (nothing of it stays in memory)."""
        if not self.library.cached(name) and self._lifecycle.pipeline is not None:
            try:
                self._lifecycle.inspect(name, self.library.header_view(name))
            except (NotImplementedError, RuntimeError):  # a check that needs tensor values: the full read decides
                pass
        return self.library.open(name)

