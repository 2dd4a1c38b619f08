"""A tiny random-weight upscaler in RealESRGAN's compact layout (SRVGGNetCompact, the architecture of
`realesr-general-x4v3`), written beside the demo checkpoints so Extras and the hires fix have a model
on a fresh install and in the CPU tests.

The file is plain tensors under the names and shapes RealESRGAN's own files use (`body.0.weight`, …):
writing it needs no spandrel. The architecture adds the nearest-upscaled input to what its convolutions
compute, so with small random last-layer weights the demo's result is the picture, enlarged, with a
faint texture on top: something recognisable to look at.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

DEMO_NAME = "tiny-realesrgan-x4"
DEMO_FOLDER = "RealESRGAN"
_FEATURES, _CONVS, _SCALE = 16, 2, 4


def compact_tensors(seed: int = 0, features: int = _FEATURES, convs: int = _CONVS,
                    scale: int = _SCALE) -> dict[str, torch.Tensor]:
    """SRVGGNetCompact's tensors: a first conv, `convs` hidden convs, a PReLU after each, and the last conv
    making 3 x scale² channels for the pixel shuffle. He-initialised; the last conv 100x smaller."""
    generator = torch.Generator().manual_seed(seed)

    def conv(out_ch: int, in_ch: int, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        std = gain * math.sqrt(2.0 / (in_ch * 9))
        return torch.randn(out_ch, in_ch, 3, 3, generator=generator) * std, torch.zeros(out_ch)

    tensors: dict[str, torch.Tensor] = {}
    layers = [conv(features, 3)] + [conv(features, features) for _ in range(convs)]
    for i, (weight, bias) in enumerate(layers):
        tensors[f"body.{2 * i}.weight"], tensors[f"body.{2 * i}.bias"] = weight, bias
        tensors[f"body.{2 * i + 1}.weight"] = torch.full((features,), 0.25)  # PReLU's default slope
    last = 2 * len(layers)
    tensors[f"body.{last}.weight"], tensors[f"body.{last}.bias"] = conv(3 * scale * scale, features, 0.01)
    return tensors


def write_demo_upscaler(models_dir: Path, seed: int = 0) -> Path:
    """Write `models/RealESRGAN/tiny-realesrgan-x4.safetensors`; returns its path."""
    path = models_dir / DEMO_FOLDER / f"{DEMO_NAME}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(compact_tensors(seed), str(path), metadata={"format": "pt"})
    return path
