"""Tiling (A1111's `tiling`): images that repeat seamlessly, by circular padding on the model's convolutions.

A convolution padded circularly sees the opposite edge beyond each border, so the denoiser draws a picture whose
right edge continues its left one and the VAE decodes it without a seam, which is how A1111 and Forge tile. Only
`padding_mode` changes (no tensor is touched, so placement and LoRA backups are as they were), for one job: it
is set on the family's `conv_components` and put back afterwards, also when the job fails, so the next job draws
exactly as before. A DiT's transformer has no convolution: there only its VAE wraps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def _padded_convs(pipe, components: tuple[str, ...]) -> list[nn.Conv2d]:
    convs = []
    for name in components:
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            convs += [m for m in module.modules() if isinstance(m, nn.Conv2d) and any(m.padding)]
    return convs


@contextlib.contextmanager
def tiled(pipe, components: tuple[str, ...], on: bool) -> Iterator[int]:
    """With `on`, circular padding on every padded 2-D convolution of `pipe`'s `components` inside the block
    (yields how many were set); each gets its own padding mode back on the way out."""
    convs = _padded_convs(pipe, components) if on else []
    before = [conv.padding_mode for conv in convs]
    try:
        for conv in convs:
            conv.padding_mode = "circular"
        yield len(convs)
    finally:
        for conv, mode in zip(convs, before, strict=True):
            conv.padding_mode = mode
