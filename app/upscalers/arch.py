"""What spandrel makes of an upscaler file, and the dtype it runs in.

spandrel recognises the architecture (ESRGAN/RRDBNet, RealESRGAN's compact SRVGG, SwinIR, DAT, HAT,
…) from the tensors' names and shapes and declares per architecture whether it runs in fp16 and in
bf16 (some overflow or miss kernels in half precision). Only image-to-image models that enlarge or
restore a whole picture are upscalers here: inpainting and face-restoration models are refused.
"""

from __future__ import annotations

import spandrel
import torch

PURPOSES = ("SR", "Restoration")  # spandrel's purposes of models that enlarge or clean a whole image


class UpscalerFormatError(ValueError):
    """The tensors are not an upscaler spandrel can build; the message names the file and says why."""


def build(state_dict: dict[str, torch.Tensor], label: str, registry=spandrel.MAIN_REGISTRY):
    """What `registry` builds from the tensors, or `UpscalerFormatError` starting with `label` ("upscaler 'x'")."""
    try:
        return registry.load(state_dict)
    except spandrel.UnsupportedModelError:
        raise UpscalerFormatError(f"{label}: spandrel recognises no architecture in these tensors "
                                  f"({len(state_dict)} tensors, e.g. {next(iter(state_dict), 'none')})") from None
    except (KeyError, ValueError, RuntimeError, AssertionError, TypeError, IndexError) as exc:
        raise UpscalerFormatError(f"{label}: its tensors do not build the architecture they resemble "
                                  f"({type(exc).__name__}: {exc})") from None


def describe(state_dict: dict[str, torch.Tensor], name: str):
    """spandrel's `ImageModelDescriptor` for the tensors (the model on the CPU, in eval mode, weights
    loaded as stored), or `UpscalerFormatError`."""
    descriptor = build(state_dict, f"upscaler {name!r}")
    purpose = getattr(descriptor, "purpose", None)
    if not isinstance(descriptor, spandrel.ImageModelDescriptor) or purpose not in PURPOSES:
        raise UpscalerFormatError(f"upscaler {name!r}: a {descriptor.architecture.name} model for {purpose}, "
                                  "not an upscaler")
    if (descriptor.input_channels, descriptor.output_channels) != (3, 3):
        raise UpscalerFormatError(f"upscaler {name!r}: takes {descriptor.input_channels} and gives "
                                  f"{descriptor.output_channels} channels; only RGB models are supported")
    descriptor.model.eval().requires_grad_(False)
    return descriptor


def compute_dtype(descriptor, wanted: torch.dtype) -> torch.dtype:
    """The engine's compute dtype where the architecture declares it runs in it, else float32."""
    if wanted == torch.float16 and descriptor.supports_half:
        return wanted
    if wanted == torch.bfloat16 and descriptor.supports_bfloat16:
        return wanted
    return torch.float32
