"""A family that exists only in the tests: SD1.5's tiny model with three things no registered
family has, so the generic code a new family leans on is proven before one arrives.

* `context_in`, a ModuleDict whose Linear is called by key (Z-Image's `all_x_embedder`): its own
  forward never runs, so `group` offload must hook its elements, not it;
* `pad`, a tensor the denoiser owns itself (Z-Image's pad tokens): streamed around the
  denoiser's own forward under `group` offload;
* `rope.inv_freq`, a buffer computed in fp32 and pinned there (`Family.pinned_dtypes`), as
  transformers keeps a RoPE text encoder's on a bf16 load.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from diffusers import ModelMixin, StableDiffusionPipeline, UNet2DConditionModel

from app.engine.pipelines import EnginePipeline
from app.engine.variation import VariedNoise
from app.families import family

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


class ToyUNet(UNet2DConditionModel):
    """SD1.5's UNet reading its text context through a ModuleDict, its own pad vector and a rope."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        width = self.config.cross_attention_dim
        self.context_in = torch.nn.ModuleDict({"text": torch.nn.Linear(width, width)})
        self.pad = torch.nn.Parameter(torch.full((width,), 0.01))
        self.rope = ToyRope(width)

    def forward(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        context = self.context_in["text"](encoder_hidden_states) + self.pad
        context = context * (1 + self.rope(context) / math.sqrt(context.shape[-1]))
        return super().forward(sample, timestep, context, *args, **kwargs)


# diffusers builds a model from its config by the parameters of its class's __init__: state UNet2DConditionModel's.
ToyUNet.__init__.__signature__ = inspect.signature(UNet2DConditionModel.__init__)


class ToyPipeline(EnginePipeline, VariedNoise, StableDiffusionPipeline):
    """The toy family's pipeline: SD1.5's, with the toy denoiser (and variation seeds, as every txt2img class)."""


def toy_family():
    """SD1.5 with the toy denoiser, loaded from diffusers folders only."""
    sd15 = family("sd15")
    return dataclasses.replace(
        sd15, name=NAME, label="Toy", pipeline_class=ToyPipeline, diffusers_pipeline="ToyPipeline",
        denoiser_class=ToyUNet, layouts=("folder",), checkpoint_markers=("toy.only.marker",),
        pinned_dtypes={"unet.*inv_freq": torch.float32}, tiny_inpainting_channels=None,
        adapter_arch=NAME, adapter_markers=("toy_v1", "toy-v1"), adapter_label="Toy",
        lora_targets=(*sd15.lora_targets, "unet.context_in.text"),
        controlnet=None)  # SD1.5's ControlNets do not know the toy denoiser's extra layers
