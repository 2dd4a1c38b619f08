"""Our pipeline classes: diffusers' SD1.5/SDXL/Flux pipelines with an execution device the engine states.

diffusers infers where to create latents and prompt embeddings from accelerate hooks or from
the first component's device. Under our own offload hooks every component rests on the CPU
between forwards, so that inference would say "cpu" and the first CUDA forward would meet CPU
inputs. The engine sets `execution_device` from the placement plan instead, and `compute_dtypes`
(what each component computes in, which a resting dtype need not be).

The img2img and inpaint classes are the stage pipelines of `app/engine/stages.py`: built on the
loaded pipeline's own component objects (never a copy, never a cast), handed the latents the
engine encoded itself, so diffusers' own VAE encode (which casts the SDXL VAE in place) never runs.
Flux's stage pipelines take SD's step count for a strength (see `_FluxStage`).

`spatial_latents` gives the denoised latents as (batch, channels, h, w), the shape the VAE and
the live preview read: Flux denoises 2×2 patches packed into a sequence. The txt2img classes take
A1111's variation seeds for their first noise (`VariedNoise`), which reads `latent_grid` and
`pack_noise` of each class.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from diffusers import (
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    FluxPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
)

from app.engine.variation import VariedNoise


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

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of the latents of an image of `height` × `width` pixels (the pipeline's rule)."""
        return int(height) // self.vae_scale_factor, int(width) // self.vae_scale_factor

    def pack_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """Spatial noise in the layout the pipeline denoises: SD's is spatial."""
        return noise


class SteadySDPipeline(_StatedExecutionDevice, VariedNoise, StableDiffusionPipeline):
    """SD1.5 pipeline whose execution device is set by the engine."""


class SteadySDXLPipeline(_StatedExecutionDevice, VariedNoise, StableDiffusionXLPipeline):
    """SDXL pipeline whose execution device is set by the engine."""


class SteadySDImg2ImgPipeline(_StatedExecutionDevice, StableDiffusionImg2ImgPipeline):
    """SD1.5 img2img (and hires fix second pass) stage pipeline."""


class SteadySDInpaintPipeline(_StatedExecutionDevice, StableDiffusionInpaintPipeline):
    """SD1.5 inpaint stage pipeline (4- or 9-channel UNet)."""


class SteadySDXLImg2ImgPipeline(_StatedExecutionDevice, StableDiffusionXLImg2ImgPipeline):
    """SDXL img2img (and hires fix second pass) stage pipeline."""


class SteadySDXLInpaintPipeline(_StatedExecutionDevice, StableDiffusionXLInpaintPipeline):
    """SDXL inpaint stage pipeline (4- or 9-channel UNet)."""


class _PackedPatches(_StatedExecutionDevice):
    """Flux pipelines denoise 2×2 latent patches packed into a sequence."""

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Unpack the (batch, h/2·w/2, 4·channels) sequence of 2×2 patches (FluxPipeline's own rule)."""
        return self._unpack_latents(latents, height, width, self.vae_scale_factor)

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """FluxPipeline's rule: whole 2×2 patches of latents."""
        patch = self.vae_scale_factor * 2
        return 2 * (int(height) // patch), 2 * (int(width) // patch)

    def pack_noise(self, noise: torch.Tensor) -> torch.Tensor:
        return self._pack_latents(noise, *noise.shape)


class SteadyFluxPipeline(_PackedPatches, VariedNoise, FluxPipeline):
    """FLUX.1 pipeline whose execution device is set by the engine."""


class _FluxStage(_PackedPatches):
    """Flux's img2img and inpaint run int(steps × strength) steps, as SD's pipelines and A1111 do and
    as the engine announces (`stage_params`: progress, the NaN check): diffusers' Flux rule skips
    int(steps − steps × strength) steps instead, one step more at e.g. 3 × 0.7. SD's rule reads
    only the scheduler, so it serves flow matching as it is."""

    get_timesteps = StableDiffusionImg2ImgPipeline.get_timesteps


class SteadyFluxImg2ImgPipeline(_FluxStage, FluxImg2ImgPipeline):
    """FLUX.1 img2img (and hires fix second pass) stage pipeline."""


class SteadyFluxInpaintPipeline(_FluxStage, FluxInpaintPipeline):
    """FLUX.1 inpaint stage pipeline (the regular transformer: the mask blends latents each step)."""
