"""How a component's tensors are named and cut in a single file, versus the loaded model's names.

Why one table per component serves three users: the loader reads a file's tensors into the
model's names (`to_model`), the demo and tests write a model back in the file layout
(`to_file`), and the adapter key table resolves LoRA keys spelled with the file's module names
(`module_parts`: a fused file module such as Flux's `img_attn.qkv` is several model modules, each a
slice of its rows). Built from the model's own modules and shapes, never from hard-coded sizes, so
a tiny demo model and the full-size one go through the same code.

A `FileTensor` says where one model tensor lives in a file: a key, and optionally the row ranges
of that file tensor (in order) that make it up. A model tensor that is one block of a fused file
tensor has one range; Flux's final modulation, whose (shift, scale) halves diffusers stores as
(scale, shift), has two. Shapes that differ only by unit dimensions (LDM's 1×1-conv VAE attention)
are reshaped, and so is a tensor a file stores flattened (`flat`: Krea 2's per-block modulation tables).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod

import torch

Rows = tuple[tuple[int, int], ...]  # (start, stop) row ranges of a file tensor, concatenated in order


@dataclass(frozen=True)
class FileTensor:
    key: str
    rows: Rows | None = None  # None: the whole file tensor
    unit_dims: int = 0  # trailing 1s the file's shape adds to the model's (LDM's 1×1-conv VAE attention)
    flat: bool = False  # the file holds the whole tensor as one row of its elements


def row_index(rows: Rows) -> torch.Tensor:
    """Row ranges as one index tensor."""
    return torch.cat([torch.arange(start, stop) for start, stop in rows])


Layout = Mapping[str, FileTensor]  # model state-dict key -> where it lives in the file


def own_names(model) -> dict[str, FileTensor]:
    """The layout of files that use the model's own (transformers') names: T5, Qwen3. A tied weight
    (T5's `encoder.embed_tokens` is `shared`) is read once, under the name it is stored by."""
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    return {key: FileTensor(key) for key in model.state_dict() if key not in tied}


def to_model(layout: Layout, read, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The model's state dict from a file: `read(key)` returns a file tensor, `shapes` the model's
    shapes. A file tensor read for several model tensors (fused qkv) is read once."""
    cache: dict[str, torch.Tensor] = {}
    out = {}
    for name, where in layout.items():
        if where.key not in cache:
            cache[where.key] = read(where.key)
        tensor = cache[where.key]
        if where.rows is not None:
            tensor = torch.cat([tensor[start:stop] for start, stop in where.rows])
        out[name] = tensor.reshape(shapes[name])
    return out


def file_shapes(layout: Layout, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape every file tensor must have, from the model's shapes: rows add up across the model
    tensors cut from one file tensor; trailing dimensions are the model's (plus `unit_dims` 1s)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, where in layout.items():
        shape = (*shapes[name], *(1,) * where.unit_dims)
        if where.flat:
            out[where.key] = (prod(shape),)
            continue
        if not shape:  # a 0-d tensor (a batch norm's step counter) is whole
            out[where.key] = shape
            continue
        rows = shape[0] if where.rows is None else max(stop for _start, stop in where.rows)
        if where.key in out:
            rows = max(rows, out[where.key][0])
        out[where.key] = (rows, *shape[1:])
    return out


def to_file(layout: Layout, state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """The inverse of `to_model`: file tensors (shaped as `file_shapes` says) from the model's state dict."""
    out: dict[str, torch.Tensor] = {}
    for name, where in layout.items():
        shape = shapes[where.key]
        tensor = state[name]
        if where.rows is None:
            out[where.key] = tensor.reshape(shape).clone()
            continue
        target = out.setdefault(where.key, torch.empty(shape, dtype=tensor.dtype))
        offset = 0
        flat = tensor.reshape(tensor.shape[0], *shape[1:])
        for start, stop in where.rows:
            target[start:stop] = flat[offset:offset + stop - start]
            offset += stop - start
    return out


def module_parts(layout: Layout) -> dict[str, tuple[tuple[str, Rows | None], ...]]:
    """File module path -> ((model module path, its rows in the file module or None), …), from the
    weights' entries: what an adapter written against the file's modules targets in the model."""
    parts: dict[str, list[tuple[str, Rows | None]]] = {}
    for name, where in layout.items():
        module, _, param = name.rpartition(".")
        file_module, _, file_param = where.key.rpartition(".")
        if param == "weight" and module and file_module:
            parts.setdefault(file_module, []).append((module, where.rows))
    return {k: tuple(sorted(v, key=lambda p: -1 if p[1] is None else p[1][0][0])) for k, v in parts.items()}


def file_name_aliases(layout: Layout, component: str, kohya: str, lycoris: str, comfy: str):
    """(LoRA key, parts, spelling) for every module of a single file's `layout` as trainers spell it over the
    file's names (`app/adapters/keys.py`): kohya (`lora_unet_` + the name with `_`), LyCORIS (`lycoris_`), and
    ComfyUI (`diffusion_model.` + the dotted name, or bare); a fused file module lists its row slices, so a
    LoRA on it is cut exactly into the modules of `component` it covers. The spelling tags are the caller's."""
    for name, found in module_parts(layout).items():
        targets = tuple(((component, path), rows) for path, rows in found)
        flat = name.replace(".", "_")
        yield f"lora_unet_{flat}", targets, kohya
        yield f"lycoris_{flat}", targets, lycoris
        yield f"diffusion_model.{name}", targets, comfy
        yield name, targets, comfy


def all_in_one_state(pipe, parts) -> dict[str, torch.Tensor]:
    """A pipeline's components as one all-in-one file (each under its first prefix): what the demo
    writes for families that list `Files.parts` (`app.families.ComponentFile`)."""
    out = {}
    for part in parts:
        model = getattr(pipe, part.component)
        state = model.state_dict()
        layout = part.layout(model)
        shapes = file_shapes(layout, {k: tuple(v.shape) for k, v in state.items()})
        out.update({part.prefixes[0] + k: v for k, v in to_file(layout, state, shapes).items()})
    return out
