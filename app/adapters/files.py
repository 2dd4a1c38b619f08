"""The LoRA library: find adapter files, validate names, read `.safetensors` safely, cache them.

Only `.safetensors` is ever read (a pickle renamed `.safetensors` fails the header check and
is reported, never unpickled). Files are cached by (path, mtime, size) so a slider move does
not re-read the disk, and a file replaced on disk is picked up on the next apply.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from app.adapters.errors import AdapterFormatError
from app.adapters.specs import LoraSpec
from app.paths import resolve_under
from app.safetensors_files import SafetensorsFileError, file_sha256, read_header

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
    sidecar_config: str | None = None  # PEFT's adapter_config.json beside the file, as text


def read_adapter(name: str, path: Path) -> AdapterFile:
    """Read every tensor of an adapter file after the header check; NaN/Inf tensors are refused
    (a LoRA with them would silently turn every image black)."""
    try:
        _keys, metadata = read_header(path)
        tensors = load_file(str(path), device="cpu")
    except (SafetensorsFileError, SafetensorError) as exc:
        raise AdapterFormatError(str(exc)) from None
    if not tensors:
        raise AdapterFormatError(f"{path.name}: contains no tensors")
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise AdapterFormatError(f"{path.name}: tensor {key} contains NaN or Inf values; refused")
    return AdapterFile(name, path, tensors, metadata, file_sha256(path)[:12], path.stat().st_size,
                       _peft_sidecar(path))


PEFT_SIDECAR = "adapter_config.json"
_SIDECAR_MAX_BYTES = 1 << 20


def _peft_sidecar(path: Path) -> str | None:
    """The text of PEFT's `adapter_config.json` when it belongs to this file: PEFT's
    `save_pretrained` writes it beside `adapter_model.safetensors`; a renamed file counts when it
    is the folder's only `.safetensors` (a config shared by several files would scale them all).
    It holds the LoRA's alpha and rank, without which a PEFT file applies at the wrong strength.
    Read with the file and cached with it: edit the config, then touch the file to re-read it."""
    sidecar = path.with_name(PEFT_SIDECAR)
    if not sidecar.is_file():
        return None
    if path.name != "adapter_model.safetensors" and len(list(path.parent.glob(f"*{SUFFIX}"))) != 1:
        return None
    if sidecar.stat().st_size > _SIDECAR_MAX_BYTES:
        raise AdapterFormatError(f"{sidecar}: larger than {_SIDECAR_MAX_BYTES} bytes; not a PEFT adapter config")
    try:
        return sidecar.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AdapterFormatError(f"{sidecar}: cannot be read ({exc})") from None


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

    def exists(self, name: str) -> bool:
        """Whether `name` is a LoRA file in the library (an unsafe or absent name is not)."""
        try:
            self.path_for(name)
        except (OSError, ValueError):
            return False
        return True

    def validate_specs(self, specs: Sequence[LoraSpec]) -> None:
        """Refuse duplicates and unsafe names before anything is queued."""
        seen = collections.Counter(spec.name for spec in specs)
        dupes = sorted(n for n, c in seen.items() if c > 1)
        if dupes:
            raise ValueError(f"LoRA listed more than once: {', '.join(dupes)}; give each LoRA once")
        for spec in specs:
            resolve_under(self.root, spec.name, "LoRA")  # the bare name: empty, NUL, `..`, absolute
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
