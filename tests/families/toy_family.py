"""A family that exists only in the tests: SD1.5's tiny model with what no registered
family has, so the generic code a new family leans on is proven before one arrives.

* `context_in`, a ModuleDict whose Linear is called by key (Z-Image's `all_x_embedder`): its own
  forward never runs, so `group` offload must hook its elements, not it;
* `pad`, a tensor the denoiser owns itself (Z-Image's pad tokens): streamed around the
  denoiser's own forward under `group` offload;
* `rope.inv_freq`, a buffer computed in fp32 and pinned there (`Precision.pinned_dtypes`), as
  transformers keeps a RoPE text encoder's on a bf16 load;
* `gain.scale`, an unpinned floating buffer its own forward reads (a norm's statistics): it must be
  streamed in for compute like a parameter, or the strict forward names it;
* `noise_gain`, an unpinned floating buffer the pipeline reads outside any forward (FLUX.2 Klein's VAE
  `bn` statistics): no forward hook ever sees it, only the placement of the whole component;
* no stage pipelines: img2img and inpaint are refused by name;
* a text encoder that never appears in a single file, a LoRA prefix or an embedding (its optional names
  left None), and a single file of it (its marker) refused as folder-only.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from diffusers import ModelMixin, StableDiffusionPipeline, UNet2DConditionModel

from app.families import check_contract, family
from app.families.pipelines import EnginePipeline, VariedNoise

NAME = "toy"
# A folder's model_index.json names ToyUNet's module as its library; diffusers finds how to load a
# class from a library by looking the base classes it knows up in that module, ModelMixin among them.
__all__ = ["ModelMixin", "NAME", "ToyPipeline", "ToyUNet", "toy_family"]


class ToyRope(torch.nn.Module):
    """Rotary-style frequencies: a non-persistent buffer computed in fp32 at construction."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** exponents), persistent=False)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(context.shape[1], device=context.device, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]  # in fp32 whatever the model computes in
        return torch.cat([angles.cos(), angles.sin()], dim=-1).to(context.dtype)


class ToyGain(torch.nn.Module):
    """A per-channel gain held as a buffer (not a parameter), computed at construction and read by its forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.8, 1.2, dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class ToyUNet(UNet2DConditionModel):
    """SD1.5's UNet reading its text context through a ModuleDict, its own pad vector, a rope and a buffer
    gain, and holding a buffer its pipeline reads (`noise_gain`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        width = self.config.cross_attention_dim
        self.context_in = torch.nn.ModuleDict({"text": torch.nn.Linear(width, width)})
        self.pad = torch.nn.Parameter(torch.full((width,), 0.01))
        self.rope = ToyRope(width)
        self.gain = ToyGain(width)
        # exact in every float dtype, so where the pipeline reads it (at rest or at compute) changes no pixel
        self.register_buffer("noise_gain", torch.tensor(1.0 + 2 ** -6), persistent=False)

    def forward(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        context = self.context_in["text"](encoder_hidden_states) + self.pad
        context = self.gain(context * (1 + self.rope(context) / math.sqrt(context.shape[-1])))
        return super().forward(sample, timestep, context, *args, **kwargs)


# diffusers builds a model from its config by the parameters of its class's __init__: state UNet2DConditionModel's.
ToyUNet.__init__.__signature__ = inspect.signature(UNet2DConditionModel.__init__)


class ToyPipeline(EnginePipeline, VariedNoise, StableDiffusionPipeline):
    """The toy family's pipeline: SD1.5's, with the toy denoiser (and variation seeds, as every txt2img class),
    scaling its initial noise by the denoiser's `noise_gain`, read outside any forward (as Klein reads its
    VAE's `bn` statistics)."""

    def prepare_latents(self, *args, **kwargs):
        latents = super().prepare_latents(*args, **kwargs)
        return latents * self.unet.noise_gain.to(latents.device, latents.dtype)


def toy_family():
    """SD1.5 with the toy denoiser, loaded from diffusers folders only; its text encoder states none of the
    optional names (no single file, kohya's positional LoRA prefix, no embeddings)."""
    sd15 = family("sd15")
    encoder = dataclasses.replace(sd15.text_encoders[0], single_file_prefix=None, lora_prefix=None,
                                  embedding_key=None)
    return check_contract(dataclasses.replace(
        sd15, name=NAME, label="Toy", pipeline_class=ToyPipeline, diffusers_pipeline="ToyPipeline",
        denoiser_class=ToyUNet, text_encoders=(encoder,), stage_pipelines={},  # txt2img only: img2img refused
        files=dataclasses.replace(sd15.files, layouts=("folder",), checkpoint_markers=("toy.only.marker",),
                                  takes_embeddings=False),
        precision=dataclasses.replace(sd15.precision, pinned_dtypes={"unet.*inv_freq": torch.float32}),
        adapters=dataclasses.replace(sd15.adapters, lora_arch=NAME, markers=("toy_v1", "toy-v1"), label="Toy"),
        test_kit=dataclasses.replace(sd15.test_kit, tiny_inpainting_channels=None,
                                     lora_targets=(*sd15.test_kit.lora_targets, "unet.context_in.text")),
        controlnet=None))  # SD1.5's ControlNets do not know the toy denoiser's extra layers
