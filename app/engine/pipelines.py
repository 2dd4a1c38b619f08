"""Our pipeline classes: diffusers' SD1.5/SDXL pipelines with an execution device the engine states.

diffusers infers where to create latents and prompt embeddings from accelerate hooks or from
the first component's device. Under our own offload hooks every component rests on the CPU
between forwards, so that inference would say "cpu" and the first CUDA forward would meet CPU
inputs. The engine sets `execution_device` from the placement plan instead, and `compute_dtypes`
(what each component computes in, which a resting dtype need not be).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline


class _StatedExecutionDevice:
    execution_device: torch.device | None = None
    # The dtype each component computes in, by name; may differ from the dtype its weights rest in.
    compute_dtypes: Mapping[str, torch.dtype] = MappingProxyType({})

    @property
    def _execution_device(self) -> torch.device:
        if self.execution_device is not None:
            return self.execution_device
        return super()._execution_device


class SteadySDPipeline(_StatedExecutionDevice, StableDiffusionPipeline):
    """SD1.5 pipeline whose execution device is set by the engine."""


class SteadySDXLPipeline(_StatedExecutionDevice, StableDiffusionXLPipeline):
    """SDXL pipeline whose execution device is set by the engine."""

