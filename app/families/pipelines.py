"""The base classes a family's pipelines build on, and the pieces several families share.

Why here, in `app/families/`: a family file imports only from this package (a test holds it to that), so a
new family needs no engine module to read or edit, and the engine reads what it needs from these classes.

`EnginePipeline` comes first among a pipeline class's bases: an execution device and compute dtypes the engine
states. diffusers infers where to create latents and prompt embeddings from accelerate hooks or from the first
component's device; under our own offload hooks every component rests on the CPU between forwards, so that
inference would say "cpu" and the first CUDA forward would meet CPU inputs. The engine sets `execution_device`
from the placement plan instead, and `compute_dtypes` (what each component computes in, which a resting dtype
need not be).

A family's pipeline classes (txt2img and the img2img/inpaint stage pipelines of `app/engine/stages.py`) live in
its own file: each is `class Mine(EnginePipeline, diffusers.SomePipeline)`. Stage pipelines are built on the
loaded pipeline's own component objects (never a copy, never a cast) and handed the latents the engine encoded
itself, so diffusers' own VAE encode (which casts the SDXL VAE in place) never runs; `StrengthSteps` gives them
the step rule the engine announces.

`spatial_latents` gives the denoised latents as (batch, channels, h, w), the shape the VAE and the live preview
read; a family whose pipeline denoises another shape overrides it, with `latent_grid` and `pack_noise`
(`PackedPatches`: FLUX.1's 2×2 patches, which Z-Image's pipelines share). A family's txt2img class also mixes in
`VariedNoise` (A1111's variation seeds for its first noise, `app/engine/variation.py`), which reads those two.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from diffusers import StableDiffusionImg2ImgPipeline


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


class PackedPatches(EnginePipeline):
    """A pipeline denoising 2×2 latent patches packed into a sequence (FluxPipeline's rule)."""

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Unpack the (batch, h/2·w/2, 4·channels) sequence of 2×2 patches (FluxPipeline's own rule)."""
        return self._unpack_latents(latents, height, width, self.vae_scale_factor)

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """FluxPipeline's rule: whole 2×2 patches of latents."""
        patch = self.vae_scale_factor * 2
        return 2 * (int(height) // patch), 2 * (int(width) // patch)

    def pack_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """Spatial noise packed into the sequence of 2×2 patches the transformer denoises."""
        return self._pack_latents(noise, *noise.shape)


class StrengthSteps:
    """Mixed into a stage pipeline (img2img, inpaint, a control img2img): it runs int(steps × strength) steps, as
    SD's pipelines and A1111 do and as the engine announces (`stage_params`: progress, the NaN check). diffusers'
    flow-matching stage pipelines (FLUX.1, FLUX.2 Klein, Z-Image) skip int(steps − steps × strength) steps
    instead, one step more at e.g. 3 × 0.7. SD's rule reads only the scheduler, so it serves flow matching as it is."""

    get_timesteps = StableDiffusionImg2ImgPipeline.get_timesteps


class VariedNoise:
    """Mixed into our txt2img pipelines: while `drawing_with` holds a `Variation`, the first noise
    follows it. `latent_grid` and `pack_noise` come from the pipeline class (Flux packs patches)."""

    variation = None  # an `app.engine.variation.Variation` while `drawing_with` holds one

    def prepare_latents(self, batch_size, num_channels_latents, height, width, dtype, device, generator,
                        latents=None):
        if latents is None and self.variation is not None:
            shape = (batch_size, num_channels_latents, *self.latent_grid(height, width))
            latents = self.pack_noise(self.variation.noise(shape, self.latent_grid, dtype, device, generator))
        return super().prepare_latents(batch_size, num_channels_latents, height, width, dtype, device, generator,
                                       latents)


def declared_repeated_blocks(denoiser: torch.nn.Module) -> tuple[str, ...]:
    """The block classes a diffusers model declares as repeated (`_repeated_blocks`), for `Family.compile_regions`."""
    return tuple(getattr(denoiser, "_repeated_blocks", None) or ())
