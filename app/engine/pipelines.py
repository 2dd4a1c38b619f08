"""The base of every pipeline class the engine runs: an execution device and compute dtypes the engine states.

diffusers infers where to create latents and prompt embeddings from accelerate hooks or from
the first component's device. Under our own offload hooks every component rests on the CPU
between forwards, so that inference would say "cpu" and the first CUDA forward would meet CPU
inputs. The engine sets `execution_device` from the placement plan instead, and `compute_dtypes`
(what each component computes in, which a resting dtype need not be).

A family's pipeline classes (txt2img and the img2img/inpaint stage pipelines of
`app/engine/stages.py`) live in its own file under `app/families/`: each is
`class Mine(EnginePipeline, diffusers.SomePipeline)`. Stage pipelines are built on the loaded
pipeline's own component objects (never a copy, never a cast) and handed the latents the engine
encoded itself, so diffusers' own VAE encode (which casts the SDXL VAE in place) never runs.

`spatial_latents` gives the denoised latents as (batch, channels, h, w), the shape the VAE and the
live preview read; a family whose pipeline denoises another shape (Flux's packed 2×2 patches)
overrides it, with `latent_grid` and `pack_noise`. A family's txt2img class also mixes in
`app.engine.variation.VariedNoise` (A1111's variation seeds for its first noise), which reads those two.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch


class EnginePipeline:
    """Mixin, first among a pipeline class's bases: the engine states the execution device."""

    execution_device: torch.device | None = None
    # The dtype each component computes in, by name; may differ from the dtype its weights rest in.
    compute_dtypes: Mapping[str, torch.dtype] = MappingProxyType({})
    family = None  # the `app.families.Family` it was loaded as (set by `models.load_pipeline`)
    # Modules the engine attached beside the pipeline's own (the ControlNet stack, app/engine/controlnet_slot.py):
    # components like the others for placement, offload, storage, strict forwards and Diagnostics, and what a
    # control stage pipeline built on this one takes. Never in the pipeline's config: a saved pipeline is the model.
    attached: Mapping[str, torch.nn.Module] = MappingProxyType({})

    @property
    def components(self) -> dict:
        return {**super().components, **self.attached}

    def attach(self, name: str, module: torch.nn.Module | None) -> None:
        """Attach `module` as component `name` (None: detach it); the only way `attached` changes."""
        kept = {k: v for k, v in self.attached.items() if k != name}
        self.attached = MappingProxyType(kept if module is None else {**kept, name: module})
        if module is None:
            self.__dict__.pop(name, None)
        else:
            self.__dict__[name] = module  # `getattr(pipe, name)`, as for the pipeline's own components

    @property
    def _execution_device(self) -> torch.device:
        if self.execution_device is not None:
            return self.execution_device
        return super()._execution_device

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The denoised latents as (batch, channels, h, w); SD pipelines denoise them so already."""
        return latents

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of the latents of an image of `height` × `width` pixels (the pipeline's rule)."""
        return int(height) // self.vae_scale_factor, int(width) // self.vae_scale_factor

    def pack_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """Spatial noise in the layout the pipeline denoises: SD's is spatial."""
        return noise
