"""Live preview: latents -> a rough RGB picture by a fixed linear map, cheap enough for every few steps.

A family's latent channels map to RGB through a (channels × 3) matrix plus a bias. Where a latent
space has published factors (`LatentFormat.preview_rgb`: the figures ComfyUI publishes for its
latent previews, `comfy/latent_formats.py`) those are used. Where none exist (a new VAE's),
the factors are fitted from the loaded VAE itself (`calibration_pictures`, `fit`): the engine
encodes a fixed set of synthetic colour pictures once per loaded model, at its first previewed pass,
and a least-squares fit with a bias maps those latents to the pictures' colours. Why a fit and not
someone's numbers: it needs nothing but the VAE in hand, so every latent space gets a preview, and
its error on the calibration colours is measured and logged (`PreviewFit.rms_levels`). The picture has
one pixel per latent pixel (1/8 or 1/16 of the image side); the page scales it up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from app.families import PreviewFactors

CALIBRATION_SIDE = 16  # latent pixels per side of a calibration picture (256 samples each)
BLOCK = 1  # latent pixels per side of one flat colour block
LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the RGB lattice every fit sees: its 125 colours, greys and primaries


@dataclass(frozen=True)
class PreviewFit:
    """Factors fitted from a VAE, and how well they reproduce the calibration colours (8-bit levels over every
    latent pixel of the calibration pictures: root mean square and the worst pixel)."""

    factors: PreviewFactors
    rms_levels: float
    max_levels: float


def calibration_pictures(scale: int) -> list[Image.Image]:
    """Two fixed RGB pictures of `CALIBRATION_SIDE`² latent pixels for a VAE of `scale` pixels per latent pixel:
    flat blocks of the 125 lattice colours and 131 seeded random ones (shuffled by a fixed seed), and smooth
    ramps (red across, green down, blue along the diagonal) for the colour mixtures real pictures hold."""
    rng = np.random.default_rng(0)
    lattice = np.array([(r, g, b) for r in LEVELS for g in LEVELS for b in LEVELS])
    blocks = (CALIBRATION_SIDE // BLOCK) ** 2
    colours = np.concatenate([lattice, rng.random((blocks - len(lattice), 3))])[rng.permutation(blocks)]
    grid = colours.reshape(CALIBRATION_SIDE // BLOCK, CALIBRATION_SIDE // BLOCK, 3)
    flat = grid.repeat(BLOCK * scale, axis=0).repeat(BLOCK * scale, axis=1)
    ramp = np.linspace(0.0, 1.0, CALIBRATION_SIDE * scale)
    across, down = np.meshgrid(ramp, ramp)
    smooth = np.stack([across, down, 1 - (across + down) / 2], axis=-1)
    return [Image.fromarray(np.round(p * 255).astype(np.uint8), "RGB") for p in (flat, smooth)]


def target_colours(pictures: list[Image.Image], scale: int) -> torch.Tensor:
    """What each latent pixel of `pictures` should preview as: the mean colour of the pixels it stands for, in
    [-1, 1], (pictures · rows · columns, 3)."""
    pixels = torch.stack([torch.from_numpy(np.asarray(p, dtype=np.float64) / 127.5 - 1) for p in pictures])
    pooled = torch.nn.functional.avg_pool2d(pixels.permute(0, 3, 1, 2), scale)
    return pooled.permute(0, 2, 3, 1).reshape(-1, 3)


def fit(latents: torch.Tensor, pictures: list[Image.Image], scale: int) -> PreviewFit:
    """Least-squares factors and bias from the latents of `pictures` ((batch, channels, h, w), as the denoiser
    sees them) to their colours, in float64 on the CPU (256 rows per picture; a channel the pictures never
    move gets the minimum-norm zero)."""
    samples = latents.detach().to("cpu", torch.float64).permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    design = torch.cat([samples, torch.ones(len(samples), 1, dtype=torch.float64)], dim=1)
    targets = target_colours(pictures, scale)
    solution = torch.linalg.lstsq(design, targets, driver="gelsd").solution
    errors = (design @ solution - targets).mul(127.5)
    factors = tuple(tuple(row) for row in solution[:-1].tolist())
    return PreviewFit((factors, tuple(solution[-1].tolist())), errors.pow(2).mean().sqrt().item(),
                      errors.abs().max().item())


def preview_pixels(latents: torch.Tensor, preview_rgb: PreviewFactors) -> torch.Tensor:
    """The (batch, h, w, 3) uint8 pictures of a (batch, channels, h, w) latent tensor, any float dtype,
    computed where the latents are: only this small result goes to the host (`pictures`)."""
    factors, bias = preview_rgb
    if latents.ndim != 4 or latents.shape[1] != len(factors):
        raise ValueError(f"expected latents shaped (batch, {len(factors)}, h, w), got {tuple(latents.shape)}")
    weight = torch.tensor(factors, dtype=torch.float32, device=latents.device)
    offset = torch.tensor(bias, dtype=torch.float32, device=latents.device)
    rgb = torch.einsum("bchw,cr->bhwr", latents.detach().float(), weight) + offset
    return ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8)


def pictures(pixels: torch.Tensor) -> list[Image.Image]:
    """One RGB picture per frame of `preview_pixels`' result, once it is on the host."""
    return [Image.fromarray(frame.numpy(), "RGB") for frame in pixels.cpu()]
