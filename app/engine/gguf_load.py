"""A component's tensors from a `.gguf` file: packed layers kept packed, everything else as usual.

Why a reader of its own beside `file_layout.to_model`: the family's layout cuts file tensors into the
model's names by whole rows (a fused qkv into q, k and v) and reshapes them; GGUF's blocks run
along a row, so a row range of packed bytes is the packed bytes of those rows and the same cut
applies to them unchanged, but their shape is (rows, bytes per row), not the model's. So a Linear or
convolution weight whose file tensor is quantised is kept packed (its codec: `gguf <type>`), and
every other tensor (biases, norms, embeddings, F32/F16/BF16 weights, a quantised tensor that is not
such a weight or whose rows are not whole blocks) is read as a floating tensor, dequantised on load
where it was quantised, and cast to the load dtype, exactly as a `.safetensors` file's would be.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from app.engine import gguf_blocks
from app.engine.codecs import CODECS, FILE_LAYERS, Codec, sensitive
from app.families.file_layout import Layout
from app.gguf_files import GGUFHeader, GGUFTensor, packed_rows, plain_tensor

_LAYERS = (torch.nn.Linear, torch.nn.Conv2d)

Packed = dict[str, tuple[Codec, torch.Tensor]]  # model state-dict key -> (codec, packed rows)


def packable(model: torch.nn.Module, high_precision: tuple[str, ...]) -> frozenset[str]:
    """The state-dict keys that may stay packed: the weights of Linear and convolution layers, but for the
    family's high-precision layers (widened on load, as every codec leaves them: their inputs are cast by
    their weight's dtype in some models, which a packed weight does not have)."""
    wide = sensitive(high_precision)
    return frozenset(f"{path}.weight" for path, module in model.named_modules()
                     if isinstance(module, _LAYERS) and not wide(path))


def read_state(layout: Layout, header: GGUFHeader, prefix: str, dtype: torch.dtype,
               shapes: Mapping[str, tuple[int, ...]], keep: frozenset[str],
               pinned: Mapping[str, torch.dtype]) -> tuple[dict[str, torch.Tensor], Packed]:
    """The model's floating state dict and its packed weights, from `header`'s tensors under `prefix`; a tensor
    the family pins (`pinned`, by model name: fp32 norm scales) is read in its own dtype, not `dtype`."""
    state: dict[str, torch.Tensor] = {}
    packed: Packed = {}
    for name, where in layout.items():
        tensor = header.tensors[prefix + where.key]
        if tensor.packed and name in keep and _whole_blocks(tensor, shapes[name]):
            rows = packed_rows(tensor)
            if where.rows is not None:
                rows = torch.cat([rows[start:stop] for start, stop in where.rows])
            packed[name] = (CODECS[f"gguf {tensor.kind}"], rows.contiguous())
            continue
        value = _floating(tensor)
        if where.rows is not None:
            value = torch.cat([value[start:stop] for start, stop in where.rows])
        value = value.reshape(shapes[name])
        state[name] = value.to(pinned.get(name, dtype)) if value.is_floating_point() else value
    return state, packed


def _whole_blocks(tensor: GGUFTensor, shape: tuple[int, ...]) -> bool:
    """Whether each of the model tensor's rows is a whole number of the file's blocks."""
    inner = 1
    for size in shape[1:]:
        inner *= size
    return len(shape) >= 2 and inner % gguf_blocks.block_of(tensor.kind)[0] == 0


def _floating(tensor: GGUFTensor) -> torch.Tensor:
    """A file tensor as floats in its file shape: plain ones as stored, packed ones dequantised (float32)."""
    if not tensor.packed:
        return plain_tensor(tensor)
    block, type_size = gguf_blocks.block_of(tensor.kind)
    rows = packed_rows(tensor).reshape(-1, type_size)
    return gguf_blocks.kernel(tensor.kind)(rows, block, type_size).reshape(tensor.shape)


def attach(model: torch.nn.Module, packed: Packed) -> None:
    """Give each packed layer its packed bytes as its weight (a uint8 Parameter, no grad) and record the
    layers and codecs on the component (`FILE_LAYERS`), where `storage` finds them."""
    layers = {}
    for name, (codec, rows) in packed.items():
        path = name.removesuffix(".weight")
        model.get_submodule(path)._parameters["weight"] = torch.nn.Parameter(rows, requires_grad=False)
        layers[path] = codec
    setattr(model, FILE_LAYERS, layers)
