"""The LoRA library: find adapter files, validate names, read `.safetensors` safely, cache them.

Only `.safetensors` is ever read (a pickle renamed `.safetensors` fails the header check and
is reported, never unpickled). Files are cached by (path, mtime, size) so a slider move does
not re-read the disk, and a file replaced on disk is picked up on the next apply. The cache is
bounded in bytes, not entries: eight 1 GiB LoRAs would otherwise stay resident after use, and
the engine calls `forget` for a file it refused, so a refusal leaves nothing behind.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from app.adapters.errors import AdapterFormatError
from app.adapters.specs import LoraSpec, check_strength
from app.paths import resolve_under, utf8_names
from app.safetensors_files import SafetensorsFileError, header_tensors, lora_short_hash, read_header, refuse_bad_values

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
DEFAULT_CACHE_BYTES = 1 << 30
HASHES_KEPT = 4096  # files whose short hash `LoraLibrary` remembers (a few bytes each)


@dataclass(frozen=True)
class AdapterFile:
    name: str
    path: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    short_hash: str  # A1111's: of the tensor bytes only (`lora_short_hash`)
    size_bytes: int
    sidecar_config: str | None = None  # PEFT's adapter_config.json beside the file, as text

    def same_as(self, other: AdapterFile) -> bool:
        """Whether `other` would patch exactly as this does: the same tensors (the hash), and the same
        metadata and sidecar, which may carry the alpha (a metadata edit keeps A1111's hash)."""
        return (self.short_hash, self.metadata, self.sidecar_config) == (other.short_hash, other.metadata,
                                                                          other.sidecar_config)

    @property
    def resident_bytes(self) -> int:
        """Memory its tensors hold (what the cache bound counts)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def read_adapter(name: str, path: Path) -> AdapterFile:
    """Read every tensor of an adapter file after the header check; NaN/Inf tensors and absurd
    values are refused (a LoRA with them would silently turn every image black)."""
    try:
        _keys, metadata = read_header(path)
        tensors = load_file(str(path), device="cpu")
    except (SafetensorsFileError, SafetensorError) as exc:
        raise AdapterFormatError(str(exc)) from None
    if not tensors:
        raise AdapterFormatError(f"{path.name}: contains no tensors")
    refuse_bad_values(path, tensors, AdapterFormatError)
    return AdapterFile(name, path, tensors, metadata, lora_short_hash(path), path.stat().st_size,
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

    def __init__(self, root: Path, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.root = root
        self._cache: collections.OrderedDict[tuple, AdapterFile] = collections.OrderedDict()
        self._cache_bytes = cache_bytes
        # A file's hash while the file is unchanged, kept apart from the tensors: every image's infotext names
        # its LoRAs' hashes, and three FLUX.1 LoRAs (over the 1 GiB cache) were re-read whole per image (issue 41).
        self._hashes: collections.OrderedDict[tuple, str] = collections.OrderedDict()

    def names(self) -> list[str]:
        """Every LoRA's name; files whose names are not valid UTF-8 are logged and left out."""
        if not self.root.is_dir():
            return []
        paths = utf8_names(self.root, self.root.rglob(f"*{SUFFIX}"), "LoRA")
        return sorted(p.relative_to(self.root).with_suffix("").as_posix() for p in paths)

    def _path(self, name: str) -> Path:
        return resolve_under(self.root, name if name.endswith(SUFFIX) else name + SUFFIX, "LoRA")

    def path_for(self, name: str) -> Path:
        path = self._path(name)
        if not path.is_file():
            raise FileNotFoundError(f"LoRA {name!r} not found in {self.root} (was it moved or deleted?)")
        return path

    def found(self, name: str) -> bool:
        """Whether `name` is a LoRA file in the library; an unsafe name is refused (`UnsafePathError`), never
        taken for a missing file (a prompt tag naming a missing one is left out: `without_missing_loras`)."""
        return self._path(name).is_file()

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
            check_strength(spec.name, "UNet strength", spec.unet_strength)  # again: a spec can be forced
            check_strength(spec.name, "text-encoder strength", spec.te_strength)
            for _position, strength in spec.schedule.points if spec.schedule is not None else ():
                check_strength(spec.name, "scheduled UNet strength", strength)

    def _key(self, name: str) -> tuple[Path, tuple]:
        path = self.path_for(name)
        stat = path.stat()
        return path, (str(path), stat.st_mtime_ns, stat.st_size)

    def cached(self, name: str) -> bool:
        """Whether `name`'s current file is in the cache (`open` reads nothing)."""
        try:
            return self._key(name)[1] in self._cache
        except (OSError, ValueError):
            return False

    def header_view(self, name: str) -> AdapterFile:
        """The file as its header describes it (`header_tensors`: large tensors are `meta`), neither
        hashed nor cached: enough to refuse a LoRA that does not fit a model while reading only its
        header (four refused 1 GiB files were read whole and took RSS from 538 to 4,630 MiB)."""
        path = self.path_for(name)
        try:
            tensors = header_tensors(path)
            _keys, metadata = read_header(path)
        except SafetensorsFileError as exc:
            raise AdapterFormatError(str(exc)) from None
        if not tensors:
            raise AdapterFormatError(f"{path.name}: contains no tensors")
        return AdapterFile(name, path, tensors, metadata, "", path.stat().st_size, _peft_sidecar(path))

    def open(self, name: str) -> AdapterFile:
        path, key = self._key(name)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        adapter = read_adapter(name, path)
        self._remember_hash(key, adapter.short_hash)
        self._cache[key] = adapter
        total = self.cached_bytes
        while total > self._cache_bytes:  # oldest first; a file larger than the bound is not kept at all
            total -= self._cache.popitem(last=False)[1].resident_bytes
        return adapter

    def forget(self, name: str) -> None:
        """Drop every cached read of `name`'s file: the engine calls this when it refuses the LoRA,
        so a refused file leaves nothing resident."""
        path = str(self._path(name))
        for key in [k for k in self._cache if k[0] == path]:
            del self._cache[key]

    @property
    def cached_bytes(self) -> int:
        return sum(a.resident_bytes for a in self._cache.values())

    def short_hash(self, name: str) -> str:
        """The file's A1111 short hash; read (and cached as `open` caches) only when not known for this file."""
        key = self._key(name)[1]
        if key in self._hashes:
            self._hashes.move_to_end(key)
            return self._hashes[key]
        return self.open(name).short_hash

    def _remember_hash(self, key: tuple, short_hash: str) -> None:
        self._hashes[key] = short_hash
        while len(self._hashes) > HASHES_KEPT:  # a bound all the same; a forgotten hash is read again
            self._hashes.popitem(last=False)
