"""One generation: scheduler choice, per-image seeds, denoising, PNG infotext (the VAE decode: `decoding`).

Seeds use CPU generators, one per image, so the same seed gives the same image whatever the
offload mode, device placement or batch position.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from PIL import Image, PngImagePlugin

from app.controlnet.units import ControlUnit, check_units
from app.engine import decoding, timeline, variation
from app.engine.host_read import HostRead
from app.engine.interrupt import StepInterrupted
from app.engine.step_cache import MAX_THRESHOLD
from app.families import FAMILIES, family, family_of
from app.infotext import LoraUse, format_infotext
from app.prompts.editing import EditedPass, encoded_texts, not_edited_note
from app.prompts.encode import CLIP_SKIP_MAX
from app.prompts.notes import negative_note, prompt_notes

log = logging.getLogger(__name__)

# Every sampler name some family offers (each family's own table says what a name means for it:
# "Euler" is Euler discrete on SD and flow-match Euler on Flux); a family refuses names it lacks.
SCHEDULERS: dict[str, None] = dict.fromkeys(name for fam in FAMILIES.values() for name in fam.sampling.samplers)
def _number(value: float) -> str:
    """Whole numbers in full (a seed range reads 4294967295, not 4.29497e+09), others as typed."""
    return str(int(value)) if value == int(value) else f"{value:g}"


@dataclass(frozen=True)
class Range:
    """A closed range one generation setting must lie in: the one rule set the UI, the API and
    `GenerateParams` share. A value outside it, a fraction where a whole number is due, or a
    non-finite number is refused with the range in the message; nothing is clamped or rounded
    behind the user's back."""

    low: float
    high: float
    whole: bool = True
    hint: str = ""

    def __str__(self) -> str:
        span = f"{_number(self.low)}…{_number(self.high)}"
        return f"{span} ({self.hint})" if self.hint else span

    def check(self, field: str, value: object) -> int | float:
        """`value` as an int (whole ranges) or float; ValueError naming the field and the range."""
        kind = "a whole number" if self.whole else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{field} must be {kind} in {self}, got {value!r}")
        if self.whole and value != int(value):
            raise ValueError(f"{field} must be {kind} in {self}, got {value!r}")
        if not self.low <= value <= self.high:
            raise ValueError(f"{field} must be {kind} in {self}, got {_number(value)}")
        return int(value) if self.whole else float(value)


MAX_SEED = 2**32 - 1
# Per-request bounds, so one request from a share link cannot hold the worker or the memory for
# long. CLIP reads 75 tokens per chunk and A1111 users rarely go past a few chunks; 16,000
# characters is about 4,000 tokens (the tokenizer averages ~4 characters per token). 10^9
# pixel-steps (batch x width x height x steps: 4 x 1024² x 238, or 16 x 512² x 238) is two to three
# minutes on an H100; the per-field limits alone allowed 16 x 2048² x 150, ten times that.
MAX_PROMPT_CHARS = 16_000
_GUIDANCE = [fam.sampling.guidance_range for fam in FAMILIES.values()]
MAX_PIXEL_STEPS = 1_000_000_000
LIMITS: dict[str, Range] = {
    "steps": Range(1, 150),
    # every family's guidance range together; `Family.check_guidance` narrows it to the loaded family's
    "cfg": Range(min(low for low, _ in _GUIDANCE), max(high for _, high in _GUIDANCE), whole=False),
    "seed": Range(-1, MAX_SEED, hint="-1 = random"),
    "width": Range(64, 2048),
    "height": Range(64, 2048),
    "batch": Range(1, 16),
    "n_iter": Range(1, 100, hint="batch count"),
    "clip_skip": Range(1, CLIP_SKIP_MAX, hint="1 = the last layer"),
    # A1111's variation seed (app/engine/variation.py) and "resize seed from" (0: the image's own size).
    "subseed": Range(-1, MAX_SEED, hint="-1 = random"),
    "subseed_strength": Range(0, 1, whole=False, hint="0 = off"),
    "seed_resize_from_w": Range(0, 2048, hint="0 = off"),
    "seed_resize_from_h": Range(0, 2048, hint="0 = off"),
    # A1111's refiner: the share of the noise schedule the base model denoises (app/engine/refining.py).
    "refiner_switch_at": Range(0.01, 1, whole=False, hint="1 = no refiner"),
    # the step cache's threshold (app/engine/step_cache.py): the first block's relative change under which a
    # step reuses the last whole one; base models only
    "step_cache": Range(0, MAX_THRESHOLD, whole=False, hint="0 = off"),
}
# Fields a form or request may leave out, and their values (the others are required).
OPTIONAL = {"n_iter": 1, "clip_skip": 1, "subseed": -1, "subseed_strength": 0, "seed_resize_from_w": 0,
            "seed_resize_from_h": 0, "refiner_switch_at": 0.8, "step_cache": 0}
DEFAULT_SIZE_MULTIPLE = 8  # sizes with no model loaded; a family states its own (`Family.size_multiple`)


@dataclass(frozen=True)
class GenerateParams:
    prompt: str
    negative_prompt: str = ""
    steps: int = 20
    cfg: float = 7.0
    seed: int = -1
    width: int = 512
    height: int = 512
    batch: int = 1  # images per denoising run (A1111 "batch size")
    sampler: str = "Euler a"
    n_iter: int = 1  # runs one after another, seeds continuing (A1111 "batch count"); Skip ends one
    clip_skip: int = 1  # A1111's "Clip skip": read the text encoder's layer -N (app/prompts/encode.py)
    subseed: int = -1  # variation seed (A1111's names), mixed in at `subseed_strength` (0: off)
    subseed_strength: float = 0.0
    seed_resize_from_w: int = 0  # draw the noise as for this size (both > 0), pasted centred
    seed_resize_from_h: int = 0
    refiner_checkpoint: str = ""  # a checkpoint that finishes the txt2img after `refiner_switch_at` ("": none)
    refiner_switch_at: float = 0.8
    step_cache: float = 0.0  # the step cache's threshold; 0: off (every step runs the whole denoiser)
    tiling: bool = False  # A1111's "Tiling": an image that repeats seamlessly (app/engine/seamless.py)
    controlnet_units: tuple[ControlUnit, ...] = ()  # the enabled ControlNet units, at most `MAX_UNITS` (app/controlnet)
    restore_faces: bool = False  # A1111's "Restore faces": each saved image's faces restored (`Upscaling`)

    def __post_init__(self) -> None:
        for label, text in (("prompt", self.prompt), ("negative prompt", self.negative_prompt)):
            if len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"the {label} is {len(text):,} characters long; the limit is "
                                 f"{MAX_PROMPT_CHARS:,} characters (about 4,000 tokens)")
        if self.sampler not in SCHEDULERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose one of {sorted(SCHEDULERS)}")
        for field, rule in LIMITS.items():
            rule.check(field, getattr(self, field))
        for side in (self.width, self.height):
            if side % DEFAULT_SIZE_MULTIPLE:
                raise ValueError(f"width and height must be multiples of {DEFAULT_SIZE_MULTIPLE}, got {side}")
        check_work(self.n_iter, self.batch, self.width, self.height, self.steps)
        check_units(self.controlnet_units)


def check_work(runs: int, batch: int, width: int, height: int, steps: int, what: str = "") -> None:
    """The per-request cap of `MAX_PIXEL_STEPS` on a pass of `runs` (batch count) x `batch` images of
    `width` x `height` at `steps`: a batch count of 100 once multiplied the cap's time, answer and disk by 100."""
    work = runs * batch * width * height * steps
    if work > MAX_PIXEL_STEPS:
        raise ValueError(f"{what}{': ' if what else ''}batch count x batch x width x height x steps = {runs} x {batch} "
                         f"x {width} x {height} x {steps} = {work:,} is over the per-request cap of "
                         f"{MAX_PIXEL_STEPS:,}; use fewer images, runs, steps or pixels")


def round_size(field: str, value: int, family_name: str | None) -> tuple[int, str]:
    """Round a side down to the family's multiple, as A1111 does (its latents are `side // 8`), and
    say so: (rounded, note), the note empty when nothing changed."""
    fam = None if family_name is None else family(family_name)
    multiple = DEFAULT_SIZE_MULTIPLE if fam is None else fam.size_multiple
    rounded = value - value % multiple
    if rounded == value:
        return value, ""
    label = "this model's" if fam is None else fam.label
    return rounded, (f"{field} {value} → {rounded}: {label} sizes are multiples of {multiple} "
                     "(rounded down, as A1111 does)")


def params_from_form(values: dict[str, object], family_name: str | None) -> tuple[GenerateParams, tuple[str, ...]]:
    """Raw form or API values -> (parameters, notes about what was rounded).

    Every field is checked against `LIMITS` first and all refusals are reported in one message;
    then width and height are rounded to the family's multiple, each with a note to show."""
    problems, checked = [], {}
    for field, rule in LIMITS.items():
        try:
            checked[field] = rule.check(field, values.get(field, OPTIONAL.get(field)))
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(";\n".join(problems))
    notes = []
    for field in ("width", "height"):
        checked[field], note = round_size(field, checked[field], family_name)
        notes.append(note)
    params = GenerateParams(str(values.get("prompt") or ""), str(values.get("negative_prompt") or ""),
                            sampler=str(values.get("sampler")),
                            refiner_checkpoint=str(values.get("refiner_checkpoint") or ""),
                            tiling=bool(values.get("tiling")), restore_faces=bool(values.get("restore_faces")),
                            **checked)
    if family_name is not None:
        fam = family(family_name)
        notes += prompt_notes(fam, *encoded_texts(fam, params.prompt, params.negative_prompt, params.steps))
        notes.append(negative_note(fam, params.negative_prompt, params.cfg))
        notes.append(not_edited_note(fam, params.prompt, params.negative_prompt, params.steps))
    return params, tuple(n for n in notes if n)


class NonFiniteLatentsError(RuntimeError):
    """The latents held NaN or Inf after denoising step `step` (1-based) of `total`."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(f"the latents became NaN or Inf at step {step} of {total}: the model or a LoRA "
                         "produced values out of range, and the image would come out black")
        self.step = step
        self.total = total


class _FiniteWatch:
    """Checks the latents after every step, one step behind: step k's flag is computed on the
    device and read at step k+1 (`HostRead`), when step k+1's work is already queued behind it, so
    the check never leaves a GPU idle waiting for the CPU. `settle()` reads the last flag."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._pending: tuple[int, HostRead] | None = None

    def observe(self, step: int, latents: torch.Tensor) -> None:
        flag = HostRead(torch.isfinite(latents).all())
        self.settle()
        self._pending = (step, flag)

    def settle(self) -> None:
        if self._pending is not None:
            step, flag = self._pending
            self._pending = None
            if not bool(flag.value()):
                raise NonFiniteLatentsError(step, self.total)


@dataclass(frozen=True)
class GeneratedImage:
    image: Image.Image
    seed: int
    infotext: str
    path: Path | None = None
    stopped_at: int | None = None  # the step an Interrupt or Skip stopped the denoising at (None: ran all)
    subseed: int | None = None  # the variation seed mixed in (None: none)
    notes: tuple[str, ...] = ()  # what a detail pass has to say about this image (no region found, …)
    masks: tuple[Image.Image, ...] = ()  # the region masks its detail passes redrew (the mask preview)

    @property
    def complete(self) -> bool:
        return self.stopped_at is None


@dataclass(frozen=True)
class RunContext:
    """What the engine knows about the model and adapters a generation runs with. `loras` holds
    `LoraUse(name, unet, short_hash, te)` entries (plain tuples in that order work too)."""

    model_name: str
    model_hash: str | None  # None: the file could not be read, and the pair is left out as A1111 does
    loras: tuple[tuple, ...] = ()
    family: str | None = None  # the family, for how guidance is written


def resolve_seed(seed: int) -> int:
    return random.randint(0, MAX_SEED) if seed == -1 else seed


def infotext(params: GenerateParams, seed: int, ctx: RunContext, extra: tuple[tuple[str, object], ...] = ()) -> str:
    """A1111-style `parameters` text (see `app.infotext`), so other tools and our PNG Info read it back.
    A guidance-distilled family (Flux dev) writes what Forge writes: `CFG scale: 1` (no CFG runs) and
    the guidance as `Distilled CFG Scale`. `extra` holds a workflow's own pairs (`Denoising
    strength`, `Hires upscale`, …), written after `Model` as A1111 writes them. A family that has no
    negative prompt (Flux) ran without it, so none is written: a reader must not believe it counted; and
    wherever a written negative prompt was not read (that, or CFG 1), `Negative prompt unused` says why."""
    fam = family(ctx.family) if ctx.family is not None else None
    distilled = fam is not None and fam.sampling.distilled_guidance
    negative = params.negative_prompt if fam is None or fam.sampling.negative_prompt else ""
    unused = fam.negative_unused(params.cfg) if fam is not None and params.negative_prompt.strip() else ""
    guidance = [("CFG scale", "1"), ("Distilled CFG Scale", f"{params.cfg:g}")] if distilled \
        else [("CFG scale", f"{params.cfg:g}")]
    guidance += [("Negative prompt unused", unused)] if unused else []
    settings = [("Steps", params.steps), ("Sampler", params.sampler), *guidance, ("Seed", seed),
                ("Size", f"{params.width}x{params.height}"), ("Model hash", ctx.model_hash), ("Model", ctx.model_name),
                *extra, *([("Clip skip", params.clip_skip)] if params.clip_skip > 1 else []),
                *([("Tiling", True)] if params.tiling else []),
                *([("Step cache", f"{params.step_cache:g}")] if params.step_cache > 0 else [])]
    settings = [(key, value) for key, value in settings if value is not None]
    loras = tuple(LoraUse(*entry) for entry in ctx.loras)
    return format_infotext(params.prompt, negative, settings, loras)


def scheduler_for(pipe, sampler: str):
    """A fresh scheduler for `sampler` on the pipeline's scheduler config; a sampler its family lacks is refused."""
    fam = family_of(pipe)
    if sampler not in fam.sampling.samplers:
        raise ValueError(f"{fam.label} has no sampler {sampler!r}; choose one of {', '.join(fam.sampling.samplers)}")
    cls, overrides = fam.sampling.samplers[sampler]
    return cls.from_config(pipe.scheduler.config, **overrides)


def _check_size(fam, params: GenerateParams) -> None:
    for side in (params.width, params.height):
        if side % fam.size_multiple:
            raise ValueError(f"{fam.label} sizes must be multiples of {fam.size_multiple}, got "
                             f"{params.width}x{params.height}")


StepCallback = Callable[[int, int, torch.Tensor], bool]


def seed_generators(seed: int, count: int, step: int = 1) -> list[torch.Generator]:
    """One CPU generator per image, image i seeded with `seed + i·step`: the same seed gives the same image
    whatever the batch position, device or offload mode (step 0: every image keeps the seed, as A1111's
    images do when a variation seed is mixed in)."""
    return [torch.Generator("cpu").manual_seed((seed + i * step) % (MAX_SEED + 1)) for i in range(count)]


def run(pipe, params: GenerateParams, seed: int, on_step: StepCallback | None = None, **inputs) -> list[Image.Image]:
    """Denoise and decode `params.batch` images; image i uses seed `seed + i`; `inputs` go to the
    pipeline call (reference images: `image=[…]`).

    `on_step(step, total, latents)` runs after each step (it must only read the latents: the live
    preview projects them with `app.preview.preview_pixels`); when it returns True the remaining
    steps are skipped (diffusers' own interrupt flag) and the latents reached so far are decoded:
    an Interrupt or Skip lands between two steps, never inside a forward. Raises
    `NonFiniteLatentsError` naming the step when the latents stop being finite.
    """
    latents = denoise(pipe, params, seed, on_step, width=params.width, height=params.height, **inputs)
    return [] if latents is None else decoding.decode(pipe, latents)


def denoise(pipe, params: GenerateParams, seed: int, on_step: StepCallback | None = None, total: int | None = None,
            first_pass_steps: int | None = None, steps_before: int = 0, **inputs) -> torch.Tensor | None:
    """The denoising loop of any of our pipelines (txt2img, or a stage pipeline given its `inputs`:
    init latents, strength, mask); returns the latents spatial, (batch, channels, h, w), as the VAE
    and the next stage read them (Flux's packed patches unpacked). `total` is the
    number of steps the loop really runs (an img2img pass runs `steps × strength`), for `on_step`
    and the NaN check. A stop inside a step returns the last complete step's latents, or None when
    no step had completed (nothing to keep). A prompt that edits itself (`[from:to:when]`, `[a|b]`)
    changes its conditioning between steps (`app/prompts/editing.py`); `first_pass_steps`: this is the
    hires pass after a first pass of that many steps, which A1111's schedules count from;
    `steps_before`: steps of the same schedule already run (the refiner's pass after the base's)."""
    fam = family_of(pipe)
    _check_size(fam, params)
    fam.check_guidance(params.cfg)
    pipe.scheduler = scheduler_for(pipe, params.sampler)
    total = params.steps if total is None else total
    watch = _FiniteWatch(total)
    reached = {}  # the latents after the last complete step, kept for a stop inside the next one

    edits = EditedPass(pipe, fam, params.prompt, params.negative_prompt, params.clip_skip, params.steps,
                       params.batch, first_pass_steps, steps_before)

    def step_end(_pipe, step, _timestep, kwargs):
        with timeline.phase("finite check"):
            watch.observe(step + 1, kwargs["latents"])
        reached["latents"] = kwargs["latents"]
        if on_step is not None and on_step(step + 1, total, pipe.spatial_latents(kwargs["latents"], params.height,
                                                                                  params.width)):
            _pipe._interrupt = True
        if edits.edited:
            edits.swap(step, kwargs)
        return kwargs

    # no_grad, not inference_mode: offload hooks move weights during the call, and inference-mode
    # tensors could not be patched in place afterwards.
    generators = seed_generators(seed, params.batch, step=0 if variation.varies(params) else 1)
    seed_step_noise = getattr(pipe.scheduler, "seed_step_noise_", None)
    if seed_step_noise is not None:  # a sampler that draws noise in its step, which the pipeline calls unseeded
        seed_step_noise(generators)
    try:
        with torch.no_grad(), variation.drawing_with(pipe, variation.of(params)):
            with timeline.phase("text encode"):
                prompts = edits.first
            with timeline.phase("denoise"):
                latents = pipe(
                    num_inference_steps=params.steps,
                    num_images_per_prompt=params.batch,
                    generator=generators,
                    output_type="latent",
                    callback_on_step_end=step_end,
                    **({"callback_on_step_end_tensor_inputs": ["latents", *edits.callback_inputs]}
                       if edits.edited else {}),
                    **prompts.call_arguments(),
                    **fam.call_arguments(params.cfg),
                    **inputs,
                ).images
    except StepInterrupted:  # a stop inside a step (`app.engine.interrupt`): the last complete step counts
        latents = reached.get("latents")
        if latents is None:
            return None
    else:
        watch.settle()
    return pipe.spatial_latents(latents, params.height, params.width)


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def save_png(image: Image.Image, text: str, outputs_dir: Path, seed: int, *, compress_level: int,
             chunks: Mapping[str, str] | None = None) -> Path:
    """Write `outputs/<date>/<nnnnn>-<seed>.png` with the infotext in the `parameters` chunk (`chunks`:
    the text chunks to write instead, as Extras writes A1111's `postprocessing` beside the source's), at
    `compress_level` (`Settings.png_compress_level`: the write is on the worker's path to the next image)."""
    folder = outputs_dir / datetime.now().strftime("%Y-%m-%d")
    folder.mkdir(parents=True, exist_ok=True)
    index = len(list(folder.glob("*.png")))
    path = folder / _UNSAFE.sub("_", f"{index:05d}-{seed}.png")
    while path.exists():
        index += 1
        path = folder / f"{index:05d}-{seed}.png"
    meta = PngImagePlugin.PngInfo()
    for key, value in ({"parameters": text} if chunks is None else chunks).items():
        meta.add_text(key, value)
    image.save(path, pnginfo=meta, compress_level=compress_level)
    return path
