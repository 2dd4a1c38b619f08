"""The LoRA library: find adapter files, validate names, read `.safetensors` safely, cache them.

Only `.safetensors` is ever read (a pickle renamed `.safetensors` fails the header check and
is reported, never unpickled). Files are cached by (path, mtime, size) so a slider move does
not re-read the disk, and a file replaced on disk is picked up on the next apply.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from app.adapters.errors import AdapterFormatError
from app.adapters.specs import LoraSpec
from app.paths import resolve_under

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class AdapterFile:
    name: str
    path: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    short_hash: str
    size_bytes: int


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_header(path: Path) -> dict:
    """Parse and sanity-check the safetensors JSON header without reading tensor data."""
    size = path.stat().st_size
    if size < 8:
        raise AdapterFormatError(f"{path.name}: file is {size} bytes, too small to be a .safetensors file")
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        if header_len > min(size - 8, 100 * 2**20):
            raise AdapterFormatError(
                f"{path.name}: not a .safetensors file (header length {header_len} does not fit a "
                f"{size}-byte file; a renamed .ckpt/.pt pickle?)")
        try:
            header = json.loads(fh.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AdapterFormatError(f"{path.name}: safetensors header is not valid JSON ({exc})") from None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if ends and max(ends) > size - 8 - header_len:
        raise AdapterFormatError(
            f"{path.name}: truncated: the header promises {max(ends)} bytes of tensor data, "
            f"the file holds {size - 8 - header_len}")
    return header


def read_adapter(name: str, path: Path) -> AdapterFile:
    header = read_header(path)
    try:
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterFormatError(f"{path.name}: cannot read tensors ({exc})") from None
    if not tensors:
        raise AdapterFormatError(f"{path.name}: contains no tensors")
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise AdapterFormatError(f"{path.name}: tensor {key} contains NaN or Inf values; refused")
    metadata = dict(header.get("__metadata__") or {})
    return AdapterFile(name, path, tensors, metadata, file_sha256(path)[:12], path.stat().st_size)


class LoraLibrary:
    """LoRA files under one folder, addressed by their relative name without `.safetensors`."""

    def __init__(self, root: Path, cache_size: int = 8) -> None:
        self.root = root
        self._cache: collections.OrderedDict[tuple, AdapterFile] = collections.OrderedDict()
        self._cache_size = cache_size

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.relative_to(self.root).with_suffix("").as_posix() for p in self.root.rglob(f"*{SUFFIX}"))

    def path_for(self, name: str) -> Path:
        path = resolve_under(self.root, name if name.endswith(SUFFIX) else name + SUFFIX, "LoRA")
        if not path.is_file():
            raise FileNotFoundError(f"LoRA {name!r} not found in {self.root} (was it moved or deleted?)")
        return path

    def validate_specs(self, specs: Sequence[LoraSpec]) -> None:
        """Refuse duplicates and unsafe names before anything is queued."""
        seen = collections.Counter(spec.name for spec in specs)
        dupes = sorted(n for n, c in seen.items() if c > 1)
        if dupes:
            raise ValueError(f"LoRA listed more than once: {', '.join(dupes)}; give each LoRA once")
        for spec in specs:
            resolve_under(self.root, spec.name + SUFFIX, "LoRA")
            if not all(math.isfinite(v) for v in (spec.unet_strength, spec.te_strength)):
                raise ValueError(f"LoRA {spec.name!r}: strengths must be finite")

    def open(self, name: str) -> AdapterFile:
        path = self.path_for(name)
        stat = path.stat()
        key = (str(path), stat.st_mtime_ns, stat.st_size)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        adapter = read_adapter(name, path)
        self._cache[key] = adapter
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return adapter

    def short_hash(self, name: str) -> str:
        return self.open(name).short_hash
