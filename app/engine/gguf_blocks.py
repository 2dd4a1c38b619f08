"""GGUF's block formats in torch: which quant types are read, their block sizes, their dequantisation.

Why diffusers' functions: `diffusers.quantizers.gguf.utils` holds torch ports of ggml's block
formulas (city96's, from ComfyUI-GGUF) for every type listed here. Run in float32 they give the same
values bit for bit as the `gguf` package's numpy reference (`gguf.quants.dequantize`; checked per
type in tests/test_gguf.py), and they run on whatever device the packed bytes are on, so a layer is
widened on the compute device from the bytes that were streamed to it. The result is rounded once
to the compute dtype.

F16, BF16 and F32 tensors are not packed: the loader reads them as ordinary tensors (app/gguf_files.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import gguf
import torch

from app.adapters.layer_ops import weight_shape


def block_of(name: str) -> tuple[int, int]:
    """(weights, bytes) of one block of quant type `name`."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


@functools.cache
def _kernels() -> dict:
    from diffusers.quantizers.gguf.utils import dequantize_functions

    return dequantize_functions


def kernel(name: str) -> Callable[..., torch.Tensor]:
    """The float32 dequantisation of quant type `name`: (blocks (n, bytes per block), block, type size) ->
    values (n, block)."""
    qtype = gguf.GGMLQuantizationType[name]
    dequantise = _kernels()[qtype]
    return lambda blocks, block, type_size: dequantise(blocks, block, type_size, dtype=torch.float32)


def dequant(name: str) -> Callable[[torch.nn.Module, torch.Tensor, torch.dtype], torch.Tensor]:
    """The `quant.dequant` widening of quant type `name`: (layer, packed rows (out, bytes per row),
    compute dtype) -> the weight in its true shape (the layer's own: `weight_shape`)."""
    block, type_size = block_of(name)
    widen_blocks = kernel(name)

    def widen(module: torch.nn.Module, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return widen_blocks(packed.reshape(-1, type_size), block, type_size).reshape(weight_shape(module)).to(dtype)

    return widen


def reference(packed, name: str):
    """The `gguf` package's own numpy dequantisation (float32) of packed rows: what tests compare to."""
    return gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[name])
