"""`.gguf` weight files: their header, their tensors as packed bytes, refused cleanly when unreadable.

Why GGUF: city96's Q8_0 … Q2_K files of the DiT transformers are
how most people fit these models on 8-12 GB cards. A GGUF file is a header (key/value fields and a
table of tensors: name, shape, quant type, offset) followed by the tensors' bytes, with no code in
it: nothing is unpickled. Tensor names are the original (BFL/ComfyUI) ones, so the family is told
from them and their shapes, as for a `.safetensors` file; the `general.architecture` string is not
trusted (converters write one string for several architectures).

What is read: the header with the `gguf` package (`GGUFReader` maps the file and checks each tensor's
extent against its size: a truncated file is refused here, before anything is built), every string
field as metadata (the tiny demo and test files carry their component configs under
`steady_diffusion.configs`, the key the demo's safetensors use), and each tensor's shape in torch
order (GGUF lists dimensions innermost first). A tensor of a type not read here (IQ*, TQ*, …) is
refused by name with its type before anything loads. Quantised tensors are handed over as packed
uint8 rows (one per output row: GGUF's blocks run along the innermost dimension); F32/F16/BF16 ones
as ordinary tensors.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

PACKED = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q4_K", "Q4_0", "Q4_1", "Q3_K", "Q2_K")  # read as packed bytes
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,  # read as
         "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}  # ordinary tensors
SUFFIX = ".gguf"


class GGUFFileError(ValueError):
    """A `.gguf` file that cannot be read, or holds a tensor type not supported; the message names both."""


def is_gguf(path: Path) -> bool:
    return Path(path).suffix.lower() == SUFFIX


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str  # ggml type name: "Q4_K", "F16", …
    shape: tuple[int, ...]  # torch order (outermost first)
    data: np.ndarray  # the file's bytes, memory-mapped: packed (rows, bytes per row) or plain values

    @property
    def packed(self) -> bool:
        return self.kind in PACKED


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, str]  # every string field
    tensors: dict[str, GGUFTensor]

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: t.shape for name, t in self.tensors.items()}

    def renamed(self, rules: tuple[tuple[str, str], ...]) -> GGUFHeader:
        """The header with each tensor name rewritten by the first (regex, replacement) rule that matches it
        whole (llama.cpp's names -> a model's own); names no rule matches stay."""
        if not rules:
            return self
        compiled = [(re.compile(pattern), replacement) for pattern, replacement in rules]

        def name(old: str) -> str:
            return next((rule.sub(replacement, old) for rule, replacement in compiled if rule.fullmatch(old)), old)

        return dataclasses.replace(self, tensors={name(k): dataclasses.replace(t, name=name(k))
                                                  for k, t in self.tensors.items()})


def same_shape(in_file: tuple[int, ...], wanted: tuple[int, ...]) -> bool:
    """Whether a GGUF tensor's shape is the one wanted: GGUF has no 0-d tensors, a scalar is stored as (1,)."""
    return tuple(in_file) == tuple(wanted) or (tuple(wanted) == () and tuple(in_file) == (1,))


def read(path: Path) -> GGUFHeader:
    """The file's header and memory-mapped tensors; `GGUFFileError` naming the file (and a tensor of an
    unsupported type with that type) when it is not a complete GGUF file this app reads."""
    from gguf import GGUFReader, GGUFValueType

    path = Path(path)
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, OSError, IndexError, KeyError) as exc:  # what a cut or foreign file raises there
        raise GGUFFileError(f"{path.name}: not a complete GGUF file ({type(exc).__name__}: {exc}); "
                            "truncated or not GGUF?") from exc
    size = path.stat().st_size
    tensors = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in PACKED and kind not in PLAIN:
            raise GGUFFileError(f"{path.name}: tensor {t.name} is {kind}, a GGUF quant type not supported "
                                f"(supported: {', '.join((*PACKED, *PLAIN))})")
        if t.data_offset + t.n_bytes > size:
            raise GGUFFileError(f"{path.name}: tensor {t.name} ({kind}) ends past the end of the file; truncated?")
        tensors[t.name] = GGUFTensor(t.name, kind, tuple(int(d) for d in reversed(t.shape)), t.data)
    metadata = {name: bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
                for name, field in reader.fields.items() if field.types == [GGUFValueType.STRING]}
    return GGUFHeader(path, metadata, tensors)


def packed_rows(tensor: GGUFTensor) -> torch.Tensor:
    """A quantised tensor's bytes as uint8 rows, one per outermost index (a copy: the file may change)."""
    data = np.ascontiguousarray(tensor.data).view(np.uint8)
    return torch.from_numpy(data.reshape(tensor.shape[0], -1).copy())


def plain_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """An F32/F16/BF16 tensor in its own dtype and torch shape (a copy)."""
    raw = torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8).copy())
    return raw.view(PLAIN[tensor.kind]).reshape(tensor.shape)
