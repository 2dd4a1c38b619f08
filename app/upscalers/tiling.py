"""Tiled upscaling with overlap, and A1111's rule for reaching a factor with a fixed-scale model.

Why tiles: a 4× model on a 1024² image would hold 4096² activations of every layer at once; cut into
tiles it fits a small GPU. Each tile is run with `overlap` pixels of the picture around it as context
and only its core is kept, so a tile's pixels see what they would see untiled up to `overlap` pixels
away: no blending, and a model whose reach is within the overlap gives the untiled result exactly.
Each core goes straight into the 8-bit result image on the CPU, and each tile's input is read from the
8-bit source as it is run: a 4096² -> 16384² pass holds the 1 GiB result image, never the 3 GiB float32
result it took before (plus its full-size copies), and only one tile's activations are on the device. The same loop
decodes large latents tile by tile (`app/engine/decoding.py`: the VAE is an 8× "upscaler" of latents).
Between tiles `on_tile(done, total)` reports progress and may stop the run (Interrupt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

RunTile = Callable[[torch.Tensor], torch.Tensor]  # (1, 3, h, w) float32 CPU in [0, 1] -> (1, 3, h*s, w*s)
RunRegion = Callable[[slice, slice], torch.Tensor]  # (rows, columns) of the source -> (1, 3, h*s, w*s) in [0, 1]
OnTile = Callable[[int, int], bool]  # (tiles done, tiles in this pass) -> stop?
MAX_PASSES = 3  # A1111 applies a model at most three times to reach a factor


class UpscaleStopped(Exception):
    """Interrupt or Skip stopped the run between two tiles."""


@dataclass(frozen=True)
class Tiling:
    """`tile`: side of a tile's core in input pixels; `overlap`: context pixels around it."""

    tile: int = 256
    overlap: int = 32

    def __post_init__(self) -> None:
        if self.tile < 16 or self.overlap < 0:
            raise ValueError(f"tile must be at least 16 and overlap at least 0, got {self.tile} and {self.overlap}")


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as (1, 3, H, W) float32 in [0, 1], the range spandrel's models take."""
    return _region(np.asarray(image.convert("RGB")), slice(None), slice(None))


def eight_bit(pixels: torch.Tensor) -> torch.Tensor:
    """(1, 3, h, w) in [0, 1], any device and dtype -> (h, w, 3) uint8 on the CPU, rounded to nearest (in
    float32, as diffusers' `numpy_to_pil` and the old whole-image path round: the same bytes)."""
    return (pixels[0].float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu()


def to_image(tensor: torch.Tensor) -> Image.Image:
    """(1, 3, H, W) in [0, 1] back to an 8-bit RGB image (rounded to nearest)."""
    return Image.fromarray(eight_bit(tensor).contiguous().numpy(), "RGB")


def _spans(length: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile, length)) for start in range(0, length, tile)]


def tiled(height: int, width: int, run: RunRegion, scale: int, tiling: Tiling, on_tile: OnTile) -> Image.Image:
    """`run` over the tiles of a `height` x `width` source, each with its context; each core, in 8 bits,
    pasted into the (width*scale) x (height*scale) RGB result as soon as it is made."""
    out = Image.new("RGB", (width * scale, height * scale))
    tiles = [(y, x) for y in _spans(height, tiling.tile) for x in _spans(width, tiling.tile)]
    for done, ((y0, y1), (x0, x1)) in enumerate(tiles):
        if on_tile(done, len(tiles)):
            raise UpscaleStopped
        top, left = max(0, y0 - tiling.overlap), max(0, x0 - tiling.overlap)
        bottom, right = min(height, y1 + tiling.overlap), min(width, x1 + tiling.overlap)
        result = run(slice(top, bottom), slice(left, right))
        core = result[:, :, (y0 - top) * scale:(y1 - top) * scale, (x0 - left) * scale:(x1 - left) * scale]
        out.paste(Image.fromarray(eight_bit(core).contiguous().numpy(), "RGB"), (x0 * scale, y0 * scale))
        del result, core  # the next tile's activations take the room
    on_tile(len(tiles), len(tiles))
    return out


def upscale_tiled(image: Image.Image, run: RunTile, scale: int, tiling: Tiling, on_tile: OnTile) -> Image.Image:
    """`run` over the tiles of `image`, each tile's input read from its 8-bit pixels as it is run."""
    source = np.asarray(image.convert("RGB"))
    return tiled(image.height, image.width, lambda rows, cols: run(_region(source, rows, cols)), scale, tiling, on_tile)


def _region(source: np.ndarray, rows: slice, cols: slice) -> torch.Tensor:
    """A region of 8-bit RGB pixels as `to_tensor` gives it: (1, 3, h, w) float32 in [0, 1]."""
    array = source[rows, cols].astype(np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).unsqueeze(0).contiguous()


def upscale_by(image: Image.Image, factor: float, run: RunTile, scale: int, tiling: Tiling,
               on_pass: Callable[[int], OnTile]) -> Image.Image:
    """A1111's `Upscaler.upscale`: the target is the size × `factor` rounded down to a multiple of 8;
    the model (of fixed `scale`) runs until the image reaches it (at most `MAX_PASSES` times, once even
    at `factor` 1 for a restoration model) and Lanczos brings it to the target. `on_pass(i)` gives the
    tile callback of pass i."""
    target = (int(image.width * factor) // 8 * 8, int(image.height * factor) // 8 * 8)
    for i in range(MAX_PASSES):
        if image.width >= target[0] and image.height >= target[1] and factor != 1:
            break
        before = image.size
        image = upscale_tiled(image, run, scale, tiling, on_pass(i))
        if image.size == before:
            break
    return image if image.size == target else image.resize(target, Image.Resampling.LANCZOS)
