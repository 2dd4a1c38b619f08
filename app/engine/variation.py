"""A1111's variation seeds: a txt2img run's first noise as a slerp between the seed's noise and a
variation seed's noise, optionally drawn at another size ("Resize seed from") and pasted centred.

Why: A1111 users explore around an image they like by keeping its seed and mixing in a little of
another one (`Variation seed`, `Variation seed strength`), and they keep a composition when they
change the size by drawing the noise at the old size. The rule, as A1111's `modules/rng.py`
(`ImageRNG.first`, `slerp`) and `processing.py` define it, restated:

* with a strength above 0 every image of the request keeps the request's seed and image x (over
  the whole batch count) takes variation seed `subseed + x`; at strength 0 nothing is mixed and
  seeds advance per image as usual;
* an image's noise is slerp(strength, noise(seed), noise(variation seed)), normalised per channel
  and column along the rows (dim 1 of each (channels, rows, columns) tensor); where the two are
  nearly parallel (mean cosine above 0.9995) a plain lerp;
* with "resize seed from" W×H (both above 0) both noises are drawn at W×H's latent grid, mixed,
  and pasted centred into the seed's noise at the real size (cropped where larger).

The seed's noise is drawn from the generators the pipeline was handed, with the call the pipeline
itself makes, so the sampler's later draws (ancestral samplers) go on as without a variation, and
a strength of 1 gives the variation seed's noise exactly (the slerp's coefficients are then 0 and
1 exactly). The pipelines that take a variation are our txt2img classes (`app.families.pipelines.VariedNoise`
mixed in).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from diffusers.utils.torch_utils import randn_tensor

from app.families.pipelines import VariedNoise

NEARLY_PARALLEL = 0.9995  # A1111's threshold for falling back to a lerp
SEED_SPACE = 2**32  # seeds wrap as the generators' do (`generate.seed_generators`)
Grid = Callable[[int, int], tuple[int, int]]  # (height, width) px -> (rows, columns) of the latent grid


@dataclass(frozen=True)
class Variation:
    """One denoising run's variation: each image's variation seed, the strength, and the size the
    noise is drawn at, (width, height) in pixels ((0, 0): the image's own)."""

    subseeds: tuple[int, ...]
    strength: float
    resize_from: tuple[int, int] = (0, 0)

    def noise(self, shape: tuple[int, ...], grid: Grid, dtype: torch.dtype, device: torch.device,
              generators: list[torch.Generator]) -> torch.Tensor:
        """The first noise, spatial (batch, channels, rows, columns), drawn as the pipeline draws it."""
        base = randn_tensor(shape, generator=generators, device=device, dtype=dtype)
        width, height = self.resize_from
        if not (width > 0 and height > 0):
            return self._mixed(base, generators[0].device, device)
        small = (shape[0], shape[1], *grid(height, width))
        drawn = randn_tensor(small, generator=[_fresh(g.initial_seed(), g.device) for g in generators],
                             device=device, dtype=dtype)
        return paste_centred(self._mixed(drawn, generators[0].device, device), base)

    def _mixed(self, noise: torch.Tensor, generator_device: torch.device, device: torch.device) -> torch.Tensor:
        if not self.strength:
            return noise
        other = randn_tensor(tuple(noise.shape), generator=[_fresh(s, generator_device) for s in self.subseeds],
                             device=device, dtype=noise.dtype)
        return torch.stack([slerp(self.strength, a.float(), b.float()) for a, b in zip(noise, other, strict=True)]
                           ).to(noise.dtype)


def _fresh(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed % SEED_SPACE)


def slerp(t: float, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Spherical interpolation from `low` (t = 0) to `high` (t = 1) of one image's (channels, rows,
    columns) noise, per channel and column along the rows, as A1111 normalises it. The coefficients are
    computed before they multiply, so t = 1 returns `high` bit for bit."""
    cosine = ((low / low.norm(dim=1, keepdim=True)) * (high / high.norm(dim=1, keepdim=True))).sum(1)
    if cosine.mean() > NEARLY_PARALLEL:
        return low * (1 - t) + high * t
    omega = torch.acos(cosine)
    sine = torch.sin(omega)
    return (torch.sin((1.0 - t) * omega) / sine).unsqueeze(1) * low + (torch.sin(t * omega) / sine).unsqueeze(1) * high


def _span(big: int, small: int) -> tuple[int, int, int]:
    """(offset in the big grid, offset in the small one, length) of a centred paste along one axis; a
    small grid larger than the big one is cropped about its centre (A1111's arithmetic, odd sizes too)."""
    offset = (big - small) // 2
    if offset >= 0:
        return offset, 0, small
    return 0, -offset, small + 2 * offset


def paste_centred(small: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """`base` with `small` pasted over its centre (both (batch, channels, rows, columns))."""
    (ty, sy, rows), (tx, sx, cols) = (_span(b, s) for b, s in zip(base.shape[2:], small.shape[2:], strict=True))
    out = base.clone()
    out[:, :, ty:ty + rows, tx:tx + cols] = small[:, :, sy:sy + rows, sx:sx + cols]
    return out


# ---------------------------------------------------------------------------------- the request's side
def varies(params) -> bool:
    """Does `params` (a `GenerateParams`) mix in a variation seed? (Then every image keeps the seed.)"""
    return params.subseed_strength > 0


def resolved(params):
    """`params` with a random variation seed where it says -1 and one is mixed in (as the seed's -1)."""
    if varies(params) and params.subseed == -1:
        return dataclasses.replace(params, subseed=random.randint(0, SEED_SPACE - 1))
    return params


def for_run(params, run: int):
    """The parameters of run `run` of the batch count: its first image's variation seed is `subseed + x`
    for that image's index x over the whole request."""
    return dataclasses.replace(params, subseed=params.subseed + run * params.batch) if varies(params) else params


def without(params):
    """`params` noised from the seed alone: for a pass after the first (hires fix, refiner), whose noise
    a variation does not shape."""
    return dataclasses.replace(params, subseed_strength=0.0, seed_resize_from_w=0, seed_resize_from_h=0)


def of(params) -> Variation | None:
    """The variation a run with these (`for_run`) parameters draws its first noise with; None when plain."""
    resize = (params.seed_resize_from_w, params.seed_resize_from_h)
    if not varies(params) and not all(side > 0 for side in resize):
        return None
    subseeds = tuple(params.subseed + i for i in range(params.batch))
    return Variation(subseeds, params.subseed_strength, resize)


def subseed_of(params, index: int) -> int | None:
    """Image `index`'s variation seed in a run with these (`for_run`) parameters; None when none is mixed in."""
    return (params.subseed + index) % SEED_SPACE if varies(params) else None


def infotext_pairs(params, index: int) -> tuple[tuple[str, object], ...]:
    """The pairs A1111 writes for image `index` of a run (`for_run` parameters), only when set."""
    pairs: list[tuple[str, object]] = []
    if varies(params):
        pairs += [("Variation seed", subseed_of(params, index)),
                  ("Variation seed strength", f"{params.subseed_strength:g}")]
    if params.seed_resize_from_w > 0 and params.seed_resize_from_h > 0:
        pairs.append(("Seed resize from", f"{params.seed_resize_from_w}x{params.seed_resize_from_h}"))
    return tuple(pairs)


@contextlib.contextmanager
def drawing_with(pipe, variation: Variation | None) -> Iterator[None]:
    """`pipe` draws its first noise with `variation` for the duration; refused on a pipeline that cannot."""
    if variation is None:
        yield
        return
    if not isinstance(pipe, VariedNoise):
        raise ValueError("variation seeds and \"resize seed from\" apply to txt2img (and its hires fix's first "
                         "pass); set the variation strength to 0 and the resize sizes to 0 here")
    pipe.variation = variation
    try:
        yield
    finally:
        pipe.variation = None
