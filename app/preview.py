"""Live preview: latents -> a rough RGB picture by a fixed linear map, cheap enough for every few steps.

A family's latent channels map to RGB through a (channels × 3) matrix plus a bias, fitted once
against real VAE decodes: `LatentFormat.preview_rgb` (the figures ComfyUI publishes for its latent
previews, `comfy/latent_formats.py`); no model is loaded and nothing is downloaded. A family
without factors has no preview. The picture has one pixel per latent pixel (1/8 of the image
side); the page scales it up.
"""

from __future__ import annotations

import torch
from PIL import Image

from app.families import family


def preview_pixels(latents: torch.Tensor, family_name: str) -> torch.Tensor:
    """The (batch, h, w, 3) uint8 pictures of a (batch, channels, h, w) latent tensor, any float dtype,
    computed where the latents are: only this small result goes to the host (`pictures`)."""
    fam = family(family_name)
    if fam.latent_format.preview_rgb is None:
        raise ValueError(f"{fam.label} has no preview factors (LatentFormat.preview_rgb)")
    factors, bias = fam.latent_format.preview_rgb
    if latents.ndim != 4 or latents.shape[1] != len(factors):
        raise ValueError(f"expected latents shaped (batch, {len(factors)}, h, w), got {tuple(latents.shape)}")
    weight = torch.tensor(factors, dtype=torch.float32, device=latents.device)
    offset = torch.tensor(bias, dtype=torch.float32, device=latents.device)
    rgb = torch.einsum("bchw,cr->bhwr", latents.detach().float(), weight) + offset
    return ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8)


def pictures(pixels: torch.Tensor) -> list[Image.Image]:
    """One RGB picture per frame of `preview_pixels`' result, once it is on the host."""
    return [Image.fromarray(frame.numpy(), "RGB") for frame in pixels.cpu()]
