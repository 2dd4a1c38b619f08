"""ADetailer's mask rules, in its order, as pure functions on PIL "L" masks (0 or 255, the image's size).

The order is ADetailer's (`pred_preprocessing` and `mask_preprocess` in its `mask.py`): detections
under the confidence are dropped by the detector; then the box area ratio filter (min/max of the
image's area), the top-k (largest boxes, or most confident), each region's mask (its outline, or
its filled box), the x/y offset, dilate/erode (a mask eroded to nothing is dropped), and last merge
or merge-and-invert. Blurring is not here: `mask_blur` is applied by the inpaint that pastes back.

One deliberate difference: ADetailer offsets with `ImageChops.offset`, which wraps around, so a
face at the right edge moved right reappears at the left edge; here what leaves the image is gone.

The outcomes a caller must tell apart (`MaskResult.outcome`): masks to redraw; nothing detected;
regions found but none left after the rules; a mask that covers the whole image (redrawing it is
redrawing the picture, which the caller reports instead of doing silently).
"""

from __future__ import annotations

from typing import NamedTuple

import cv2
import numpy as np
from PIL import Image, ImageDraw

from app.detailer.regions import Region
from app.detailer.units import FILTER_METHODS, MERGE_INVERT, DetailUnit

OK = "ok"
NOTHING_DETECTED = "nothing detected"
ALL_FILTERED = "all filtered"
COVERS_EVERYTHING = "covers everything"


class MaskResult(NamedTuple):
    """The masks to redraw, in order, what happened (`OK` or one of the outcomes above) and the note to show."""

    masks: list[Image.Image]
    outcome: str
    note: str


def filter_by_ratio(regions: list[Region], low: float, high: float, size: tuple[int, int]) -> list[Region]:
    """The regions whose box covers between `low` and `high` of the image's area (both included)."""
    area = size[0] * size[1]
    return [r for r in regions if low <= r.area / area <= high]


def filter_k(regions: list[Region], k: int, by: str = FILTER_METHODS[0]) -> list[Region]:
    """The `k` largest boxes ("Area") or most confident regions ("Confidence"), best first; 0 keeps all as found."""
    if by not in FILTER_METHODS:
        raise ValueError(f"unknown top-k method {by!r}; choose one of {FILTER_METHODS}")
    if k == 0:
        return list(regions)
    key = (lambda r: r.area) if by == FILTER_METHODS[0] else (lambda r: r.score)
    return sorted(regions, key=key, reverse=True)[:k]


def region_mask(region: Region, size: tuple[int, int]) -> Image.Image:
    """The region's outline where its detector drew one, else its box filled (ADetailer's detection models)."""
    if region.mask is not None:
        return region.mask.convert("L").point(lambda v: 255 if v > 127 else 0)
    mask = Image.new("L", size, 0)
    x0, y0, x1, y1 = region.box
    ImageDraw.Draw(mask).rectangle((x0, y0, x1 - 1, y1 - 1), fill=255)
    return mask


def offset(mask: Image.Image, x: int, y: int) -> Image.Image:
    """`mask` moved `x` px right and `y` px up (ADetailer's signs); what leaves the image is dropped."""
    if x == 0 and y == 0:
        return mask
    src = np.asarray(mask)
    out = np.zeros_like(src)
    height, width = src.shape
    dy = -y
    out[max(dy, 0):height + min(dy, 0), max(x, 0):width + min(x, 0)] = \
        src[max(-dy, 0):height + min(-dy, 0), max(-x, 0):width + min(-x, 0)]
    return Image.fromarray(out, "L")


def dilate_erode(mask: Image.Image, pixels: int) -> Image.Image:
    """Dilate (`pixels` > 0) or erode (< 0) with a `|pixels|`-wide square kernel, as ADetailer does
    (OpenCV's anchor sits at the kernel's centre: an even width grows one pixel more right and down)."""
    if pixels == 0:
        return mask
    kernel = cv2.getStructuringElement(cv2.MORPH_RECT, (abs(pixels), abs(pixels)))
    op = cv2.dilate if pixels > 0 else cv2.erode
    return Image.fromarray(op(np.asarray(mask), kernel, iterations=1), "L")


def merge_invert(masks: list[Image.Image], mode: str) -> list[Image.Image]:
    """"None": the masks as they are; "Merge": one mask, their union; "Merge and Invert": its complement."""
    if mode not in MERGE_INVERT:
        raise ValueError(f"unknown merge mode {mode!r}; choose one of {MERGE_INVERT}")
    if mode == MERGE_INVERT[0] or not masks:
        return masks
    union = np.maximum.reduce([np.asarray(m) for m in masks])
    return [Image.fromarray(union if mode == MERGE_INVERT[1] else 255 - union, "L")]


def build_masks(regions: list[Region], size: tuple[int, int], unit: DetailUnit) -> MaskResult:
    """The masks `unit`'s rules make of `regions` (already above its confidence) on a `size` image."""
    if not regions:
        return MaskResult([], NOTHING_DETECTED,
                          f"{unit.model} found nothing at confidence {unit.confidence:g}; the image is unchanged")
    kept = filter_k(filter_by_ratio(regions, unit.mask_min_ratio, unit.mask_max_ratio, size),
                    unit.mask_k, unit.mask_filter_method)
    if not kept:
        return MaskResult([], ALL_FILTERED, f"{unit.model} found {len(regions)}, none with an area ratio in "
                          f"{unit.mask_min_ratio:g}…{unit.mask_max_ratio:g}; the image is unchanged")
    masks = [dilate_erode(offset(region_mask(r, size), unit.x_offset, unit.y_offset), unit.dilate_erode)
             for r in kept]
    masks = merge_invert([m for m in masks if m.getbbox() is not None], unit.mask_merge_invert)
    masks = [m for m in masks if m.getbbox() is not None]
    if not masks:
        return MaskResult([], ALL_FILTERED, f"{unit.model} found {len(regions)}, but no mask is left after the "
                          "offset, dilate/erode and invert settings; the image is unchanged")
    if any(np.asarray(m).min() == 255 for m in masks):
        return MaskResult(masks, COVERS_EVERYTHING, "a detailer mask covers the whole image, so the pass would "
                          "redraw the whole picture; lower the dilation, or use a detector that finds smaller regions")
    return MaskResult(masks, OK, f"{len(masks)} region{'s' if len(masks) != 1 else ''} to redraw")
