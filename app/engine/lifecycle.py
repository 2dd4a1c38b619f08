"""The model lifecycle: the steps that make the loaded model match a `Desired`.

Load and swap a checkpoint, place it under an offload mode (plan, move, install the mode's
hooks: `Placing`, app/engine/placing.py), patch LoRAs, run a generation, unload. Only the worker
calls these, one at a time, and
each step owns its undo: a load that fails leaves the previous model loaded and placed as it
was; an offload switch that fails puts the previous mode back; a LoRA change is all or nothing
(the stack's own rollback). `realise` diffs a `Desired` against what is loaded and runs only
the steps that differ.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from app import diagnostics, heap
from app.adapters.errors import LoraApplyError
from app.adapters.files import AdapterFile
from app.adapters.matching import MatchReport
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.stepping import StepStrengths
from app.engine import (
    compiled,
    decoding,
    embeddings,
    fp8_matmul,
    models,
    offload,
    part_choices,
    placement,
    stages,
    storage,
)
from app.engine.checkpoint_files import ModelLoadError, resolve_checkpoint
from app.engine.controlnet_slot import AttachedControlNets, ControlNetSlot
from app.engine.desired import Desired
from app.engine.file_scans import FileScans, ModelScan
from app.engine.generate import GenerateParams
from app.engine.interrupt import stop_checks
from app.engine.lora_options import allows_partial
from app.engine.memory import release_memory
from app.engine.placing import Placing
from app.engine.snapshot import LoadedFacts
from app.engine.step_cache import step_cached
from app.engine.timeline import phase
from app.families import family
from app.hooks import HookRegistry
from app.safetensors_files import FileIdentity
from app.settings import Settings

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]


@dataclass
class _Loaded:
    """The current model and everything applied to it (lifecycle-private)."""

    model: models.LoadedModel
    identity: FileIdentity  # the checkpoint's size and mtime at load: a changed file is reloaded
    scan: ModelScan  # its files' hash and value check, read in the background
    plan: placement.PlacementPlan
    hooks: HookRegistry
    stack: LoraStack
    embeddings: tuple[str, ...]
    strategy: offload.OffloadStrategy
    weights: str = "full"  # "full", or how the large weights are stored ("fp8", "fp8-compute")
    stored: storage.Stored = field(default_factory=dict)  # layers whose weight rests in that dtype
    matmul: storage.MatmulLayers = field(default_factory=storage.MatmulLayers)  # of those, computed in fp8
    set_aside: dict[str, str] = field(default_factory=dict)  # LoRA name -> why it does not fit this model
    compile: compiled.CompileState | None = None
    stage_pipes: dict[str, object] = field(default_factory=dict)  # img2img/inpaint pipelines on the same components
    shown: tuple | None = None  # (what they depend on, the placement rows last built): `ModelLifecycle.rows`
    control: AttachedControlNets | None = None  # the ControlNet stack attached as a component (controlnet_slot.py)


class ModelLifecycle(Placing, ControlNetSlot):
    """Owns the loaded pipeline; the worker's only way to change it. Where it lives (plan, hooks, parking)
    is `Placing`'s (app/engine/placing.py)."""

    def __init__(self, settings: Settings, device: torch.device, timers: diagnostics.Timers,
                 open_lora: Callable[[str], AdapterFile], progress: ProgressFn, scans: FileScans) -> None:
        self._settings = settings
        self._device = device
        self._timers = timers
        self._open_lora = open_lora
        self._progress = progress
        self._loaded: _Loaded | None = None
        self._parked: placement.PlacementPlan | None = None  # the all-CPU plan while parked (`park`)
        self._embedding_notes: set[tuple[str, int]] = set()  # embedding files whose misfit was logged once
        self._scans = scans  # reads a loaded model's files after its load (the worker begins them)
        self.strict_forwards = settings.strict_forwards  # the `debug.strict` check on every forward (strict.py)
        self.carry = stages.Carry()  # tensors a workflow stage hands to the next (verified with the model)
        # The layers the last `realise` wrote when writing LoRA layers in place was all it did (no load,
        # offload switch or unpark): what the verify after a LoRA change must cover (`verify_and_repair`).
        self._lora_writes: tuple[tuple[str, str, torch.nn.Module], ...] | None = None
        self._rows_written: tuple[tuple[str, str, torch.nn.Module], ...] | None = None  # those, verified alone

    # ------------------------------------------------------------------ reading
    @property
    def pipeline(self):
        return None if self._loaded is None else self._loaded.model.pipe

    @property
    def stack(self) -> LoraStack | None:
        return None if self._loaded is None else self._loaded.stack

    @property
    def scan(self) -> ModelScan | None:
        """The loaded model's background file read (its hash and weight check)."""
        return None if self._loaded is None else self._loaded.scan

    @property
    def plan(self) -> placement.PlacementPlan | None:
        return None if self._loaded is None else self._loaded.plan

    @property
    def stage_pipelines(self) -> dict[str, object]:
        """The img2img/inpaint pipelines built on the loaded components so far."""
        return {} if self._loaded is None else dict(self._loaded.stage_pipes)

    def facts(self) -> LoadedFacts | None:
        loaded = self._loaded
        if loaded is None:
            return None
        pipe, bypass = loaded.model.pipe, loaded.stack.bypass_components
        patched = {component for component, _ in loaded.stack.patched_modules()}
        modes = sorted({"bypass" if c in bypass else "fused" for c in patched}) or ["fused"]
        return LoadedFacts(loaded.model.info.name, loaded.model.family, loaded.scan.short_hash(),
                           pipe.family.native_size(pipe), pipe.family.defaults_for(pipe), loaded.plan.dtype,
                           loaded.plan.offload, loaded.stack.applied, " + ".join(modes), loaded.embeddings,
                           dict(loaded.set_aside), loaded.weights, sum(map(len, loaded.stored.values())),
                           storage.bytes_saved(pipe, loaded.stored, pipe.compute_dtypes),
                           loaded.stack.backup_summary(), len(loaded.matmul), loaded.matmul.unfit_summary(),
                           pipe.family.label + (" inpainting" if pipe.family.inpainting(pipe) else ""),
                           storage.codec_counts(loaded.stored), storage.resting_bytes(pipe, loaded.stored))

    def rows(self, violations) -> tuple[diagnostics.ModuleRow, ...]:
        """Diagnostics' rows, one per module. Built after the verify that ends every transition: with no
        violation every tensor is where the plan puts it, so the rows are a function of the plan, the
        patched layers and the hooks, and are reused while those stay (a generation changes none of
        them; rebuilding walked every tensor once more per image: issue 41). After a LoRA change that only
        wrote layers in place and found nothing to repair (`verify_and_repair`'s narrow verify), only the
        rows of the layers written are built again (their LoRAs and hooks changed, nothing else could) and
        the others are the last rows: a slider move no longer walks every tensor to publish."""
        loaded, written = self._loaded, self._rows_written
        self._rows_written = None
        if loaded is None:
            return ()
        plan, patched = self._parked or loaded.plan, loaded.stack.patched_modules()
        key = (plan, patched, tuple((id(module), names) for module, names in loaded.hooks.hooked()))
        last = None if violations or loaded.shown is None else loaded.shown
        if last is not None and last[0] == key:
            return last[1]
        args = (loaded.model.pipe, plan, patched, list(violations), loaded.hooks)
        packed = storage.packed_names(loaded.stored)
        with phase("placement rows"):
            if written is not None and last is not None:  # kept rows hold no violation (see `shown` below)
                fresh = {(r.component, r.module): r
                         for r in diagnostics.placement_rows(*args, modules=written, packed=packed)}
                rows = tuple(fresh.get((r.component, r.module), r) for r in last[1])
            else:
                rows = diagnostics.placement_rows(*args, packed=packed)
        loaded.shown = None if violations else (key, rows)
        return rows

    def compile_status(self) -> compiled.CompileStatus | None:
        loaded = self._loaded
        return None if loaded is None or loaded.compile is None else loaded.compile.status()

    def inspect(self, name: str, file: AdapterFile) -> MatchReport:
        if self._loaded is None:
            raise RuntimeError("no model loaded")
        return self._loaded.stack.prepare(name, file, upload=False).report

    def culprits(self, exc: BaseException) -> tuple[str, ...]:
        return () if self._loaded is None else self._loaded.stack.culprits(exc)

    # ------------------------------------------------------------------ realising a Desired
    def realise(self, want: Desired, loras: tuple[LoraSpec, ...], *, retry_set_aside: bool = False,
                set_aside_unfit: bool = False) -> tuple[dict[str, MatchReport], dict[str, str]]:
        """Make the loaded model match `want` with `loras` (the wanted list minus disabled ones)
        applied, running only the steps that differ. A (re)load applies them leniently: one that
        does not fit this model is set aside with its reason (so does `set_aside_unfit`, the UI's
        way: a LoRA that does not fit is shown set aside, never blocks the others). Otherwise LoRAs
        set aside stay aside, unless `retry_set_aside` (an explicit LoRA list): then every one must
        fit or the step fails. Returns the match report of each LoRA applied and the LoRAs set aside.

        Whatever the steps freed (a parked model, host copies moved to the GPU, LoRA backups) goes
        back to the OS afterwards: the C heap keeps freed memory for reuse until told (app/heap.py).
        A parked model is placed back first."""
        self._lora_writes = None
        try:
            was_parked = self._parked is not None
            self.unpark()
            result = self._realise_steps(want, loras, retry_set_aside, set_aside_unfit)
            if was_parked:
                self._lora_writes = None
            return result
        finally:
            heap.give_back()

    def _realise_steps(self, want: Desired, loras: tuple[LoraSpec, ...], retry_set_aside: bool,
                       set_aside_unfit: bool) -> tuple[dict[str, MatchReport], dict[str, str]]:
        if want.model is None:
            self.unload()
            return {}, {}
        dtype = placement.resolve_dtype(want.dtype, self._device)
        loaded = self._loaded
        if loaded is None or self._stale(loaded, want, dtype):
            self._load(want, dtype)
            return self._apply_fitting(loras)
        placed = loaded.plan.offload != want.offload
        if placed:
            self._set_offload(want.offload)
        if set_aside_unfit:
            return self._apply_fitting(loras)
        wanted = loras if retry_set_aside else tuple(s for s in loras if s.name not in loaded.set_aside)
        patching = wanted != loaded.stack.applied
        reports = self.apply_loras(wanted) if patching else {}
        if retry_set_aside:
            loaded.set_aside.clear()
        if not placed:
            self._lora_writes = loaded.stack.modules_of(loaded.stack.traffic.written) if patching else ()
        return reports, {}

    def _stale(self, loaded: _Loaded, want: Desired, dtype: torch.dtype) -> bool:
        """Another checkpoint, dtype or weight storage, or the same file changed on disk since."""
        if (loaded.model.info.name, loaded.plan.dtype, loaded.weights) != (want.model, dtype, want.weights):
            return True
        if loaded.model.parts != part_choices.part_files(self._settings, want.model):
            return True  # other text-encoder/VAE files chosen for it
        return loaded.identity != FileIdentity.of(loaded.model.info.path)

    def apply_loras(self, specs: tuple[LoraSpec, ...]) -> dict[str, MatchReport]:
        """Reconcile the stack with `specs`, all or nothing."""
        assert self._loaded is not None
        t0 = time.perf_counter()
        try:
            files = {s.name: self._open_lora(s.name) for s in specs}
            return self._loaded.stack.reconcile(specs, files, progress=self._patch_progress)
        finally:
            self._timers.record("patch", time.perf_counter() - t0)

    def _patch_progress(self, done: int, total: int) -> None:
        self._progress("patching LoRA layers", done, total)

    def _apply_fitting(self, specs: tuple[LoraSpec, ...]) -> tuple[dict[str, MatchReport], dict[str, str]]:
        """Apply every LoRA that fits and set the others aside with the reason: each is first
        matched against the model (no write), then the fitting ones are applied in one step."""
        loaded = self._loaded
        set_aside: dict[str, str] = {}
        applied = loaded.stack.still_fitting()  # fit already (a re-weight checks nothing again)
        for spec in specs:
            if spec.name in applied:
                continue
            try:
                loaded.stack.prepare(spec.name, self._open_lora(spec.name), upload=False)
            except LoraApplyError as exc:
                set_aside[spec.name] = str(exc)
                log.warning("LoRA %s set aside for %s: %s", spec.name, loaded.model.info.name, str(exc))
        reports = self.apply_loras(tuple(s for s in specs if s.name not in set_aside))
        loaded.set_aside = set_aside
        return reports, dict(set_aside)

    # ------------------------------------------------------------------ load / swap / unload
    def _load(self, want: Desired, dtype: torch.dtype) -> None:
        info = resolve_checkpoint(want.model, self._settings.checkpoints_dir)
        refusal = fp8_matmul.refusal(self._device) if want.weights in storage.MATMUL_MODES else None
        if refusal:
            raise ModelLoadError(refusal)
        self._progress(f"loading {info.name}", 0, 3)
        t0 = time.perf_counter()
        fresh = models.load_pipeline(info, dtype, part_choices.part_files(self._settings, info.name), self._scans)
        stored = storage.layers_to_store(fresh.pipe, family(fresh.family), want.weights)
        matmul = storage.matmul_layers(fresh.pipe, stored, want.weights, dtype)
        storage.store(fresh.pipe, stored, matmul)
        self._timers.record("load", time.perf_counter() - t0)
        self._progress(f"placing {info.name}", 1, 3)
        self._swap_in(fresh, dtype, want.offload, want.weights, stored, matmul)
        self._progress("applying LoRAs", 2, 3)

    def _swap_in(self, fresh: models.LoadedModel, dtype: torch.dtype, mode: str, weights: str,
                 stored: storage.Stored, matmul: storage.MatmulLayers) -> None:
        """Place a freshly loaded model and make it current; the old one stays usable until then.

        The old pipeline is parked on the CPU (hooks removed) so a large new model can fit on the
        GPU; if placing the new one fails, the old one is put back with its offload mode.
        """
        old = self._loaded
        plan, hooks = self._plan(fresh.pipe, dtype, mode, stored, matmul), HookRegistry()
        readers = fp8_matmul.WeightReaders(fresh.pipe)
        try:
            if old is not None and self._device.type != "cpu":
                self.park("park previous model")
            embedded = embeddings.load_all(fresh.pipe, fresh.family, self._settings.embeddings_dir,
                                           self._embedding_notes)
            strategy = self._place(fresh.pipe, plan, hooks, reason="load")
            storage.install_dequant(hooks, fresh.pipe, stored, fresh.pipe.compute_dtypes, matmul, readers)
        except BaseException:
            del fresh
            self.unpark()
            release_memory()
            raise
        if old is not None:
            self._release_hooks(old)
            old.stack.release()
        self._parked = None
        fresh.pipe.set_progress_bar_config(disable=True)
        stack = LoraStack(fresh.pipe, fresh.family, self._device, hooks=hooks, bypass=offload.bypass_components(plan),
                          gpu_backups=self._settings.lora_backups == "gpu",
                          allows_partial=lambda name: allows_partial(self._settings, name))
        readers.stack = stack
        scan = self._scans.start(fresh.info.name, models.facts_store(fresh.info), fresh.files)  # after the load
        self._loaded = _Loaded(fresh, FileIdentity.of(fresh.info.path), scan, plan, hooks, stack, embedded, strategy,
                               weights, stored, matmul)
        self._sync_compile(self._loaded)
        if old is not None:  # a first load has nothing to give back, and a full gc pass costs ~0.3 s
            del old
            release_memory()

    def model_hash(self) -> str | None:
        """The loaded model's short hash, waiting for its file to be read if it still is (the first
        image saved after a first load needs it for its infotext)."""
        return None if self._loaded is None else self._loaded.scan.short_hash(wait=True)

    def unload(self) -> None:
        """Drop the loaded model and give its memory back. With nothing loaded there is nothing to
        give back: a LoRA list set with no model realises `model=None` again, and a full gc pass
        there cost ~0.3 s per command."""
        if self._loaded is None:
            return
        self._release_hooks(self._loaded)
        self._loaded.stack.release()
        self._loaded, self._parked = None, None
        release_memory()

    # ------------------------------------------------------------------ generation
    def denoise(self, params: GenerateParams, seed: int, on_step: Callable[[int, int], None], control=None) -> list:
        """Run one generation (`control`: its `ControlPass`, or None); afterwards every component is back at its
        resting placement."""
        def txt2img(pipe):
            latents = stages.txt2img_latents(pipe, self.stage_for, params, seed, on_step, control=control)
            return [] if latents is None else decoding.decode(pipe, latents)  # None: stopped before a step
        return self.run_on_model(txt2img, f"{params.batch}x{params.width}x{params.height}")

    def stage_for(self, kind: str):
        """The loaded model's `kind` stage pipeline (built once per model, on its components)."""
        loaded = self._loaded
        return stages.stage_on(loaded.model.pipe, family(loaded.model.family), loaded.stage_pipes, kind)

    def interruptible(self, should_stop: Callable[[], bool]) -> contextlib.AbstractContextManager:
        """A stop checked before every block while entered (`stop_checks`); not on a compiled model. Large
        attention calls are sliced only when the engine computes on the CPU: on an accelerator one call is
        short, and the function mode that slices would cost Python time on every op of every step."""
        loaded = self._loaded
        if loaded is None or loaded.compile is not None:
            return contextlib.nullcontext()
        return stop_checks(loaded.hooks, loaded.model.pipe, should_stop, slice_attention=self._device.type == "cpu")

    @contextlib.contextmanager
    def stepped_loras(self, total: int) -> Iterator[StepStrengths | None]:
        """The scheduled LoRA strengths of one denoising pass of `total` steps (None: no LoRA applied has a
        schedule): the caller sets each step's before it runs (`before_step`); on leaving, however the pass
        ended (done, Interrupt, an error), the layers are back at their resting strengths, bit for bit."""
        loaded = self._loaded
        stepper = None if loaded is None else loaded.stack.stepping(total)
        try:
            yield stepper
        finally:
            if stepper is not None:
                with phase("scheduled LoRAs back to rest"):
                    stepper.close()

    def step_cached(self, threshold: float) -> contextlib.AbstractContextManager:
        """The step cache (`app/engine/step_cache.py`) on the loaded denoiser for one pass, gone after it;
        nothing at threshold 0. Refused on a compiled model: its hooks would be traced into the graphs."""
        loaded = self._loaded
        if loaded is None or threshold == 0:
            return contextlib.nullcontext()
        if loaded.compile is not None:
            raise ValueError("the step cache runs on the eager denoiser: set it to 0 with the compiled path on "
                             "(--compile), or turn that off")
        return step_cached(loaded.hooks, loaded.model.pipe, threshold)

    def run_on_model(self, work: Callable[[object], object], size: str, stage: str | None = None):
        """`work(pipeline)` (the loaded pipeline, or the `stage` pipeline on its components); afterwards
        every component is back at its resting placement, and out of GPU memory is a `MemoryError`
        that names the `size` ("2x512x512") and what to try."""
        loaded = self._loaded
        if loaded is None:
            raise RuntimeError("no model loaded: load a checkpoint first")
        refusal = loaded.scan.refusal(loaded.plan.dtype)  # known once its files are read
        if refusal:
            raise ModelLoadError(refusal)
        t0 = time.perf_counter()
        try:
            return work(loaded.model.pipe if stage is None else self.stage_for(stage))
        except torch.OutOfMemoryError as exc:
            release_memory()
            raise MemoryError(
                f"out of GPU memory generating {size}: "
                "try a smaller batch or size, or an offload mode (model, balanced, sequential)") from exc
        finally:
            self._timers.record("denoise+decode" if stage is None else stage, time.perf_counter() - t0)
            with phase("settle"):
                loaded.strategy.settle()
                loaded.plan = loaded.plan.with_resident(loaded.strategy.resident())

