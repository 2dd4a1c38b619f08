"""The detail pass (ADetailer's): find regions, then redraw each one at its own resolution, on the engine.

Why it is built this way: a detail pass loads, patches and moves things between two generations, which is
where the SD.Next reports saw devices and dtypes drift. So every part of it is a transition of the engine
with verification before and after (`Engine._run_stage`), inside the one queued job:

* `detail detect` (per image and unit): the unit's `find` turns the picture into region masks, in order;
* per region, `detail encode`: the blurred mask's box, padded and grown to the target's aspect ratio, is
  cropped, scaled to the unit's own width/height or to the model's native area with the crop's aspect
  (A1111's "inpaint only masked"), and encoded with the engine's inpaint stage (`stages.inpaint_inputs`);
* `detail`: the unit's prompt with its `<lora:…>` tags patched for this pass only (`Workflows._with_loras`;
  the job's `restore_loras` puts the model back bit for bit), the inpaint stage pipeline denoises the crop,
  the VAE decodes it, and it is pasted back through the blurred mask: outside that mask every pixel is the
  input's, bit for bit (a VAE round trip would shift them).

A pass runs after txt2img (after the hires pass), after img2img, or on pictures as they are (ADetailer's
"skip img2img": `Engine.detail`). Interrupt and Skip land inside a pass like in any denoising (the region
being drawn is then left as it was); the live preview shows the crop's latents. Prompts follow ADetailer:
empty is the main prompt, `[PROMPT]` inserts it, `[SEP]` gives each region its own part (the last part for
the rest), `[SKIP]` leaves a region alone.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from PIL import Image, ImageFilter

from app.engine import image_ops, stages, timeline
from app.engine.generate import LIMITS, GeneratedImage, GenerateParams
from app.engine.stage_params import InitImages
from app.families import family

SEP, PROMPT, SKIP = "[SEP]", "[PROMPT]", "[SKIP]"
_SEP = re.compile(r"\s*\[SEP\]\s*")
# A region whose blurred mask peaks under this repaints nothing once the latent mask is rounded (0.5).
_PAINTED = 128


@dataclass(frozen=True)
class DetailPass:
    """One detailer unit as the engine runs it. `find(image)` -> (the region masks (L, the image's size,
    white = redraw) in the order they are redrawn, what to say when there are none: "nothing detected",
    "every region filtered out" …); `label` names the unit in notes and stage details. Zero or None
    settings take the main generation's (ADetailer's `ad_use_*` switches off)."""

    label: str
    find: Callable[[Image.Image], tuple[Sequence[Image.Image], str]]
    prompt: str = ""
    negative_prompt: str = ""
    denoising_strength: float = 0.4
    mask_blur: int = 4
    only_masked: bool = True
    padding: int = 32
    width: int = 0  # own inpaint size (both > 0), else the model's native area with the crop's aspect
    height: int = 0
    steps: int = 0
    cfg: float | None = None
    sampler: str = ""
    clip_skip: int = 0

    def pass_params(self, main: GenerateParams, prompt: str, negative: str, size: tuple[int, int]) -> GenerateParams:
        """The request of one region's pass: one image at the crop's size, this unit's settings."""
        return dataclasses.replace(main, prompt=prompt, negative_prompt=negative, width=size[0], height=size[1],
                                   batch=1, n_iter=1, steps=self.steps or main.steps,
                                   cfg=main.cfg if self.cfg is None else self.cfg, sampler=self.sampler or main.sampler,
                                   clip_skip=self.clip_skip or main.clip_skip,
                                   subseed_strength=0.0, seed_resize_from_w=0, seed_resize_from_h=0,
                                   refiner_checkpoint="", step_cache=0.0)


@dataclass(frozen=True)
class DetailParams:
    """The detail passes of a job, in order (ADetailer runs up to 2 units), with the infotext pairs they
    write (ADetailer's keys) and whether img2img is skipped (the init pictures detailed as they are)."""

    passes: tuple[DetailPass, ...]
    infotext: tuple[tuple[str, object], ...] = ()
    skip_img2img: bool = False

    def describe(self) -> str:
        return ", ".join(p.label for p in self.passes)


def region_prompts(template: str, main: str, count: int) -> list[str]:
    """ADetailer's prompt for each of `count` regions: empty is `main`; `[PROMPT]` becomes `main`; `[SEP]`
    splits the template per region (regions past the parts take the last part)."""
    if not template.strip():
        return [main] * count
    parts = [part.replace(PROMPT, main).strip() for part in _SEP.split(template)]
    return [parts[min(i, len(parts) - 1)] or main for i in range(count)]


def _expand(box: tuple[int, int, int, int], aspect: float, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """Grow `box` about its centre to the `aspect` (w/h), kept inside the picture where it fits (A1111's
    `expand_crop_region`), so scaling the crop to the target does not stretch it."""
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    if w / h < aspect:
        w = min(size[0], round(h * aspect))
    else:
        h = min(size[1], round(w / aspect))
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    left = int(min(max(0, round(cx - w / 2)), size[0] - w))
    top = int(min(max(0, round(cy - h / 2)), size[1] - h))
    return left, top, left + w, top + h


def crop_box(mask: Image.Image, padding: int) -> tuple[int, int, int, int]:
    """The box of the mask's painted pixels (any above 0, its blur included), padded, inside the picture."""
    x1, y1, x2, y2 = mask.point(lambda v: 255 if v else 0).getbbox()
    return max(0, x1 - padding), max(0, y1 - padding), min(mask.width, x2 + padding), min(mask.height, y2 + padding)


def target_size(box: tuple[int, int, int, int], native: int, multiple: int) -> tuple[int, int]:
    """The inpaint size of a crop with no own size: the model's native area (`native`²) at the crop's
    aspect, each side rounded down to the family's multiple and inside the size limits."""
    aspect = (box[2] - box[0]) / (box[3] - box[1])
    sides = (native * math.sqrt(aspect), native / math.sqrt(aspect))
    low, high = int(LIMITS["width"].low), int(LIMITS["width"].high)
    return tuple(min(high, max(low, int(side) - int(side) % multiple)) for side in sides)  # type: ignore[return-value]


@dataclass
class _Region:
    """One region's pass on its way through the stages: what was cropped, where it goes back."""

    image: Image.Image  # the picture before this region (what outside the mask stays)
    mask: Image.Image  # the blurred mask at the picture's size
    box: tuple[int, int, int, int]
    params: GenerateParams
    seed: int
    kept: dict


class Detailing:
    """The detail pass of `Engine` (see the module docstring); `Workflows` supplies the stage plumbing."""

    def detail(self, params: GenerateParams, images: Sequence[Image.Image], detail: DetailParams, *,
               owner: str | None = None, desired=None) -> list[GeneratedImage]:
        """ADetailer's "skip img2img": `images` detailed as they are (no img2img pass), image i seeded
        `params.seed + i`; `params` gives the main prompts and settings the units fall back to."""
        if not images:
            raise ValueError("the detailer needs at least one picture to detail")
        self.check_detail(detail, desired)
        pictures = [im.convert("RGB") for im in images]
        params = dataclasses.replace(params, batch=len(pictures), n_iter=1, **_size_of(pictures[0]))

        def run(first, phase, job, passes, run_params):
            return self._detail_images(list(pictures), detail, run_params, first, phase, job, passes)

        return self._workflow("detail", f"{detail.describe()} on {len(pictures)} picture(s)", params, owner,
                              detail.infotext, run, desired)

    def check_detail(self, detail: DetailParams, desired) -> None:
        """Refuse, before queueing, detail passes the model cannot run: its family has no inpaint stage."""
        family_name = self._family_for(desired)
        if family_name is not None and "inpaint" not in family(family_name).stage_pipelines:
            raise ValueError(f"the detailer redraws regions by inpainting, which {family(family_name).label} models "
                             "cannot do yet")
        if not detail.passes:
            raise ValueError("the detailer is on but has no unit to run: enable a unit or turn it off")
        for number, unit in enumerate(detail.passes, 1):
            for field, side in (("width", unit.width), ("height", unit.height)):
                if side:  # 0: the native area's
                    LIMITS[field].check(f"detailer unit {number}'s inpaint {field}", side)

    def _then_detail(self, result, detail: DetailParams, params: GenerateParams, first: int, phase: str, job,
                     passes):
        """After a run's own passes, the detail passes on its images; a run stopped early is returned as it is."""
        images, stopped = result[:2]
        if stopped is not None or job.stop is not None or not images:
            return result
        return self._detail_images(images, detail, params, first, phase, job, passes)

    def _detail_images(self, images: list[Image.Image], detail: DetailParams, params: GenerateParams, first: int,
                       phase: str, job, passes):
        """Every unit on every image, in order -> (images, None, [(notes, masks)] per image)."""
        marks = []
        for i, image in enumerate(images):
            notes, masks = [], []
            for number, unit in enumerate(detail.passes, 1):
                if job.stop is not None:
                    notes.append(f"detailer unit {number} ({unit.label}) not run: the job was stopped")
                    continue
                image = self._detail_unit(image, unit, number, params, first + i, f"{phase}, image {i + 1}", job,
                                          passes, notes, masks)
            images[i] = image
            marks.append((tuple(notes), tuple(masks)))
        return images, None, marks

    def _detail_unit(self, image: Image.Image, unit: DetailPass, number: int, params: GenerateParams, seed: int,
                     phase: str, job, passes, notes: list, masks: list) -> Image.Image:
        """One unit on one picture: its detect stage, then each region's encode and detail stages."""
        def detect():
            with timeline.phase("detect"):
                return unit.find(image)

        found, why = self._stage("detail detect", f"unit {number}: {unit.label}, {image.width}x{image.height}", detect)
        masks.extend(found)
        if not found:
            notes.append(f"detailer unit {number} ({unit.label}): {why or 'no region found; the image is unchanged'}")
            return image
        prompts = region_prompts(unit.prompt, params.prompt, len(found))
        negatives = region_prompts(unit.negative_prompt, params.negative_prompt, len(found))
        for j, mask in enumerate(found):
            what = f"detailer unit {number} ({unit.label}) region {j + 1}"
            if prompts[j] == SKIP:
                continue
            if mask.convert("L").getextrema()[0] >= _PAINTED:
                notes.append(f"{what}: its mask covers the whole image, which is img2img rather than a detail "
                             "pass; skipped (lower the dilation or the detector's area ratio)")
                continue
            region = self._region(image, unit, mask, params, prompts[j], negatives[j], seed + j)
            if region is None:
                notes.append(f"{what}: its mask is too faint to repaint after a blur of {unit.mask_blur}; skipped")
                continue
            image = self._redraw(region, unit, number, j, phase, job, passes, notes, what)
            if job.stop is not None:
                break
        return image

    def _region(self, image: Image.Image, unit: DetailPass, mask: Image.Image, params: GenerateParams, prompt: str,
                negative: str, seed: int) -> _Region | None:
        """The crop of one region (None: nothing left to paint once blurred)."""
        grey = mask.convert("L").resize(image.size, Image.Resampling.NEAREST)
        blurred = grey.filter(ImageFilter.GaussianBlur(unit.mask_blur)) if unit.mask_blur else grey
        if blurred.getextrema()[1] < _PAINTED:
            return None
        fam = family(self._lifecycle.facts().family)
        own = (unit.width, unit.height) if unit.width and unit.height else None
        if not unit.only_masked:
            box = (0, 0, *image.size)
            size = own or tuple(side - side % fam.size_multiple for side in image.size)
        else:
            box = crop_box(blurred, unit.padding)
            size = own or target_size(box, self._lifecycle.facts().native_size, fam.size_multiple)
            box = _expand(box, size[0] / size[1], image.size)
        return _Region(image, blurred, box, unit.pass_params(params, prompt, negative, size), seed, {})

    def _redraw(self, region: _Region, unit: DetailPass, number: int, j: int, phase: str, job, passes,
                notes: list, what: str) -> Image.Image:
        """The region's two stages; the picture with the region pasted back (as it was when stopped early)."""
        lifecycle, params = self._lifecycle, region.params
        size = (params.width, params.height)
        nine = stages.inpainting_checkpoint(lifecycle.pipeline)
        source = InitImages((region.image.crop(region.box).resize(size, Image.Resampling.LANCZOS),),
                            unit.denoising_strength, mask=region.mask.crop(region.box).resize(size), mask_blur=0)

        def encode():
            tensors, region.kept["originals"], region.kept["mask"] = lifecycle.run_on_model(
                lambda pipe: stages.inpaint_inputs(pipe, source, params, region.seed, nine), _size(params))
            lifecycle.carry.put(lifecycle.plan, **tensors)

        box = "x".join(map(str, region.box))
        self._stage("detail encode", f"unit {number} region {j + 1}: box {box} -> {size[0]}x{size[1]}", encode)

        def redraw():
            stripped = self._with_loras(params, passes)
            total = source.steps_run(params)
            images, stopped = self._denoise_and_decode(stripped, "inpaint", region.seed, total,
                                                       source.denoising_strength, job,
                                                       f"detail {number}.{j + 1}, {phase}",
                                                       **self._carried_inpaint(nine))
            lifecycle.carry.clear()
            if stopped is not None or not images:
                notes.append(f"{what}: stopped at step {stopped} of {total}; the region was left as it was")
                return region.image
            with timeline.phase("detail paste"):
                return _paste(region, images[0])

        return self._stage("detail", f"unit {number} region {j + 1}: {source.steps_run(params)} steps at "
                                     f"{unit.denoising_strength:g} {size[0]}x{size[1]}", redraw)


def _paste(region: _Region, drawn: Image.Image) -> Image.Image:
    """The redrawn crop over the picture through the blurred mask: first over the crop's own pixels at the
    pass's size (the engine's inpaint overlay), scaled back into its box, then composited with the picture,
    so every pixel where the blurred mask is 0 is the picture's exactly."""
    crop = image_ops.overlay(drawn, region.kept["originals"][0], region.kept["mask"])
    x1, y1, x2, y2 = region.box
    pasted = region.image.copy()
    pasted.paste(crop.resize((x2 - x1, y2 - y1), Image.Resampling.LANCZOS), (x1, y1))
    return Image.composite(pasted, region.image, region.mask)


def _size_of(picture: Image.Image) -> dict[str, int]:
    """The request's width and height as the picture's (what its infotext's `Size` must say), where they are
    sizes a request may have; otherwise none (the request's stay)."""
    fits = all(side % 8 == 0 and LIMITS["width"].low <= side <= LIMITS["width"].high for side in picture.size)
    return {"width": picture.width, "height": picture.height} if fits else {}


def _size(params: GenerateParams) -> str:
    return f"{params.batch}x{params.width}x{params.height}"

