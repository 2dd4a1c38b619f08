"""A1111's refiner on the engine: the base model denoises up to the switch point, a second checkpoint
finishes from those latents, every stage a verified transition.

Why it is built this way:

* the refiner is loaded through the engine like any model: a `ModelLifecycle` of its own realises
  `Desired(model=refiner, dtype, offload, weights)` of the base's, so it has a placement plan, its
  offload hooks, and `verify`/`sync` before and after each stage (`Engine._verify_and_repair` walks
  both models). It runs without LoRAs: they are trained for the base;
* memory: on a GPU the two rarely fit side by side (SDXL base and refiner: 2 × 7 GB in fp16), so the
  base is parked in host memory (`ModelLifecycle.park`: hooks off, every tensor on the CPU, verified
  against that all-CPU plan) while the refiner runs, and the refiner is parked again after it; on the
  CPU nothing needs room and nothing moves. The refiner stays loaded (parked) for the next refined
  generation; a plain txt2img or an unload lets it go;
* the switch is diffusers' ensemble-of-experts split, which SDXL's pipelines implement: the base runs
  the timesteps at or above the cutoff `round(N - switch_at·N)` of its N training timesteps
  (`denoising_end`), the refiner's img2img pipeline the rest from the carried latents without adding
  noise (`denoising_start`). A1111 switches by the step count instead (after step k while k/steps ≤
  switch_at), which can differ by a step. A switch point that leaves the refiner no step runs the base
  alone, as A1111 does at 1.0; the infotext then names no refiner.

Whether a family has a refiner stage, and which families' checkpoints may refine it, is the family's
(`Family.refiner_families`). Stages: `txt2img` (base, latents carried) → `refiner load` (park the base,
place or load the refiner) → `refiner` (denoise and decode on the refiner) → `refiner unload` (park
the refiner, place the base again; also after a failure).
"""

from __future__ import annotations

from app.engine import generate, stages, variation
from app.engine.desired import Desired
from app.engine.generate import GeneratedImage, GenerateParams
from app.engine.lifecycle import ModelLifecycle
from app.engine.snapshot import EngineState
from app.families import family


class Refining:
    """The refined txt2img of `Engine` (see the module docstring); `Workflows` supplies the stage plumbing."""

    _refiner: ModelLifecycle | None = None

    def txt2img_refined(self, params: GenerateParams, *, owner: str | None = None, desired: Desired | None = None,
                        details=None) -> list[GeneratedImage]:
        """txt2img finished by `params.refiner_checkpoint` after `params.refiner_switch_at` of the schedule;
        `owner` and `desired` as `Engine.generate`'s, `details` its detail passes (the refiner takes the base
        model's dtype, offload and storage from the `Desired` the job reconciled to)."""
        family_name = self._family_for(desired)
        if family_name is not None and not family(family_name).refiner_families:
            raise ValueError(f"{family(family_name).label} models have no refiner stage; clear the refiner checkpoint")
        named: list[tuple[str, object]] = []  # "Refiner" and "Refiner switch at", once the refiner has run
        detail = (f"{params.steps} steps, refiner {params.refiner_checkpoint} from {params.refiner_switch_at:g} "
                  f"{params.width}x{params.height} x{params.batch}x{params.n_iter}")
        return self._workflow("txt2img_refiner", detail, params, owner, named,
                              lambda first, phase, job, passes, run: self._refined_run(run, first, phase, job,
                                                                                      passes, named), desired, details)

    def _refiner_lifecycle(self) -> ModelLifecycle:
        if self._refiner is None:
            self._refiner = ModelLifecycle(self.settings, self.device, self._timers, self._open_lora,
                                           self._set_progress, self._scans)
        return self._refiner

    def _release_refiner(self) -> None:
        """Let the held refiner go (its memory back to the OS)."""
        if self._refiner is not None:
            self._refiner.unload()

    def _set_strict_forwards(self, on: bool) -> None:
        """The strict-forward check on or off on the model and on a held refiner (a later one reads Settings)."""
        self._lifecycle.set_strict_forwards(on)
        if self._refiner is not None:
            self._refiner.set_strict_forwards(on)

    def _verify_refiner(self, when: str) -> tuple[list, int]:
        return ([], 0) if self._refiner is None else self._refiner.verify_and_repair(f"refiner, {when}")

    def _refined_run(self, params: GenerateParams, first: int, phase: str, job, passes, named: list):
        """One run: base pass, then the refiner's stages (the refiner unloaded even when its pass fails).
        A base pass stopped by Interrupt or Skip is decoded as it is, with no refiner."""
        base_steps, refiner_steps = _split(self._lifecycle.pipeline, params)
        carry, kept = self._lifecycle.carry, {}
        cut = {"denoising_end": params.refiner_switch_at} if refiner_steps else {}

        def base_pass():
            kept["params"] = stripped = self._with_loras(params, passes)
            latents, stopped = self._denoise_run(base_steps, job, f"base pass, {phase}", lambda on_step: (
                self._lifecycle.run_on_model(lambda pipe: stages.txt2img_latents(
                    pipe, self._lifecycle.stage_for, stripped, first, on_step, base_steps, **cut), _size(params))))
            carry.clear()  # no step completed: nothing is carried, nothing decoded
            if latents is not None:
                carry.put(self._lifecycle.plan, latents=latents)
            return stopped

        stopped = self._stage("txt2img", f"base pass {base_steps} of {params.steps} steps, seed {first}", base_pass)
        if stopped is not None or not refiner_steps:  # stopped early, or no step left for the refiner
            return (self._decode_carried(params, job) if "latents" in carry else []), stopped
        self._stage("refiner load", params.refiner_checkpoint, lambda: self._refiner_in(params, named))
        try:
            return self._stage("refiner", f"{refiner_steps} steps from {params.refiner_switch_at:g}",
                               lambda: self._refiner_pass(kept["params"], first, base_steps, refiner_steps, job,
                                                          phase))
        finally:
            self._run_stage("refiner unload", params.refiner_checkpoint, EngineState.MOVING, self._refiner_out)

    def _refiner_in(self, params: GenerateParams, named: list) -> None:
        """Park the base where room is needed, then place (or load) the refiner by the base's dtype, offload
        mode and weight storage; a checkpoint the base's family does not take as a refiner is refused."""
        refiner, base = self._refiner_lifecycle(), family(self._lifecycle.facts().family)
        if self._needs_room():
            self._lifecycle.park("park the base for the refiner")
        try:
            want = Desired(model=params.refiner_checkpoint, dtype=self._desired.dtype, offload=self._desired.offload,
                           weights=self._desired.weights)
            refiner.realise(want, ())
            facts = refiner.facts()
            if facts.family not in base.refiner_families:
                refiner.unload()
                takes = " or ".join(family(name).label for name in base.refiner_families)
                raise ValueError(f"{params.refiner_checkpoint} is a {family(facts.family).label} checkpoint; "
                                 f"{base.label} takes {takes} checkpoints as refiners")
        except BaseException:
            self._refiner_out()
            raise
        # the hash of a refiner loaded just now is still being read: its infotext waits for it, as the base's does
        named[:] = [("Refiner", f"{facts.model} [{refiner.model_hash()}]"),
                    ("Refiner switch at", f"{params.refiner_switch_at:g}")]

    def _refiner_pass(self, params: GenerateParams, first: int, base_steps: int, total: int, job, phase: str):
        """The refiner's img2img pipeline from the carried latents, no noise added (`denoising_start`), then
        its own VAE decodes. Its noise comes from the seed alone: a variation shaped the base's."""
        refiner, latents = self._refiner, self._lifecycle.carry.get("latents")
        plain = variation.without(params)

        def run(on_step):
            return refiner.run_on_model(lambda pipe: stages.denoise_stage(
                pipe, plain, first, on_step, total, 1.0, latents, denoising_start=params.refiner_switch_at,
                steps_before=base_steps),
                _size(params), stage="img2img")

        refined, stopped = self._denoise_run(total, job, f"refiner, {phase}", run, refiner)
        if refined is None:  # stopped before the refiner's first step completed
            return [], stopped
        return self._decode(refiner, refined, job, _size(params)), stopped

    def _refiner_out(self) -> None:
        """Park the refiner where room is needed and place the base by its own plan again."""
        if self._refiner is not None and self._needs_room():
            self._refiner.park("park the refiner")
        self._lifecycle.unpark()

    def _needs_room(self) -> bool:
        """Whether one model must leave the device for the other: on a GPU (memory of its own); on the CPU
        both already rest in the same memory."""
        return self.device.type != "cpu"


def _split(pipe, params: GenerateParams) -> tuple[int, int]:
    """(base steps, refiner steps) by diffusers' `denoising_end` rule: the base runs the timesteps at or
    above the cutoff; a base without a step is refused with what to change."""
    scheduler = generate.scheduler_for(pipe, params.sampler)
    scheduler.set_timesteps(params.steps)
    train = scheduler.config.num_train_timesteps
    cutoff = int(round(train - params.refiner_switch_at * train))
    base = int((scheduler.timesteps >= cutoff).sum())
    if base == 0:
        raise ValueError(f"refiner switch at {params.refiner_switch_at:g} leaves the base model no step of "
                         f"{params.steps}; raise the switch point or the steps")
    return base, len(scheduler.timesteps) - base


def _size(params: GenerateParams) -> str:
    return f"{params.batch}x{params.width}x{params.height}"


def refined(params: GenerateParams) -> bool:
    """Does this txt2img ask for a refiner that can run (a checkpoint, and a switch point before the end)?"""
    return bool(params.refiner_checkpoint) and params.refiner_switch_at < 1

