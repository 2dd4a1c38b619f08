"""A1111's built-in img2img script "SD upscale" (`script_name: "SD upscale"`): upscale, then img2img tile by tile.

`script_args` are A1111's: `[info, overlap, upscaler, scale_factor]` (the first is the script's label, unused;
the upscaler by name or by its index in `GET /sdapi/v1/upscalers`). Each init image is upscaled by
`scale_factor` with that upscaler (the Extras path), cut into tiles of the request's size that overlap by
`overlap` pixels, and every tile is denoised by the request's img2img (its prompt, steps, denoising strength,
seed: the same seed for every tile, as A1111's script does); the tiles are put back with their overlaps blended
linearly, so no seam shows where two meet.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image

from app.a1111.errors import ApiError
from app.engine.generate import GeneratedImage, GenerateParams
from app.upscalers.extras import ExtrasParams

TITLE = "SD upscale"
DEFAULT_ARGS = ("", 64, "None", 2.0)  # A1111's defaults: overlap 64, no upscaler model (resize only), scale 2


@dataclasses.dataclass(frozen=True)
class SdUpscaleArgs:
    overlap: int
    upscaler: str
    scale: float


def asked(script_name: str | None) -> bool:
    return (script_name or "").strip().lower() == TITLE.lower()


def parse_args(args: Sequence[Any], upscalers: Sequence[str]) -> SdUpscaleArgs:
    """A1111's `script_args` for the script (missing ones take its defaults); 422 naming the bad one."""
    values = list(args)[:4] + list(DEFAULT_ARGS[len(args):])
    _info, overlap, upscaler, scale = values
    if isinstance(upscaler, int) and not isinstance(upscaler, bool):
        if not 0 <= upscaler < len(upscalers):
            raise ApiError(422, f"SD upscale: upscaler index {upscaler} is out of range 0-{len(upscalers) - 1}")
        upscaler = upscalers[upscaler]
    if not isinstance(upscaler, str) or upscaler not in upscalers:
        raise ApiError(422, f"SD upscale: upscaler {upscaler!r} not found; choose one of {', '.join(upscalers)}")
    if not isinstance(overlap, int) or isinstance(overlap, bool) or not 0 <= overlap <= 256:
        raise ApiError(422, f"SD upscale: tile overlap must be a whole number of pixels from 0 to 256, got {overlap!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 1 <= scale <= 4:
        raise ApiError(422, f"SD upscale: scale factor must be from 1 to 4, got {scale!r}")
    return SdUpscaleArgs(overlap, upscaler, float(scale))


def _starts(side: int, tile: int, overlap: int) -> list[int]:
    """Where the tiles along one side begin: as few as cover it with at least `overlap` shared, evenly spread."""
    if side <= tile:
        return [0]
    count = math.ceil((side - overlap) / max(tile - overlap, 1))
    step = (side - tile) / (count - 1)
    return [round(i * step) for i in range(count)]


def _weights(size: tuple[int, int], overlap: int) -> np.ndarray:
    """A tile's blending weight: rising linearly over `overlap` pixels from each edge (never quite 0)."""
    ramps = []
    for length in (size[1], size[0]):
        pos = np.arange(length, dtype=np.float64)
        ramp = np.minimum(pos + 1, length - pos) / max(overlap, 1)
        ramps.append(np.clip(ramp, 1e-3, 1.0))
    return np.outer(ramps[0], ramps[1])[..., None]


def _tiles(image: Image.Image, tile: tuple[int, int], overlap: int) -> list[tuple[int, int]]:
    return [(x, y) for y in _starts(image.height, tile[1], overlap) for x in _starts(image.width, tile[0], overlap)]


def upscale_tiled(image: Image.Image, params: GenerateParams, args: SdUpscaleArgs,
                  upscale: Callable[[Image.Image, ExtrasParams], Image.Image],
                  denoise: Callable[[GenerateParams, Image.Image], GeneratedImage | None]) -> GeneratedImage | None:
    """One init image through the script: `upscale` (the Extras job), then `denoise` per tile (img2img of one
    picture at the tile's size), blended back. The first tile's infotext, with the result's size and the script's
    settings, is the image's; None when a tile was dropped (an Interrupt that keeps nothing)."""
    big = upscale(image, ExtrasParams(upscaler=args.upscaler, factor=args.scale))
    tile = (params.width, params.height)
    if big.width < tile[0] or big.height < tile[1]:
        raise ApiError(422, f"SD upscale: the upscaled image ({big.width}x{big.height}) is smaller than a tile "
                            f"({tile[0]}x{tile[1]}, the request's width and height); lower them or raise the scale")
    tile_params = dataclasses.replace(params, batch=1, n_iter=1)
    total = np.zeros((big.height, big.width, 3))
    weight = np.zeros((big.height, big.width, 1))
    first: GeneratedImage | None = None
    ramp = _weights(tile, args.overlap)
    stopped = None
    for x, y in _tiles(big, tile, args.overlap):
        done = denoise(tile_params, big.crop((x, y, x + tile[0], y + tile[1])))
        if done is None:  # dropped by an Interrupt: no picture
            return None
        first, stopped = first or done, stopped or done.stopped_at
        total[y:y + tile[1], x:x + tile[0]] += np.asarray(done.image.convert("RGB"), dtype=np.float64) * ramp
        weight[y:y + tile[1], x:x + tile[0]] += ramp
    pixels = np.clip(np.rint(total / weight), 0, 255).astype(np.uint8)
    text = first.infotext.replace(f"Size: {tile[0]}x{tile[1]}", f"Size: {big.width}x{big.height}")
    text += f", SD upscale overlap: {args.overlap}, SD upscale upscaler: {args.upscaler}"
    return GeneratedImage(Image.fromarray(pixels), first.seed, text, None, stopped, first.subseed)
