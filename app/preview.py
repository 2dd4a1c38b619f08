"""Live preview: latents -> a rough RGB picture by a fixed linear map, cheap enough for every few steps.

A family's four latent channels map to RGB through a 4×3 matrix plus a bias, fitted once against
real VAE decodes. The figures are the ones ComfyUI publishes for its latent previews
(`comfy/latent_formats.py`, SD15 and SDXL); no model is loaded and nothing is downloaded. The
picture has one pixel per latent pixel (1/8 of the image side); the page scales it up.
"""

from __future__ import annotations

import torch
from PIL import Image

# arch -> (4×3 factors, RGB bias), applied to the latents the pipeline denoises (already scaled).
LATENT_RGB: dict[str, tuple[tuple[tuple[float, float, float], ...], tuple[float, float, float]]] = {
    "sd15": (((0.3512, 0.2297, 0.3227), (0.3250, 0.4974, 0.2350), (-0.2829, 0.1762, 0.2721),
              (-0.2120, -0.2616, -0.7177)), (0.0, 0.0, 0.0)),
    "sdxl": (((0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362),
              (-0.3165, -0.2492, -0.2188)), (0.1084, -0.0175, -0.0011)),
}


def latent_preview(latents: torch.Tensor, arch: str) -> list[Image.Image]:
    """One RGB picture per latent of a (batch, 4, h, w) tensor, any float dtype, on any device.

    The product runs where the latents are; only the small uint8 result is copied to the CPU."""
    if arch not in LATENT_RGB:
        raise ValueError(f"no preview factors for {arch!r}; known: {', '.join(LATENT_RGB)}")
    factors, bias = LATENT_RGB[arch]
    if latents.ndim != 4 or latents.shape[1] != len(factors):
        raise ValueError(f"expected latents shaped (batch, {len(factors)}, h, w), got {tuple(latents.shape)}")
    weight = torch.tensor(factors, dtype=torch.float32, device=latents.device)
    offset = torch.tensor(bias, dtype=torch.float32, device=latents.device)
    rgb = torch.einsum("bchw,cr->bhwr", latents.detach().float(), weight) + offset
    pixels = ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8).cpu()
    return [Image.fromarray(frame.numpy(), "RGB") for frame in pixels]
