"""A unit's control map at a pass's size: the preprocessor's detection, then the unit's resize mode.

As sd-webui-controlnet prepares it: the unit's picture (or, with none, the img2img init picture) goes through
its module at the processor resolution — with "pixel perfect", the resolution the target size implies for that
picture — and the map is fitted to the generation's width and height by the unit's resize mode ("Just Resize"
stretches, "Crop and Resize" covers and crops the centre, "Resize and Fill" fits and fills the bands).
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from app.controlnet import preprocessors
from app.controlnet.units import RESIZE_MODES, ControlUnit
from app.engine import image_ops

_IMAGE_OPS_MODES = dict(zip(RESIZE_MODES, ("just resize", "crop and resize", "resize and fill"), strict=True))


class ControlImageError(ValueError):
    """A unit's control image is missing or is not a picture; the message names the unit."""


def pixel_perfect_resolution(image: Image.Image, width: int, height: int, resize_mode: str) -> int:
    """The processor resolution that makes the map's short side land on the target at scale 1: the
    extension's `pixel_perfect_resolution` (the smaller scale for "Resize and Fill", the larger otherwise)."""
    k_h, k_w = height / image.height, width / image.width
    scale = min(k_h, k_w) if resize_mode == RESIZE_MODES[2] else max(k_h, k_w)
    return min(2048, max(64, int(round(scale * min(image.width, image.height)))))  # the unit's own range


def source_of(index: int, unit: ControlUnit, init: Image.Image | None) -> Image.Image:
    """The picture unit `index` detects its map in: its own, else the img2img init picture."""
    picture = unit.image if unit.image is not None else init
    if picture is None:
        raise ControlImageError(f"ControlNet unit {index}: no control image (give the unit an image, or use img2img "
                                "so the init image is used)")
    if not isinstance(picture, Image.Image):
        raise ControlImageError(f"ControlNet unit {index}: the control image is not a picture "
                                f"(got {type(picture).__name__})")
    return picture


def control_map(index: int, unit: ControlUnit, init: Image.Image | None, width: int, height: int,
                models_dir: Path | None = None) -> Image.Image:
    """Unit `index`'s RGB control map at `width` × `height` (see the module docstring)."""
    picture = source_of(index, unit, init)
    resolution = pixel_perfect_resolution(picture, width, height, unit.resize_mode) if unit.pixel_perfect \
        else unit.processor_res
    detected = preprocessors.detect_map(unit.module, picture, resolution, unit.threshold_a, unit.threshold_b,
                                        models_dir=models_dir)
    return image_ops.resize(detected.convert("RGB"), width, height, _IMAGE_OPS_MODES[unit.resize_mode])
