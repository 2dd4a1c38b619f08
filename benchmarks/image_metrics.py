"""Image difference metrics for a mode that changes pixels on purpose (fp8 matmuls, step caches):
PSNR and SSIM of 8-bit RGB images, in plain torch (no scikit-image in the dependencies).

SSIM is Wang et al. 2004 as scikit-image's `structural_similarity(..., gaussian_weights=True,
sigma=1.5, use_sample_covariance=False, data_range=255)` computes it: an 11×11 Gaussian window
(σ 1.5), K1 0.01 and K2 0.03, over the window positions that fit inside the image, per channel,
averaged.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

_WINDOW, _SIGMA, _K1, _K2, _RANGE = 11, 1.5, 0.01, 0.03, 255.0


def _channels(image: np.ndarray) -> torch.Tensor:
    """(H, W, C) or (H, W) 8-bit pixels as a (C, 1, H, W) float64 tensor."""
    pixels = torch.as_tensor(np.asarray(image), dtype=torch.float64)
    pixels = pixels[..., None] if pixels.dim() == 2 else pixels
    return pixels.permute(2, 0, 1)[:, None]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB over every pixel and channel; inf for identical images."""
    mse = float(((_channels(a) - _channels(b)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(_RANGE**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean structural similarity (1.0 for identical images)."""
    x, y = _channels(a), _channels(b)
    if x.shape != y.shape or min(x.shape[-2:]) < _WINDOW:
        raise ValueError(f"SSIM needs two images of one shape, at least {_WINDOW} px a side: {x.shape} {y.shape}")
    offsets = torch.arange(_WINDOW, dtype=torch.float64) - _WINDOW // 2
    line = torch.exp(-offsets**2 / (2 * _SIGMA**2))
    line /= line.sum()
    window = (line[:, None] * line[None, :])[None, None]

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window)

    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y = blur(x * x) - mu_x**2, blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = (_K1 * _RANGE) ** 2, (_K2 * _RANGE) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return float(index.mean())
