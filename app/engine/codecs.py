"""Storage codecs: how a layer's weight rests in memory, and how it is widened back for a forward.

Why one registry: fp8 casts, INT8 rows with a scale each and GGUF's packed blocks are the same idea
(fewer bytes at rest and on the bus, the compute dtype inside the forward), so they share one
`quant.dequant` hook (app/engine/storage.py), one placement rule (the resting bytes keep their own
dtype through every move), one LoRA path (a bypass forward: the stored bytes are never rewritten)
and one line in Diagnostics. A codec says what its bytes rest in (`dtype`), how many bytes a weight
costs (`bytes_per_weight`, scales included) and how the weight comes back (`dequant`).

* **fp8** (e4m3fn): a plain round-to-nearest cast on load, widened by a cast.
* **int8**: quantised on load from the file's bf16/fp16/fp32 weight, one float32 scale per output
  row (the row's largest magnitude / 127, round to nearest), held in the layer's `weight_scale`
  buffer; widened as q·scale in float32, rounded once to the compute dtype.
* **GGUF** (Q8_0 … Q2_K, from `.gguf` files, app/engine/gguf_files.py): the file's blocks as they
  are, one uint8 row of packed blocks per output row, so an offloaded layer moves ~0.28-0.53× the
  bytes of bf16. Widened with diffusers' torch ports of ggml's block formulas in float32 (bit-equal
  to `gguf.quants.dequantize`, checked in tests/test_gguf.py), then rounded once to the compute dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from app.gguf_files import PACKED

SCALE = "weight_scale"  # the per-row float32 scales of an int8 (or fp8-matmul) layer, a buffer beside its weight
INT8_MAX = 127.0
FILE_LAYERS = "file_codecs"  # a component attribute the loader sets: {module path: codec} its file holds packed
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row: its quantised values stay 0

Dequant = Callable[[torch.nn.Module, torch.Tensor, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class Codec:
    """One way to store a layer's weight. `block` is (weights, bytes) of its smallest unit: fp8 (1, 1),
    int8 (1, 1) plus a 4-byte scale per row, Q4_K (256, 144)."""

    name: str  # as settings, files and Diagnostics name it: "fp8", "int8", "gguf Q4_K"
    dtype: torch.dtype  # what the stored bytes are held in
    block: tuple[int, int]
    dequant: Dequant  # (layer, stored tensor, compute dtype) -> the weight in the compute dtype, its true shape
    row_scale: bool = False  # a float32 scale per output row rests beside the weight (`SCALE`)
    from_file: bool = False  # the file holds the weight this way (GGUF); else it is encoded on load

    @property
    def bytes_per_weight(self) -> float:
        """Bytes per weight at rest, per-row scales aside (`resting_bytes` counts those)."""
        return self.block[1] / self.block[0]

    def resting_bytes(self, shape: tuple[int, ...]) -> int:
        """What a weight of `shape` costs at rest in this codec, scales included."""
        numel = 1
        for size in shape:
            numel *= size
        scales = 4 * shape[0] if self.row_scale else 0
        return numel * self.block[1] // self.block[0] + scales


def sensitive(high_precision: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a module path lies in one of the family's high-precision layers (`Precision.high_precision`):
    they stay in the compute dtype in every codec (a GGUF file's packed ones are widened on load)."""
    if not high_precision:
        return lambda _path: False
    keep = re.compile("|".join(f"(?:^|\\.){re.escape(name)}(?:\\.|$)" for name in high_precision))
    return lambda path: keep.search(path) is not None


def _cast(_module, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return stored.to(dtype)


def _rows(module, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (stored.to(torch.float32) * module._buffers[SCALE]).to(dtype)


def quantise_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (out, …) as int8 with one float32 scale per output row, shaped (out, 1, …) to broadcast."""
    rows = weight.reshape(weight.shape[0], -1).to(torch.float32)
    amax = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, keepdim=True)
    scale = amax.clamp(min=_TINY) / INT8_MAX
    q = torch.round(rows / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(weight.shape), scale.reshape(weight.shape[0], *(1,) * (weight.dim() - 1))


FP8 = Codec("fp8", torch.float8_e4m3fn, (1, 1), _cast)
INT8 = Codec("int8", torch.int8, (1, 1), _rows, row_scale=True)


def _gguf_codecs() -> dict[str, Codec]:
    """A codec per GGUF quant type read here (the block types of city96's and llama.cpp's files)."""
    from app.engine import gguf_blocks

    return {f"gguf {name}": Codec(f"gguf {name}", torch.uint8, gguf_blocks.block_of(name), gguf_blocks.dequant(name),
                                  from_file=True)
            for name in PACKED}


# Every codec by name: fp8 first, then int8 and the GGUF block types.
CODECS: Mapping[str, Codec] = MappingProxyType({FP8.name: FP8, INT8.name: INT8, **_gguf_codecs()})
