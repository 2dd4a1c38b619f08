"""The denoiser of any family (SD's UNet, a DiT's transformer) as the benchmark sees it: which
component it is, one call's inputs at a given size, and that call's FLOPs.

Why one module: the timing hooks, the op counts and the TFLOP per step all wrap "one denoiser
call". What that call takes differs by family (a UNet reads a spatial latent and CLIP states, a DiT
patches as a sequence; some run the CFG-doubled batch), so the family states it
(`TestKit.bench.call_inputs`) and this module only builds the meta model and counts.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from app.families import family, family_of
from benchmarks.config import runs_cfg


def denoiser_of(pipe) -> torch.nn.Module:
    """The pipeline's denoising component (`unet`, or `transformer` for DiTs): where step hooks go."""
    return getattr(pipe, family_of(pipe).denoiser)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build models directly in `dtype`: a float32 build cast afterwards would first need float32's
    memory (Flux's 17 B parameters: 67 GB) and makes diffusers warn about every cast model."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def meta_denoiser(family_name: str, config: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The family's denoiser built from `config` on the meta device in `dtype`: exact shapes, no memory."""
    with torch.device("meta"), default_dtype(dtype):
        return family(family_name).denoiser_class.from_config(config)


def rows_per_call(family_name: str, batch: int) -> int:
    """Images' rows in one denoiser call: doubled where CFG runs an unconditional pass."""
    return 2 * batch if runs_cfg(family_name) else batch


def call_inputs(family_name: str, denoiser: torch.nn.Module, batch: int, latent_side: int) -> dict:
    """Keyword arguments of one call of a meta `denoiser` for `batch` images at `latent_side`² latent
    pixels, in its dtype (empty tensors: the values do not matter to op counts or FLOPs)."""
    rows, cfg, dtype = rows_per_call(family_name, batch), denoiser.config, denoiser.dtype

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="meta", dtype=dtype)

    return family(family_name).test_kit.bench.call_inputs(family(family_name), cfg, rows, latent_side, empty)


def tflop_per_step(family_name: str, config: dict, batch: int, latent_side: int) -> float:
    """TFLOP of one denoising step (one denoiser call, on the CFG-doubled batch where the family
    uses CFG), counted by torch's FlopCounterMode on a meta-device copy: exact for the shapes, costs
    no memory and needs no GPU."""
    denoiser = meta_denoiser(family_name, config)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        denoiser(**call_inputs(family_name, denoiser, batch, latent_side))
    return counter.get_total_flops() / 1e12
