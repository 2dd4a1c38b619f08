"""One generation on the engine: the job Interrupt and Skip reach, the batch-count loop, the
denoising runs with their live preview, and runtime errors counted against the LoRAs.

`Generating` is a part of `Engine` (its base class), as `Workflows` is, so the state machine in
`worker.py` stays about queueing and transitions. A generation becomes the current `Job` when it
leaves the queue (so an Interrupt reaches it from then on); a generation still waiting in the
queue is taken off it by `cancel_queued`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from app.adapters.prompt import merge_prompt_loras, without_missing_loras
from app.engine import decoding, generate, seamless, timeline, variation
from app.engine.generate import GeneratedImage, GenerateParams, RunContext
from app.engine.host_read import HostRead
from app.engine.interrupt import StepInterrupted
from app.engine.lora_counters import capped
from app.engine.queue import Command
from app.engine.snapshot import EngineState
from app.families import family
from app.infotext import LoraUse
from app.preview import pictures, preview_pixels

log = logging.getLogger(__name__)

# The commands that generate: each becomes the current `Job` when it leaves the queue, for all of
# its stages, so Interrupt and Skip reach every denoising pass of it (img2img, inpaint, hires).
GENERATIONS = frozenset({"generate", "txt2img_hires", "txt2img_refiner", "txt2img_detail", "img2img", "inpaint",
                         "edit", "detail"})
# How long the decode of what a stopped pass reached may run after the Interrupt or Skip: the images of a
# streamed batch decoded by then are kept, the rest dropped. Under the README's 2.5 s, so the engine is READY
# within 5 s at any size (the stop landing and the PNGs saved included); a 512² batch on a CPU decodes well
# within it, a 2048² image on two CPU cores does not (issue 43 finding 4: its decode alone took minutes).
STOPPED_DECODE_SECONDS = 2.5


@dataclass
class Job:
    """The generation in progress: who started it and whether an Interrupt/Skip asked it to stop."""

    owner: str | None
    stop: str | None = None  # "interrupt" (keep what is there) | "drop" | "skip" (this run only)
    asked: float = 0.0  # `time.monotonic()` when the stop was asked
    step_cache: float = 0.0  # the request's step cache threshold, for each of its denoising passes (0: off)

    def ask(self, stop: str) -> None:
        self.stop, self.asked = stop, time.monotonic()

    def decode_should_stop(self) -> bool:
        """Whether a decode running now must stop: at once for a drop; `STOPPED_DECODE_SECONDS` after an
        Interrupt or Skip (the stop then lands before the VAE's next block or attention slice)."""
        if self.stop is None:
            return False
        return self.stop == "drop" or time.monotonic() - self.asked > STOPPED_DECODE_SECONDS

    @property
    def interrupted(self) -> bool:
        """Whether an Interrupt ended it (a Skip ends one run only): its history row says so."""
        return self.stop in ("interrupt", "drop")


class GenerationCancelled(RuntimeError):
    """A queued generation was cancelled by its owner before it started; nothing ran."""


class Generating:
    """Single generations of `Engine` (see the module docstring)."""

    def cancel_queued(self, owner: str) -> int:
        """Take `owner`'s generations that still wait in the queue off it (their callers get
        `GenerationCancelled`); a closed tab or client leaves no work behind. Returns how many."""
        mine = self._queue.cancel(owner, GENERATIONS)
        for command in mine:
            command.future.set_exception(GenerationCancelled(f"generation cancelled by {owner} before it started"))
        return len(mine)

    def interrupt(self, *, keep_partial: bool = True, owner: str | None = None) -> bool:
        """Stop the running generation between two steps; the engine is READY within a step.
        With `keep_partial` the images reached so far are decoded and returned (and saved), as
        A1111 does; otherwise nothing is. `owner` (a UI session or API client) stops only a job it
        started: a closed tab cancels its own job, never another user's. Returns whether a
        generation was running for that owner."""
        job = self._job
        if job is None or (owner is not None and job.owner != owner):
            return False
        job.ask("interrupt" if keep_partial else "drop")
        return True

    def runs_for(self, owner: str) -> bool:
        """Whether a generation of `owner` is running now (the page keeps its stop buttons live by it)."""
        job = self._job
        return job is not None and job.owner == owner

    def skip(self, *, owner: str | None = None) -> bool:
        """End the current run of a batch count early (its images decoded as they are) and go on
        with the next one. Returns whether a generation was running for that owner."""
        job = self._job
        if job is None or (owner is not None and job.owner != owner):
            return False
        job.ask("skip")
        return True

    def _taken(self, command: Command) -> None:
        """Interrupt can reach a generation from the moment it leaves the queue (`cancel_queued` before)."""
        self._job = Job(command.owner) if command.name in GENERATIONS else None

    def _reconciled(self, command: Command, job: Job | None) -> bool:
        """Make the model match the `Desired` a job carries, as a `reconcile` transition of its own (the
        UI's way: a LoRA that does not fit is set aside; a job naming no model runs on the one held). False
        when that failed: the job's caller gets the error and the job does not run."""
        want = command.desired if command.desired.model else command.desired.replace(model=self._desired.model)
        if not want.same_as(self._desired):
            state = EngineState.LOADING if want.model_key() != self._desired.model_key() else EngineState.PATCHING

            def adopt() -> None:
                self._realise(want, want.loras, set_aside_unfit=True)
                self._upscaler.follow(want.dtype, want.offload)
                self._face_restorer.follow(want.dtype, want.offload)
                self._desired, self._held_for = want, command.owner
            step = Command("reconcile", capped(f"for {command.owner or 'a caller'}: {want.describe()}"), state, adopt,
                           Future())
            self._run_transition(step)
            if step.future.exception() is not None:
                command.future.set_exception(step.future.exception())
                return False
        self._held_for, self._job = command.owner, job
        return True

    def _do_generate(self, params: GenerateParams) -> list[GeneratedImage]:
        """Prompt tags apply to this generation only (A1111): the LoRAs are patched to the desired
        list plus the tags for the run and back to the desired list afterwards."""
        if self._lifecycle.pipeline is None:
            raise RuntimeError("no model loaded: load a checkpoint first")
        self._release_refiner()  # a txt2img without one: the memory a held refiner takes goes back
        params = self._found_loras_only(params)
        saved_prompt = params.prompt  # tags stay in the saved prompt, as A1111 writes it
        params, wanted = merge_prompt_loras(params, self._desired.loras)
        self.library.validate_specs(wanted)
        tagged = wanted != self._desired.loras
        job = self._job
        try:
            if tagged:
                self._state = EngineState.PATCHING
                with timeline.phase("prompt LoRAs"):
                    self._realise(self._desired, wanted)
                with timeline.phase("verify before denoising"):
                    self._verify_and_repair("before denoising")
                self._state = EngineState.GENERATING
            titles = self._control_ready(params.controlnet_units)
            return self._generate_images(params, saved_prompt, job,
                                         extra=self._control_infotext(params.controlnet_units, titles))
        finally:
            if tagged:
                with timeline.phase("prompt LoRAs"):
                    self._realise(self._desired, self._desired.loras)

    def _found_loras_only(self, params: GenerateParams) -> GenerateParams:
        """`params` without prompt tags naming a LoRA the library lacks, each warned of (`without_missing_loras`)."""
        params, missing = without_missing_loras(params, self.library.found)
        for name in missing:
            log.warning("LoRA %r not found in the LoRA folder: its prompt tag is left out, the image drawn without it",
                        name)
        return params

    def _generate_images(self, params: GenerateParams, saved_prompt: str, job: Job, batch_run=None,
                         extra: tuple[tuple[str, object], ...] = ()) -> list[GeneratedImage]:
        """`params.n_iter` runs of `batch_run(first_seed, phase, run_params)` -> (images, stopped_at) (default:
        one txt2img denoising), each image saved with its infotext (`extra`: the workflow's own pairs).
        `run_params` are the run's own: its variation seeds go on over the batch count, while every image
        keeps the seed when one is mixed in (A1111's rule, `variation`)."""
        facts = self._lifecycle.facts()
        seed = generate.resolve_seed(params.seed)
        params = variation.resolved(params)
        step = 0 if variation.varies(params) else 1
        applied = tuple(LoraUse(s.name, s.unet_strength, self.library.short_hash(s.name), s.te_strength,
                                s.schedule_text) for s in facts.loras)
        job.step_cache = params.step_cache
        batch_run = batch_run or (lambda first, phase, run_params: self._denoise_run(
            params.steps, job, phase, lambda on_step: self._lifecycle.denoise(
                run_params, first, on_step, self._control_pass(run_params, "only"))))
        with seamless.tiled(self._lifecycle.pipeline, family(facts.family).conv_components, params.tiling):
            return self._runs(params, saved_prompt, job, batch_run, extra, seed, step, facts, applied)

    def _runs(self, params: GenerateParams, saved_prompt: str, job: Job, batch_run, extra, seed: int, step: int,
              facts, applied) -> list[GeneratedImage]:
        """`_generate_images`' runs, each image saved with its infotext."""
        ctx = None  # made when the first image is saved: after a first load its file may still be being hashed
        out = []
        for run in range(params.n_iter):
            first, run_params = seed + run * params.batch * step, variation.for_run(params, run)
            saved = dataclasses.replace(run_params, prompt=saved_prompt)
            # a run with detail passes also says, per image, what they noted and the region masks they drew
            images, stopped_at, *marks = batch_run(first, f"denoising, run {run + 1}/{params.n_iter}", run_params)
            if job.stop == "drop":
                return []
            for i, image in enumerate(images or ()):  # none when a stop came before the first step ended
                if ctx is None:
                    with timeline.phase("model hash"):
                        ctx = RunContext(facts.model, self._lifecycle.model_hash(), applied, facts.family)
                image_seed = first + i * step
                restored = ()
                if params.restore_faces:  # A1111 restores before saving, after every pass
                    with timeline.phase("face restoration"):
                        image, kind = self._restore_faces(image)
                    restored = (("Face restoration", kind),)
                # A1111 keeps the asked `Steps` of an interrupted image (Send-to runs the whole job again); the
                # step it stopped at is said beside them, or the PNG claims 150 steps after 6.
                stopped = (("Stopped at step", stopped_at),) if stopped_at is not None else ()
                with timeline.phase("infotext"):
                    text = generate.infotext(saved, image_seed, ctx,
                                             (*restored, *variation.infotext_pairs(run_params, i), *extra, *stopped))
                with timeline.phase("png save"):
                    path = generate.save_png(image, text, self.settings.outputs_dir, image_seed,
                                             compress_level=self.settings.png_compress_level)
                notes, masks = marks[0][i] if marks else ((), ())
                out.append(GeneratedImage(image, image_seed, text, path, stopped_at,
                                          variation.subseed_of(run_params, i), notes, masks))
            if job.stop == "interrupt":
                break
            job.stop = None  # a Skip ends this run only
        return out

    def _denoise_run(self, total: int, job: Job, phase: str, run, lifecycle=None) -> tuple[Any, int | None]:
        """One denoising pass of `total` steps, `run(on_step)`; returns its result and the step it was
        stopped at (None: all ran). Every `preview_every` steps the progress carries a cheap preview
        of the latents. A stop lands between two steps (`on_step`) or inside one, before the next
        block of the model (`interrupt.stop_checks`); the latents reached are then decoded as they are
        within `STOPPED_DECODE_SECONDS` (`Job.decode_should_stop`), unless the stop drops them (the result
        is then None). LoRAs with a step schedule get each step's strength before it (`stepped_loras`: the
        schedule runs over this pass's own `total` steps) and are back at rest after the pass; `lifecycle`:
        the model the pass runs on when not the loaded one (the refiner's)."""
        reached, ending, family_name = 0, False, self._lifecycle.facts().family
        lifecycle = lifecycle or self._lifecycle
        stepper = None
        previews = family(family_name).latent_format.preview_rgb is not None  # no factors: no preview
        taken: tuple[int, HostRead] | None = None  # the last preview's step and pixels, on their way to the host

        def on_step(step: int, total: int, latents) -> bool:
            """A preview taken at step k is shown at step k+1 (labelled k): read then, it waits for step
            k's work alone (`HostRead`); read at once, it drained the GPU's queue."""
            nonlocal reached, ending, taken
            reached = step
            every = self.settings.preview_every
            wanted = previews and every and step % every == 0 and step < total
            with timeline.phase("preview"):
                shown, of = (None, None) if taken is None else (tuple(pictures(taken[1].value())), taken[0])
                taken = (step, HostRead(preview_pixels(latents, family_name))) if wanted else None
            self._set_progress(phase, step, total, shown, of)
            ending = job.stop is not None
            if stepper is not None and not ending and step < total:
                with timeline.phase("scheduled LoRAs"):
                    stepper.before_step(step)
            return ending

        def stop_inside() -> bool:
            """True once for a stop inside the denoising; a decode of what was reached runs on within its time."""
            nonlocal ending
            if job.stop is None:
                return False
            if ending or reached == total:
                return job.decode_should_stop()
            ending = True
            return True

        self._set_progress(phase, 0, total)
        with self._lifecycle.step_cached(job.step_cache):  # a refusal (a distilled model) is no LoRA's fault
            try:
                with self._lifecycle.interruptible(stop_inside), lifecycle.stepped_loras(total) as stepper:
                    result = run(on_step)
            except StepInterrupted:  # dropped mid-decode: nothing to keep
                result = None
            except generate.NonFiniteLatentsError as exc:
                self._attribute_non_finite(exc)
                raise
            except MemoryError:
                raise  # out of memory is the run's size, not a LoRA's fault: counted against none
            except Exception as exc:
                self._attribute_runtime_error(exc)
                raise
        return result, None if reached == total else reached

    @staticmethod
    def _decode(lifecycle, latents, job: Job, size: str) -> list:
        """`latents` decoded on `lifecycle`'s model, which a stop reaches (`Job.decode_should_stop`): a
        stopped streamed decode keeps the images finished before it, a stopped whole decode none."""
        try:
            with lifecycle.interruptible(job.decode_should_stop):
                return lifecycle.run_on_model(lambda pipe: decoding.decode(pipe, latents), size)
        except StepInterrupted:
            return []

    def _attribute_non_finite(self, exc: generate.NonFiniteLatentsError) -> None:
        """NaN/Inf latents name no layer: they count against every LoRA applied to this run (the
        usual cause), and the message says which step and which LoRAs; with none applied the
        checkpoint or the dtype is to blame, and the message says so."""
        applied = tuple(s.name for s in self._lifecycle.facts().loras)
        if applied:
            exc.args = (f"{exc.args[0]}; LoRAs applied: {', '.join(applied)}",)
            self._attribute(applied, exc)
        else:
            exc.args = (f"{exc.args[0]}; no LoRA applied, so the checkpoint or the dtype is the cause "
                        "(try bf16 or fp32)",)

    def _attribute_runtime_error(self, exc: Exception) -> None:
        """Count an error raised inside a patched layer against the LoRAs patched into it; past
        `max_lora_errors` (outside strict mode) the LoRA is taken off the model and marked
        disabled, so one bad adapter cannot break every generation; an explicit set_loras or a
        model load re-enables it."""
        self._attribute(self._lifecycle.culprits(exc), exc)

    def _attribute(self, names: tuple[str, ...], exc: Exception) -> None:
        disabled = self._counters.runtime_error(names, exc, strict=self.settings.strict)
        if disabled:
            self._realise(self._desired, self._desired.loras)
