"""The settings of the multi-stage workflows: hires fix on txt2img, img2img and inpaint.

Why a module of its own: `GenerateParams` is the txt2img request every caller builds; the
workflows add fields that only they read. Each new number is checked by a `Range` in
`STAGE_LIMITS`, the same kind of rule `generate.LIMITS` holds, so the UI shows the same range as
its hint and the API refuses the same values with the same message. Names and meanings are
A1111's (`/sdapi/v1/txt2img` `hr_*` fields, `/sdapi/v1/img2img` `resize_mode`, `inpainting_fill`,
`mask_blur`, `inpainting_mask_invert`), and so are the infotext pairs a hires image carries, so
a PNG we write reads back (`hires_from_infotext`) to the settings that made it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from PIL import Image

from app.engine import variation
from app.engine.generate import LIMITS, SCHEDULERS, GenerateParams, Range, check_work

# A1111's order: `resize_mode` 0, 1, 2 and `inpainting_fill` 0, 1, 2, 3 index these.
RESIZE_MODES = ("just resize", "crop and resize", "resize and fill")
MASKED_CONTENT = ("fill", "original", "latent noise", "latent nothing")
# A1111's latent upscaler names -> (torch interpolate mode, antialias).
LATENT_UPSCALERS: Mapping[str, tuple[str, bool]] = {
    "Latent": ("bilinear", False), "Latent (antialiased)": ("bilinear", True),
    "Latent (bicubic)": ("bicubic", False), "Latent (bicubic antialiased)": ("bicubic", True),
    "Latent (nearest)": ("nearest", False), "Latent (nearest-exact)": ("nearest-exact", False),
}
# Plain resamplers in pixel space (decode, resize, encode again), as A1111 names them.
PIXEL_UPSCALERS: Mapping[str, Image.Resampling] = {"Lanczos": Image.Resampling.LANCZOS,
                                                   "Nearest": Image.Resampling.NEAREST}
# The built-in upscalers; any other name is an upscaler model file (ESRGAN, RealESRGAN, SwinIR, DAT, …),
# which the engine looks up before queueing (`Engine.check_upscaler`; `Engine.hires_upscalers` lists all).
UPSCALERS = (*LATENT_UPSCALERS, *PIXEL_UPSCALERS)
SAME = "Use same sampler"  # A1111's hires sampler choice meaning "the first pass's"

STAGE_LIMITS: dict[str, Range] = {
    "denoising_strength": Range(0, 1, whole=False),
    "hires_scale": Range(1, 4, whole=False),
    "hires_steps": Range(0, 150, hint="0 = as many as the first pass"),
    "mask_blur": Range(0, 64),
}


def _steps_run(steps: int, strength: float, what: str) -> int:
    """The steps a pass of `steps` at denoising `strength` really runs (diffusers and A1111 alike run
    int(steps × strength)); refuses a pass that would run none."""
    run = min(int(steps * strength), steps)
    if run < 1:
        raise ValueError(f"{what}: {steps} steps at denoising strength {strength:g} run no step "
                         f"(int({steps} x {strength:g}) = 0); raise the steps or the denoising strength")
    return run


@dataclass(frozen=True)
class HiresParams:
    """A1111's hires fix: the first pass at the request's size, an upscale by `scale` with `upscaler`
    (a latent mode, a pixel resampler or an ESRGAN file), then an img2img pass of `steps` (0: the
    first pass's) at `denoising_strength`, with its own `sampler` (`SAME`: the first pass's) and its
    own prompts (empty: the first pass's), whose `<lora:…>` tags set that pass's LoRA strengths.
    A1111's request fields: `hr_scale`, `hr_upscaler`, `hr_second_pass_steps`, `denoising_strength`,
    `hr_sampler_name`, `hr_prompt`, `hr_negative_prompt` (`hr_resize_x/y` are not supported)."""

    scale: float = 2.0
    upscaler: str = "Latent"
    steps: int = 0
    denoising_strength: float = 0.7
    sampler: str = SAME
    prompt: str = ""
    negative_prompt: str = ""

    def __post_init__(self) -> None:
        for field, value in (("hires_scale", self.scale), ("hires_steps", self.steps),
                             ("denoising_strength", self.denoising_strength)):
            STAGE_LIMITS[field].check(field, value)
        if self.sampler != SAME and self.sampler not in SCHEDULERS:
            raise ValueError(f"unknown hires sampler {self.sampler!r}; choose {SAME!r} or one of {sorted(SCHEDULERS)}")
        if not isinstance(self.upscaler, str) or not self.upscaler.strip():
            raise ValueError(f"the hires upscaler must be named: one of {', '.join(UPSCALERS)} or an upscaler model")

    @property
    def latent(self) -> bool:
        return self.upscaler in LATENT_UPSCALERS

    @property
    def model(self) -> bool:
        """An upscaler model file rather than a built-in upscaler."""
        return self.upscaler not in UPSCALERS

    def target_size(self, params: GenerateParams, multiple: int) -> tuple[int, int]:
        """The second pass's size: the first pass's times `scale`, rounded down to the family's
        multiple (A1111 truncates to whole latents too); refused past the size limits."""
        sides = []
        for field, side in (("width", params.width), ("height", params.height)):
            target = int(side * self.scale)
            target -= target % multiple
            if target > LIMITS[field].high:
                raise ValueError(f"hires fix: {field} {side} x {self.scale:g} = {target} is over the limit of "
                                 f"{LIMITS[field].high:g}; lower the hires upscale or the first pass's size")
            sides.append(target)
        return sides[0], sides[1]

    def second_pass(self, params: GenerateParams, multiple: int) -> GenerateParams:
        """The request of the second pass; refuses one over the pixel-step cap or running no step."""
        width, height = self.target_size(params, multiple)
        steps = self.steps or params.steps
        if not self.upscale_only:
            _steps_run(steps, self.denoising_strength, "hires fix")
        check_work(params.n_iter, params.batch, width, height, steps, "hires fix")
        # The second pass is noised from the seed alone: a variation seed shapes the first pass's noise.
        return dataclasses.replace(variation.without(params), width=width, height=height, steps=steps,
                                   sampler=params.sampler if self.sampler == SAME else self.sampler,
                                   prompt=self.prompt or params.prompt,
                                   negative_prompt=self.negative_prompt or params.negative_prompt)

    @property
    def upscale_only(self) -> bool:
        """Denoising strength 0: the upscaled first pass is the image, with no second pass (A1111's pass at 0
        runs one step at the last sigma, which leaves the upscale as it is)."""
        return self.denoising_strength == 0

    def steps_run(self, params: GenerateParams) -> int:
        return 0 if self.upscale_only else _steps_run(self.steps or params.steps, self.denoising_strength,
                                                      "hires fix")

    def infotext_pairs(self, params: GenerateParams) -> tuple[tuple[str, object], ...]:
        """The pairs A1111 writes for a hires image, in its order; optional ones only when set."""
        pairs: list[tuple[str, object]] = [("Denoising strength", f"{self.denoising_strength:g}"),
                                           ("Hires upscale", f"{self.scale:g}")]
        if self.steps:
            pairs.append(("Hires steps", self.steps))
        pairs.append(("Hires upscaler", self.upscaler))
        if self.sampler != SAME:
            pairs.append(("Hires sampler", self.sampler))
        if self.prompt and self.prompt != params.prompt:
            pairs.append(("Hires prompt", self.prompt))
        if self.negative_prompt and self.negative_prompt != params.negative_prompt:
            pairs.append(("Hires negative prompt", self.negative_prompt))
        return tuple(pairs)


def hires_from_infotext(settings: Mapping[str, str]) -> HiresParams | None:
    """The hires settings of a parsed infotext (`Infotext.settings`), None when it has none: what
    PNG Info and "send to" read back from a hires image."""
    if "Hires upscale" not in settings and "Hires upscaler" not in settings:
        return None
    return HiresParams(scale=float(settings.get("Hires upscale", 2)), upscaler=settings.get("Hires upscaler", "Latent"),
                       steps=int(settings.get("Hires steps", 0)),
                       denoising_strength=float(settings.get("Denoising strength", 0.7)),
                       sampler=settings.get("Hires sampler", SAME), prompt=settings.get("Hires prompt", ""),
                       negative_prompt=settings.get("Hires negative prompt", ""))


def _choice(what: str, value: str | int, choices: tuple[str, ...]) -> str:
    """A name from `choices`, or A1111's index into them."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(choices):
        return choices[value]
    if value in choices:
        return value
    raise ValueError(f"{what} must be one of {', '.join(choices)} (or their index 0–{len(choices) - 1}), got {value!r}")


@dataclass(frozen=True)
class InitImages:
    """What img2img and inpaint add to a request (A1111's `/sdapi/v1/img2img`): the init images
    (batch item i starts from image i mod their number), how they meet the requested size, the
    denoising strength and, for inpaint, the mask (white: repaint) with its blur, inversion and
    what the masked area starts from."""

    images: tuple[Image.Image, ...]
    denoising_strength: float = 0.75
    resize_mode: str = "just resize"
    mask: Image.Image | None = None
    mask_blur: int = 4
    inpainting_fill: str = "original"
    inpainting_mask_invert: bool = False

    def __post_init__(self) -> None:
        if not self.images or not all(isinstance(im, Image.Image) for im in self.images):
            raise ValueError("img2img needs at least one init image (PNG, JPEG or WebP)")
        if self.mask is not None and not isinstance(self.mask, Image.Image):
            raise ValueError(f"the mask must be an image, got {type(self.mask).__name__}")
        for field in ("denoising_strength", "mask_blur"):
            STAGE_LIMITS[field].check(field, getattr(self, field))
        object.__setattr__(self, "resize_mode", _choice("resize mode", self.resize_mode, RESIZE_MODES))
        object.__setattr__(self, "inpainting_fill", _choice("masked content", self.inpainting_fill, MASKED_CONTENT))

    @property
    def workflow(self) -> str:
        return "img2img" if self.mask is None else "inpaint"

    def steps_run(self, params: GenerateParams) -> int:
        return _steps_run(params.steps, self.denoising_strength, self.workflow)

    def infotext_pairs(self) -> tuple[tuple[str, object], ...]:
        pairs: list[tuple[str, object]] = [("Denoising strength", f"{self.denoising_strength:g}")]
        if self.mask is not None:
            pairs += [("Mask blur", self.mask_blur), ("Masked content", self.inpainting_fill)]
            if self.inpainting_mask_invert:
                pairs.append(("Mask mode", "Inpaint not masked"))
        if self.resize_mode != RESIZE_MODES[0]:
            pairs.append(("Resize mode", self.resize_mode))
        return tuple(pairs)


def stage_values(values: Mapping[str, object], fields: tuple[str, ...]) -> dict[str, int | float]:
    """Raw form or API values of the workflow `fields`, checked by `STAGE_LIMITS`; all refusals in one
    message (as `generate.params_from_form` does for the request's own fields)."""
    problems, checked = [], {}
    for field in fields:
        try:
            checked[field] = STAGE_LIMITS[field].check(field, values.get(field))
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(";\n".join(problems))
    return checked
