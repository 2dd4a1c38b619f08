"""Our pipeline classes: diffusers' SD1.5/SDXL/Flux pipelines with an execution device the engine states.

diffusers infers where to create latents and prompt embeddings from accelerate hooks or from
the first component's device. Under our own offload hooks every component rests on the CPU
between forwards, so that inference would say "cpu" and the first CUDA forward would meet CPU
inputs. The engine sets `execution_device` from the placement plan instead, and `compute_dtypes`
(what each component computes in, which a resting dtype need not be).

The img2img and inpaint classes are the stage pipelines of `app/engine/stages.py`: built on the
loaded pipeline's own component objects (never a copy, never a cast), handed the latents the
engine encoded itself, so diffusers' own VAE encode (which casts the SDXL VAE in place) never runs.

`spatial_latents` gives the denoised latents as (batch, channels, h, w), the shape the VAE and
the live preview read: Flux denoises 2×2 patches packed into a sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from diffusers import (
    FluxPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
)


class _StatedExecutionDevice:
    execution_device: torch.device | None = None
    # The dtype each component computes in, by name; may differ from the dtype its weights rest in.
    compute_dtypes: Mapping[str, torch.dtype] = MappingProxyType({})
    family = None  # the `app.families.Family` it was loaded as (set by `models.load_pipeline`)

    @property
    def _execution_device(self) -> torch.device:
        if self.execution_device is not None:
            return self.execution_device
        return super()._execution_device

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """SD pipelines denoise spatial latents already."""
        return latents


class SteadySDPipeline(_StatedExecutionDevice, StableDiffusionPipeline):
    """SD1.5 pipeline whose execution device is set by the engine."""


class SteadySDXLPipeline(_StatedExecutionDevice, StableDiffusionXLPipeline):
    """SDXL pipeline whose execution device is set by the engine."""



class SteadySDImg2ImgPipeline(_StatedExecutionDevice, StableDiffusionImg2ImgPipeline):
    """SD1.5 img2img (and hires fix second pass) stage pipeline."""


class SteadySDInpaintPipeline(_StatedExecutionDevice, StableDiffusionInpaintPipeline):
    """SD1.5 inpaint stage pipeline (4- or 9-channel UNet)."""


class SteadySDXLImg2ImgPipeline(_StatedExecutionDevice, StableDiffusionXLImg2ImgPipeline):
    """SDXL img2img (and hires fix second pass) stage pipeline."""


class SteadySDXLInpaintPipeline(_StatedExecutionDevice, StableDiffusionXLInpaintPipeline):
    """SDXL inpaint stage pipeline (4- or 9-channel UNet)."""


class SteadyFluxPipeline(_StatedExecutionDevice, FluxPipeline):
    """FLUX.1 pipeline whose execution device is set by the engine."""

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Unpack the (batch, h/2·w/2, 4·channels) sequence of 2×2 patches (FluxPipeline's own rule)."""
        return self._unpack_latents(latents, height, width, self.vae_scale_factor)
