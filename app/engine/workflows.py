"""img2img, inpaint and hires fix on the engine: every stage a transition of its own.

`Workflows` is a part of `Engine` (its base class), kept here so the state machine in
`worker.py` stays about queueing and transitions. A workflow is one queued command, so nothing
else runs between its stages; on the worker it runs each stage through `Engine._run_stage`: the
placement of every model tensor *and* of the tensors the stage hands on (`stages.Carry`) is
verified and repaired before and after the stage, the stage gets its history row, and a failure
rolls back like any transition's and ends the workflow. The stages:

* txt2img with hires fix: `txt2img` (first pass, latents kept) → `hires upscale` (latent
  interpolation, or decode → resample → encode) → `hires fix` (img2img pass, decoded);
* img2img: `img2img encode` (init images resized and encoded) → `img2img`;
* inpaint: `inpaint encode` (masked content applied, latent mask, masked-image latents for a
  9-channel UNet) → `inpaint` (decoded and pasted over the original through the blurred mask);
* reference editing (families that take `reference_images`): `edit` (txt2img with the
  pictures handed to the pipeline, which encodes them as its model was trained to).

Prompt `<lora:…>` tags apply to their pass only, as in txt2img; the hires pass takes its own
prompt's tags, so it can run the LoRAs at other strengths. After the workflow the desired LoRAs
are restored by a `restore_loras` transition (visible in the history too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from PIL import Image

from app.adapters.prompt import merge_prompt_loras
from app.adapters.specs import LoraSpec
from app.engine import generate, image_ops, job_memory, models, stages, variation
from app.engine.controlnet_slot import CONTROL_STAGE
from app.engine.desired import Desired
from app.engine.detailing import DetailParams
from app.engine.generate import GeneratedImage, GenerateParams
from app.engine.snapshot import EngineState
from app.engine.stage_params import HiresParams, InitImages
from app.families import family
from app.prompts.notes import prompt_chunks


@dataclasses.dataclass
class _Passes:
    """The LoRA list the model carries now (one realise per change, not per stage)."""

    current: tuple[LoraSpec, ...]


class Workflows:
    """The multi-stage workflows of `Engine` (see the module docstring)."""

    def txt2img_hires(self, params: GenerateParams, hires: HiresParams, *, owner: str | None = None,
                      desired: Desired | None = None, details: DetailParams | None = None) -> list[GeneratedImage]:
        """A1111's txt2img with "Hires. fix": `params` is the first pass, `hires` the upscale and
        second pass, then the `details` passes if any. Sizes and steps are checked before anything is queued."""
        family_name = self._family_for(desired)
        if not hires.upscale_only:  # at strength 0 the upscale is the image: no second pass, no img2img stage
            self._require_stage(family_name, "img2img", "hires fix")
        self.check_upscaler(hires.upscaler, hires=True)
        hires.second_pass(params, _size_multiple(family_name))
        self._admit("txt2img with hires fix", params, desired, hires)
        self._check_units(params.controlnet_units, family_name, "img2img")  # the hires pass's pipeline
        detail = (f"{params.steps}+{hires.steps or params.steps} steps {params.width}x{params.height} "
                  f"{hires.upscaler} x{hires.scale:g} x{params.batch}x{params.n_iter}")
        return self._workflow("txt2img_hires", detail, params, owner, hires.infotext_pairs(params),
                              lambda first, phase, job, passes, run: self._hires_run(run, hires, first, phase, job,
                                                                                     passes), desired, details)

    def img2img(self, params: GenerateParams, init_images: Sequence[Image.Image], *, denoising_strength: float = 0.75,
                resize_mode: str | int = "just resize", mask: Image.Image | None = None, mask_blur: int = 4,
                inpainting_fill: str | int = "original", inpainting_mask_invert: bool = False,
                owner: str | None = None, desired: Desired | None = None,
                details: DetailParams | None = None) -> list[GeneratedImage]:
        """A1111's `/sdapi/v1/img2img`: start from `init_images` (batch item i from image i mod their
        number) resized to `params`' size by `resize_mode`, denoised by `denoising_strength`; with a
        `mask` it is inpaint (white repaints; `inpainting_fill` is what the masked area starts from).
        Modes and fills take A1111's names or its indices. An inpainting checkpoint (9-channel UNet)
        runs img2img as inpaint with the whole picture masked, as A1111 does. `owner` and `desired` as
        `Engine.generate`'s; `details`: the detail passes after it (with `skip_img2img`, instead of it)."""
        if details is not None and details.skip_img2img:
            return self.detail(params, init_images, details, owner=owner, desired=desired)
        source = InitImages(tuple(init_images), denoising_strength, resize_mode, mask, mask_blur, inpainting_fill,
                            inpainting_mask_invert)
        source.steps_run(params)
        self._require_stage(self._family_for(desired), source.workflow, source.workflow)
        self._admit(source.workflow, params, desired, encodes=True)
        self._check_units(params.controlnet_units, self._family_for(desired), source.workflow)
        if variation.of(params) is not None or params.refiner_checkpoint:
            raise ValueError(f"variation seeds, \"resize seed from\" and the refiner apply to txt2img; set the "
                             f"variation strength and the resize sizes to 0 and clear the refiner for "
                             f"{source.workflow}")
        detail = (f"{params.steps} steps at {source.denoising_strength:g} {params.width}x{params.height} "
                  f"{source.resize_mode} x{params.batch}x{params.n_iter}")
        return self._workflow(source.workflow, detail, params, owner, source.infotext_pairs(),
                              lambda first, phase, job, passes, run: self._init_image_run(run, source, first, phase,
                                                                                          job, passes), desired,
                              details)

    def txt2img_detailed(self, params: GenerateParams, details: DetailParams, *, owner: str | None = None,
                         desired: Desired | None = None) -> list[GeneratedImage]:
        """txt2img followed by the `details` passes: the txt2img pass a stage of its own, as in the hires fix."""
        detail = f"{params.steps} steps {params.width}x{params.height} x{params.batch}x{params.n_iter}"
        return self._workflow("txt2img_detail", detail, params, owner, (),
                              lambda first, phase, job, passes, run: self._txt2img_run(run, first, phase, job, passes),
                              desired, details)

    def inpaint(self, params: GenerateParams, init_image: Image.Image, mask: Image.Image, **options: Any
                ) -> list[GeneratedImage]:
        """img2img with a mask (required here); `options` as `img2img`'s."""
        if mask is None:
            raise ValueError("inpaint needs a mask: paint the area to repaint, or upload a mask")
        return self.img2img(params, [init_image], mask=mask, **options)

    def edit(self, params: GenerateParams, references: Sequence[Image.Image], *, owner: str | None = None,
             desired: Desired | None = None) -> list[GeneratedImage]:
        """Reference editing, for a family that takes `reference_images`: txt2img whose model also
        reads `references` (1 to the family's `reference_images` pictures, each encoded by the pipeline's
        rule at up to 1024², their tokens beside the image's), so the prompt edits or combines them.
        The infotext names how many it read. `owner` and `desired` as `Engine.generate`'s."""
        family_name = self._family_for(desired)
        if not references:
            raise ValueError("reference editing takes at least one reference image")
        if params.controlnet_units:
            raise ValueError("reference editing takes no ControlNet units")
        if family_name is not None:
            fam = family(family_name)
            if not fam.reference_images:
                raise ValueError(f"{fam.label} models take no reference images: use img2img or inpaint")
            if len(references) > fam.reference_images:
                raise ValueError(f"{fam.label} takes 1 to {fam.reference_images} reference images, "
                                 f"got {len(references)}")
        self._admit("reference editing", params, desired)
        pictures = tuple(image.convert("RGB") for image in references)
        detail = f"{params.steps} steps {params.width}x{params.height} {len(pictures)} reference(s) x{params.batch}"
        return self._workflow("edit", detail, params, owner, (("Reference images", len(pictures)),),
                              lambda first, phase, job, passes, run: self._edit_run(run, pictures, first, phase, job,
                                                                                     passes), desired)

    @property
    def stage_pipelines(self) -> dict[str, object]:
        """The stage pipelines on the loaded model, for tests (their weights must be the model's own)."""
        return self._lifecycle.stage_pipelines

    # ------------------------------------------------------------------ the command (worker side)
    def _family_for(self, desired: Desired | None) -> str | None:
        """The family a job is checked for before it is queued: that of the model its `desired` names (read
        from the checkpoint's header when another one is loaded: the job's reconcile loads it), else the
        loaded one's."""
        snap = self.snapshot()
        if desired is None or not desired.model or desired.model == snap.model:
            return snap.family
        return models.planned_family(self.settings.checkpoints_dir, desired.model)

    def _admit(self, kind: str, params: GenerateParams, desired: Desired | None, hires: HiresParams | None = None,
               encodes: bool = False) -> None:
        """Refuse, before queueing, a job of `kind` whose prompt has more chunks than the cap or whose memory
        estimate is over the budget (app/engine/job_memory.py); the model is the one the job will run on.
        `encodes`: the job VAE-encodes its batch first (img2img, inpaint)."""
        family_name = self._family_for(desired)
        if family_name is None:
            return  # no model to run on: the job is refused as such
        fam = family(family_name)
        second = None if hires is None else hires.second_pass(params, fam.size_multiple)
        chunks = max(prompt_chunks(fam, run.prompt, run.negative_prompt, run.steps)
                     for run in (params, second) if run is not None)
        job_memory.check_chunks(chunks)  # per pass: each pass encodes its own prompts
        loaded = desired is None or not desired.model or desired.model == self.snapshot().model
        shape = job_memory.model_shape(fam, self._lifecycle.pipeline if loaded else None)
        what = f"{kind} of {params.batch} x {params.width}x{params.height}"
        cost = (0, 0)
        if second is not None:
            what += f" to {second.width}x{second.height}"
            if hires.model:
                factor = max(second.width / params.width, second.height / params.height)
                cost = job_memory.upscale((params.width, params.height), factor, self.upscaler_scale(hires.upscaler),
                                          self.tile_side)
        job_memory.admit(self.memory_budget, job_memory.generation(
            shape, params, chunks, what, encodes=encodes, second=second, upscale_cost=cost))

    @staticmethod
    def _require_stage(family_name: str | None, kind: str, what: str) -> None:
        """Refuse, before queueing, a workflow the family `family_name` has no stage pipeline for (Flux)."""
        if family_name is not None and kind not in family(family_name).stage_pipelines:
            raise ValueError(f"{what} is not available for {family(family_name).label} models yet")

    def _workflow(self, name: str, detail: str, params: GenerateParams, owner: str | None,
                  extra: tuple[tuple[str, object], ...], batch_run, desired: Desired | None,
                  details: DetailParams | None = None) -> list[GeneratedImage]:
        """Queue the workflow as one command; on the worker its stages run as transitions. The first
        pass's prompt tags are applied first (`apply_loras`), so the infotext names their hashes. With
        `details` each run's images then go through the detail passes (app/engine/detailing.py)."""
        state = EngineState
        if details is not None:
            self.check_detail(details, desired)
            extra, inner = (*extra, *details.infotext), batch_run
            detail += f", detailer {details.describe()}"

            def batch_run(first, phase, job, passes, run):
                return self._then_detail(inner(first, phase, job, passes, run), details, run, first, phase, job,
                                         passes)

        def body() -> list[GeneratedImage]:
            nonlocal params
            if self._lifecycle.pipeline is None:
                self._run_stage(name, detail, state.GENERATING, _no_model)
            params = self._found_loras_only(params)
            passes = _Passes(self._desired.loras)
            stripped, wanted = merge_prompt_loras(params, self._desired.loras)
            if wanted != passes.current:
                self._run_stage("apply_loras", f"prompt tags for {name}", state.PATCHING,
                                lambda: self._with_loras(params, passes))
            job = self._job  # set when the command left the queue (`Engine._serve`)
            titles = self._control_ready(params.controlnet_units)
            control = self._control_infotext(params.controlnet_units, titles)
            pairs = (*extra, *control) if control else extra  # the refiner fills its list in as it runs
            try:
                # A run's own parameters (its variation seeds) with the prompt's tags, which each pass reads.
                def run_batch(first, phase, run):
                    return batch_run(first, phase, job, passes, dataclasses.replace(run, prompt=params.prompt))
                return self._generate_images(stripped, params.prompt, job, run_batch, pairs)
            finally:
                self._job = None
                self._lifecycle.carry.clear()
                if passes.current != self._desired.loras:
                    self._run_stage("restore_loras", f"after {name}", state.PATCHING,
                                    lambda: self._realise(self._desired, self._desired.loras))
        return self.submit(name, detail, state.GENERATING, body, record=False, owner=owner, desired=desired).result()

    def _with_loras(self, prompt_params: GenerateParams, passes: _Passes) -> GenerateParams:
        """Patch the model to the desired LoRAs plus `prompt_params`' tags (if that differs from what
        it carries); returns the params with the tags stripped from the prompt."""
        stripped, wanted = merge_prompt_loras(prompt_params, self._desired.loras)
        if wanted != passes.current:
            self.library.validate_specs(wanted)
            previous, self._state = self._state, EngineState.PATCHING
            self._realise(self._desired, wanted)
            passes.current = wanted
            self._verify_and_repair("before denoising")
            self._state = previous
        return stripped

    def _stage(self, name: str, detail: str, body):
        return self._run_stage(name, detail, EngineState.GENERATING, body)

    # ------------------------------------------------------------------ reference editing
    def _edit_run(self, params, pictures: tuple[Image.Image, ...], first: int, phase: str, job, passes: _Passes):
        """One run of reference editing: one stage, the txt2img pipeline given the pictures."""
        def edit():
            stripped = self._with_loras(params, passes)
            return self._denoise_run(params.steps, job, f"edit, {phase}", lambda on_step: self._lifecycle.run_on_model(
                lambda pipe: generate.run(pipe, stripped, first, on_step, image=list(pictures)), _size(params)))

        return self._stage("edit", f"{len(pictures)} reference image(s), seed {first}", edit)

    def _txt2img_run(self, params, first: int, phase: str, job, passes: _Passes):
        """One txt2img run as a stage (its prompt's tags applied for it)."""
        def txt2img():
            stripped = self._with_loras(params, passes)
            return self._denoise_run(params.steps, job, phase, lambda on_step: self._lifecycle.denoise(
                stripped, first, on_step))

        return self._stage("txt2img", f"{params.width}x{params.height}, seed {first}", txt2img)

    # ------------------------------------------------------------------ hires fix
    def _hires_run(self, params, hires: HiresParams, first: int, phase: str, job, passes: _Passes):
        """One run of the hires fix: three stages. A first pass stopped by Interrupt or Skip is
        decoded and returned as it is (no second pass), as A1111 does."""
        carry, plan = self._lifecycle.carry, lambda: self._lifecycle.plan
        second = hires.second_pass(params, _size_multiple(self.snapshot().family))

        def first_pass():
            stripped = self._with_loras(params, passes)
            latents, stopped = self._denoise_run(params.steps, job, f"first pass, {phase}", lambda on_step: (
                self._lifecycle.run_on_model(lambda pipe: stages.txt2img_latents(
                    pipe, self._lifecycle.stage_for, stripped, first, on_step,
                    control=self._control_pass(stripped, "first")), _size(params))))
            carry.clear()  # no step completed: nothing is carried, nothing decoded
            if latents is not None:
                carry.put(plan(), latents=latents)
            return stopped

        stopped = self._stage("txt2img", f"first pass {params.width}x{params.height}, seed {first}", first_pass)
        if stopped is not None:
            return (self._decode_carried(params, job) if "latents" in carry else []), stopped

        def upscale():
            size = (second.width, second.height)
            if hires.latent:
                factor = self._lifecycle.pipeline.vae_scale_factor
                carry.put(plan(), latents=stages.upscale_latents(carry.get("latents"), hires, size, factor))
                return
            images = self._decode_carried(params, job)
            images = self._upscale_to(images, hires.upscaler, size, job, phase) if hires.model \
                else stages.upscale_images(images, hires, size)
            if images is None:
                return True  # Interrupt or Skip between two tiles: the first pass is the result
            if hires.upscale_only:  # the upscaled pictures are the result: no encode, no second pass
                upscaled.extend(images)
                return
            carry.put(plan(), latents=self._lifecycle.run_on_model(lambda pipe: stages.encode(pipe, images, first),
                                                                   _size(second)))

        upscaled: list[Image.Image] = []
        if self._stage("hires upscale", f"{hires.upscaler} x{hires.scale:g} -> {second.width}x{second.height}",
                       upscale):
            return self._decode_carried(params, job), params.steps
        if hires.upscale_only:  # a latent upscale is decoded at the hires size; the others are pictures already
            return upscaled or self._decode_carried(second, job), None

        def second_pass():
            stripped = self._with_loras(second, passes)
            # A1111's prompt edits count the hires pass's steps on from the first pass's (app/prompts/schedule.py)
            kind, inputs = "img2img", {"latents": carry.get("latents"), "first_pass_steps": params.steps}
            if stages.inpainting_checkpoint(self._lifecycle.pipeline):  # as A1111: masked whole, a blank picture
                kind = "inpaint"
                inputs.update(self._lifecycle.run_on_model(lambda pipe: stages.unmasked_inputs(pipe, second, first),
                                                           _size(second)))
            return self._denoise_and_decode(stripped, kind, first, hires.steps_run(params), hires.denoising_strength,
                                            job, f"hires pass, {phase}", self._control_pass(stripped, "hires"),
                                            **inputs)

        return self._stage("hires fix", f"{second.steps} steps at {hires.denoising_strength:g} "
                                        f"{second.width}x{second.height}", second_pass)

    def _decode_carried(self, params: GenerateParams, job) -> list[Image.Image]:
        return self._decode(self._lifecycle, self._lifecycle.carry.get("latents"), job, _size(params))

    def _denoise_and_decode(self, params, kind: str, first: int, total: int, strength: float, job, phase: str,
                            control=None, **inputs) -> tuple[list[Image.Image], int | None]:
        """A stage pipeline's pass from the carried inputs, decoded on the loaded pipeline's VAE; with `control`
        (a `ControlPass`) the family's control pipeline of that `kind` runs it."""
        if control is not None and kind not in family(self.snapshot().family).controlnet.pipelines:
            raise ValueError(f"ControlNet units with {kind} are not available for this model yet")
        stage = kind if control is None else CONTROL_STAGE + kind

        def run(on_step):
            return self._lifecycle.run_on_model(lambda pipe: stages.denoise_stage(
                pipe, params, first, on_step, total, strength, control=control, kind=kind, **inputs), _size(params),
                stage=stage)

        latents, stopped = self._denoise_run(total, job, phase, run)
        if latents is None:  # stopped before a step completed
            return [], stopped
        return self._decode(self._lifecycle, latents, job, _size(params)), stopped

    # ------------------------------------------------------------------ img2img and inpaint
    def _init_image_run(self, params, source: InitImages, first: int, phase: str, job, passes: _Passes):
        """One run of img2img or inpaint: an encode stage, then the denoising stage."""
        carry, lifecycle = self._lifecycle.carry, self._lifecycle
        nine = stages.inpainting_checkpoint(lifecycle.pipeline)
        if nine and source.mask is None:  # an inpainting checkpoint: the whole picture is masked
            source = dataclasses.replace(source, mask=Image.new("L", source.images[0].size, 255), mask_blur=0)
        kept: dict[str, Any] = {}

        def encode():
            if source.mask is None:
                carry.put(lifecycle.plan, **lifecycle.run_on_model(
                    lambda pipe: stages.img2img_inputs(pipe, source, params, first), _size(params)))
                return
            tensors, kept["originals"], kept["mask"] = lifecycle.run_on_model(
                lambda pipe: stages.inpaint_inputs(pipe, source, params, first, nine), _size(params))
            carry.put(lifecycle.plan, **tensors)

        kind = "img2img" if source.mask is None else "inpaint"
        self._stage(f"{kind} encode", f"{len(source.images)} image(s) {source.resize_mode} -> "
                                      f"{params.width}x{params.height}", encode)

        def denoise():
            stripped = self._with_loras(params, passes)
            inputs = {"latents": carry.get("latents")} if source.mask is None else self._carried_inpaint(nine)
            control = self._control_pass(stripped, "only", source.images[0])
            images, stopped = self._denoise_and_decode(stripped, kind, first, source.steps_run(params),
                                                       source.denoising_strength, job, f"{kind}, {phase}", control,
                                                       **inputs)
            if source.mask is not None:
                images = [image_ops.overlay(im, kept["originals"][i], kept["mask"]) for i, im in enumerate(images)]
            return images, stopped

        return self._stage(kind, f"{source.steps_run(params)} steps at {source.denoising_strength:g}", denoise)


    def _carried_inpaint(self, nine: bool) -> dict[str, Any]:
        """The inpaint stage's inputs from the carry. SD1.5's and Flux's pipelines would mask pixels
        themselves without masked-image latents; a regular denoiser never reads them, so there the init
        latents stand in."""
        carry = self._lifecycle.carry
        latents = carry.get("latents")
        return {"latents": latents, "mask_image": carry.get("mask"),
                "masked_image_latents": carry.get("masked") if nine else latents}


def _size(params: GenerateParams) -> str:
    return f"{params.batch}x{params.width}x{params.height}"


def _size_multiple(family_name: str | None) -> int:
    return generate.DEFAULT_SIZE_MULTIPLE if family_name is None else family(family_name).size_multiple


def _no_model() -> None:
    raise RuntimeError("no model loaded: load a checkpoint first")
