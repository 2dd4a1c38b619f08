"""Pixel-space steps of img2img and inpaint: resize modes, the mask, masked-content fill, overlay.

Why here and not in diffusers' image processor: A1111's three resize modes and its masked-content
"fill" have no diffusers equivalent, and doing the pixel work ourselves means the pipelines only
ever receive latents we encoded (see `app.engine.stages`). Everything is plain PIL/NumPy on the
CPU and deterministic: the same inputs give the same pixels.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageOps

RESAMPLE = Image.Resampling.LANCZOS
# Blur radii of the masked-content "fill", coarse to fine: each finer pass overwrites the estimate
# wherever enough unmasked pixels lie within its radius.
_FILL_RADII = (128, 32, 8, 2)
_FILL_MIN_WEIGHT = 0.05


def resize(image: Image.Image, width: int, height: int, mode: str) -> Image.Image:
    """A1111's resize modes: "just resize" stretches; "crop and resize" scales to cover and crops
    the centre; "resize and fill" scales to fit, centres, and fills the empty bands by stretching the
    picture's own edge rows or columns."""
    if mode == "just resize":
        return image.resize((width, height), RESAMPLE)
    ratio = width / height
    src_ratio = image.width / image.height
    cover = mode == "crop and resize"
    wider = ratio > src_ratio
    scaled_w = width if wider == cover else max(1, round(image.width * height / image.height))
    scaled_h = height if wider != cover else max(1, round(image.height * width / image.width))
    scaled = image.resize((scaled_w, scaled_h), RESAMPLE)
    left, top = (width - scaled_w) // 2, (height - scaled_h) // 2
    if cover:
        return scaled.crop((-left, -top, -left + width, -top + height))
    canvas = Image.new(image.mode, (width, height))
    canvas.paste(scaled, (left, top))
    if top > 0:
        canvas.paste(scaled.crop((0, 0, scaled_w, 1)).resize((scaled_w, top)), (left, 0))
        bottom = height - top - scaled_h
        canvas.paste(scaled.crop((0, scaled_h - 1, scaled_w, scaled_h)).resize((scaled_w, bottom)),
                     (left, top + scaled_h))
    elif left > 0:
        canvas.paste(scaled.crop((0, 0, 1, scaled_h)).resize((left, scaled_h)), (0, top))
        right = width - left - scaled_w
        canvas.paste(scaled.crop((scaled_w - 1, 0, scaled_w, scaled_h)).resize((right, scaled_h)),
                     (left + scaled_w, top))
    return canvas


def prepare_mask(mask: Image.Image, width: int, height: int, resize_mode: str, blur: int, invert: bool) -> Image.Image:
    """The mask as A1111 uses it: greyscale (an alpha channel, if the editor drew on one, counts as
    painted), inverted on request, resized like the image, then blurred by `blur` pixels."""
    grey = _painted(mask)
    if invert:
        grey = ImageOps.invert(grey)
    grey = resize(grey, width, height, resize_mode)
    return grey.filter(ImageFilter.GaussianBlur(blur)) if blur else grey


def _painted(mask: Image.Image) -> Image.Image:
    """White where the user painted. A layer drawn in an image editor is transparent where nothing was
    drawn, so there the alpha channel is the mask; a plain black-and-white upload is its luminance."""
    if mask.mode in ("RGBA", "LA") and mask.getchannel("A").getextrema()[0] < 255:
        return mask.getchannel("A")
    return mask.convert("L")


def check_mask(mask: Image.Image) -> None:
    """A mask with nothing painted would repaint nothing: refused, so no time is spent on it."""
    if mask.getextrema()[1] < 128:
        raise ValueError("the mask is empty: paint (white) the area to repaint, or upload a mask with white in it")


def fill(image: Image.Image, mask: Image.Image) -> Image.Image:
    """A1111's masked content "fill": the masked area takes the colours around it (normalised
    blurs of the unmasked pixels at shrinking radii), so the repaint starts from a smooth guess
    instead of the old content."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    keep = (np.asarray(mask, dtype=np.float32) < 128).astype(np.float32)
    if not keep.any():
        return Image.new("RGB", image.size, (127, 127, 127))
    estimate = np.broadcast_to(pixels[keep > 0].mean(axis=0), pixels.shape).copy()
    for radius in _FILL_RADII:
        weight = _blur(keep, radius)
        colour = np.stack([_blur(pixels[..., c] * keep, radius) for c in range(3)], axis=-1)
        known = weight > _FILL_MIN_WEIGHT
        estimate[known] = colour[known] / weight[known, None]
    out = np.where(keep[..., None] > 0, pixels, estimate)
    return Image.fromarray(np.clip(out + 0.5, 0, 255).astype(np.uint8))


def _blur(channel: np.ndarray, radius: int) -> np.ndarray:
    """A wide, cheap blur of one float channel: area-average down by `radius`, bilinear back up (a
    Gaussian of radius 128 on a 2048² image would take seconds; this takes milliseconds)."""
    plane = torch.from_numpy(np.ascontiguousarray(channel))[None, None]
    small = (max(1, plane.shape[2] // radius), max(1, plane.shape[3] // radius))
    down = torch.nn.functional.interpolate(plane, size=small, mode="area")
    up = torch.nn.functional.interpolate(down, size=plane.shape[2:], mode="bilinear", align_corners=False)
    return up[0, 0].numpy()


def overlay(generated: Image.Image, original: Image.Image, mask: Image.Image) -> Image.Image:
    """Paste the repainted image over the original through the blurred mask, as A1111 does, so
    pixels outside the mask are the original's exactly (a VAE round trip would shift them)."""
    return Image.composite(generated.convert("RGB"), original.convert("RGB"), mask)


def to_tensor(images: list[Image.Image]) -> torch.Tensor:
    """PIL images -> a float32 CPU batch in [-1, 1], (B, 3, H, W), as the VAE encoder takes it."""
    arrays = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) / 127.5 - 1.0 for im in images])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()


def latent_mask(mask: Image.Image, latent_hw: tuple[int, int]) -> torch.Tensor:
    """The mask at latent size, rounded to 0/1 (A1111's default), (1, 1, h, w) float32 on the CPU."""
    small = mask.resize((latent_hw[1], latent_hw[0]), Image.Resampling.BILINEAR)
    values = np.round(np.asarray(small, dtype=np.float32) / 255.0)
    return torch.from_numpy(values)[None, None]
