"""Safe reading of `.safetensors` headers and file contents, shared by checkpoints, LoRAs and embeddings.

Every file the app opens goes through `read_header` first, so a zero-byte, truncated, lying or
renamed-pickle file is refused with a message that says which of those it is — before any
loader sees it, and without ever unpickling anything.

Reading a multi-GB checkpoint end to end (its sha256, a check of every value) costs seconds, more
than loading it: `scan_file` does both in one sequential read (through the page cache, so the
process's resident memory does not grow by the file's size as a pass over memory-mapped weights
would), and `FileFacts` keeps what it found per file while its size and modification time stay the
same — the rule A1111 applies to its hash cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from app import gguf_files

# The largest finite fp16 value. A LoRA factor, alpha or embedding element beyond it cannot come
# from a file trained or saved in half precision, and with every factor below it the float32 delta
# math stays finite for every algorithm (LoHa's four-factor product stays under 2e19 per rank
# term). Such values only come from corrupt or hostile files: a LoRA x1e30 fuses to Inf weights
# and black images with no error. What can still overflow an fp16 weight when fused is caught
# during sampling (`NonFiniteLatentsError`).
MAX_ABS_VALUE = float(torch.finfo(torch.float16).max)

logger = logging.getLogger(__name__)


class SafetensorsFileError(ValueError):
    """The file is not a readable `.safetensors` file; the message says why."""


@contextlib.contextmanager
def _opened(path: Path) -> Iterator:
    """`safe_open` (it checks offsets and shapes against the file size), its errors said plainly."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError) as exc:
        raise SafetensorsFileError(f"{path.name}: not a valid safetensors file ({_problem(path, exc)})") from exc


def gguf_header(path: Path) -> gguf_files.GGUFHeader:
    """A `.gguf` file's header (weights files are safetensors or GGUF: app/gguf_files.py), its errors as ours."""
    try:
        return gguf_files.read(path)
    except gguf_files.GGUFFileError as exc:
        raise SafetensorsFileError(str(exc)) from exc


def read_header(path: Path) -> tuple[frozenset[str], dict[str, str]]:
    """Tensor names and metadata."""
    if gguf_files.is_gguf(path):
        header = gguf_header(path)
        return header.keys, header.metadata
    with _opened(path) as handle:
        return frozenset(handle.keys()), dict(handle.metadata() or {})


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the header alone (no tensor data is read)."""
    if gguf_files.is_gguf(path):
        return gguf_header(path).shapes()
    with _opened(path) as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}


SMALL_TENSOR = 64  # elements: scalars (alpha) and tiny vectors are read even in a header view


def header_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor as the header describes it, without reading the large ones: tensors of up to
    `SMALL_TENSOR` elements (alphas) are read, the others are `meta` tensors of the right shape and
    dtype. Enough to match a file against a model by names and shapes, at the cost of its header."""
    with _opened(path) as handle:
        out = {}
        for key in handle.keys():
            view = handle.get_slice(key)
            shape = tuple(view.get_shape())
            if math.prod(shape) <= SMALL_TENSOR:
                out[key] = handle.get_tensor(key)
            else:
                out[key] = torch.empty(shape, dtype=_DTYPES.get(view.get_dtype(), torch.float32), device="meta")
        return out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _problem(path: Path, exc: Exception) -> str:
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError:
        return str(exc)
    if not head:
        return "the file is empty"
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "it is a pickled PyTorch checkpoint renamed to .safetensors; refusing to unpickle it"
    return f"{exc}; the file may be truncated or corrupt"


def refuse_bad_values(path: Path, tensors: dict[str, torch.Tensor], error: type[Exception]) -> None:
    """Raise `error` naming the first floating tensor holding NaN/Inf or a value beyond ±MAX_ABS_VALUE.

    One min/max pass per tensor (NaN propagates through both), without a tensor-sized temporary.
    """
    for key, tensor in tensors.items():
        if not tensor.is_floating_point() or not tensor.numel():
            continue
        low, high = (v.item() for v in torch.aminmax(tensor))
        if not (math.isfinite(low) and math.isfinite(high)):
            raise error(f"{path.name}: tensor {key} contains NaN or Inf values; refused")
        if max(-low, high) > MAX_ABS_VALUE:
            raise error(f"{path.name}: tensor {key} holds {max(-low, high):.3g}, beyond ±{MAX_ABS_VALUE:g} "
                        "(no half-precision file can hold it; the values are corrupt); refused")


def file_sha256(path: Path, skip_header: bool = False) -> str:
    """Hex sha256 of a file, streamed (checkpoints are several GB); with `skip_header`, of the bytes
    after its safetensors header only (see `lora_short_hash`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if skip_header:
            handle.seek(8 + int.from_bytes(handle.read(8), "little"))
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def lora_short_hash(path: Path) -> str:
    """A LoRA's short hash as A1111 writes it in `Lora hashes` (and Civitai's "AutoV3" looks it up):
    the first 12 hex digits of the sha256 of the tensor bytes after the header (kohya's addnet hash),
    so editing a file's metadata keeps its hash. Computed, never taken from the file's own
    `sshs_model_hash` metadata, which nothing checks."""
    return file_sha256(path, skip_header=True)[:12]


# Floating dtypes whose values a scan checks, as safetensors names them; fp8 holds no value beyond
# fp16's range, so only its NaN (e4m3fn: S.1111.111) and Inf/NaN (e5m2: exponent 11111) bit patterns
# are looked for.
_FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_FP8_NOT_FINITE = {"F8_E4M3": 0x7F, "F8_E5M2": 0x7C}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_PIECE = 1 << 20  # bytes read at a time: the resident memory a scan adds is this buffer


@dataclass(frozen=True)
class ValueScan:
    """What one read of a file found: its sha256, the floating tensors holding NaN or ±Inf, and the
    largest magnitude of those holding values beyond fp16's range (they overflow when cast to it)."""

    sha256: str
    nonfinite: tuple[str, ...] = ()
    largest: dict[str, float] = field(default_factory=dict)

    def not_finite_in(self, dtype: torch.dtype) -> list[str]:
        """The tensors that hold NaN or ±Inf once cast to `dtype`."""
        limit = torch.finfo(dtype).max
        return [*self.nonfinite, *sorted(key for key, value in self.largest.items() if value > limit)]


def scan_file(path: Path, stop: threading.Event | None = None) -> ValueScan | None:
    """The file's sha256 and the verdict on every floating tensor's values, in one sequential read;
    None when `stop` was set before the end. Each tensor is read in pieces into one reused buffer,
    hashed and reduced (min/max: NaN propagates through both) as it passes."""
    digest, buffer = hashlib.sha256(), bytearray(_PIECE)
    nonfinite, largest = [], {}
    if gguf_files.is_gguf(path):  # hashed whole: its values are blocks, not floats a min/max reads
        with open(path, "rb") as handle:
            done = _read(handle, digest, buffer, path.stat().st_size, None, stop)
        return None if done is None else ValueScan(digest.hexdigest())
    with open(path, "rb") as handle:
        head = handle.read(8)
        header = handle.read(int.from_bytes(head, "little"))
        digest.update(head + header)
        position = 0
        for name, kind, begin, end in _spans(path, header):
            _read(handle, digest, buffer, begin - position, None, stop)  # padding between tensors, if any
            peak = _read(handle, digest, buffer, end - begin, kind, stop)
            if peak is None:
                return None
            if not math.isfinite(peak):
                nonfinite.append(name)
            elif peak > MAX_ABS_VALUE:
                largest[name] = peak
            position = end
        while chunk := handle.read(_PIECE):
            digest.update(chunk)
    return ValueScan(digest.hexdigest(), tuple(nonfinite), largest)


def _spans(path: Path, header: bytes) -> list[tuple[str, str, int, int]]:
    """(name, dtype, begin, end) of every tensor, in file order."""
    try:
        tensors = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
        spans = [(k, v["dtype"], *map(int, v["data_offsets"])) for k, v in tensors.items()]
    except (ValueError, TypeError, KeyError) as exc:
        raise SafetensorsFileError(f"{path.name}: unreadable safetensors header ({exc})") from exc
    return sorted(spans, key=lambda span: span[2])


def _read(handle, digest, buffer: bytearray, size: int, kind: str | None, stop: threading.Event | None
          ) -> float | None:
    """Hash the next `size` bytes; for a floating `kind` return their largest magnitude (NaN or Inf
    if any value is not finite; 0 for other kinds). None when stopped."""
    peak, step = 0.0, _PIECE - _PIECE % _ITEMSIZE.get(kind, 1)
    while size > 0:
        if stop is not None and stop.is_set():
            return None
        view = memoryview(buffer)[:min(step, size)]
        if handle.readinto(view) != len(view):
            raise SafetensorsFileError(f"{Path(handle.name).name}: the file ended inside a tensor; truncated?")
        digest.update(view)
        if kind in _FLOATS:
            low, high = (v.item() for v in torch.aminmax(torch.frombuffer(view, dtype=_FLOATS[kind])))
            peak = max(peak, -low, high) if math.isfinite(low + high) else math.nan
        elif kind in _FP8_NOT_FINITE:
            mask = _FP8_NOT_FINITE[kind]
            peak = math.nan if ((torch.frombuffer(view, dtype=torch.uint8) & mask) == mask).any() else peak
        size -= len(view)
    return peak


@dataclass(frozen=True)
class FileIdentity:
    """What says a file's contents are unchanged without reading them: resolved path, size, mtime."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        resolved = Path(path).resolve()
        stat = resolved.stat()
        return cls(str(resolved), stat.st_size, stat.st_mtime_ns)


class FileFacts:
    """Facts about files' contents (a `ValueScan`, the configs a header's shapes passed against), valid
    while a file's `FileIdentity` holds; a changed size or mtime drops all of that file's facts.

    Kept in `store`, a small JSON file rewritten atomically after each new fact, so they survive a
    restart; None keeps them in memory only. The store is only a cache: an unreadable one is started
    afresh and one that cannot be written is reported once, and in both cases the fact is computed
    again next time. Thread-safe: a background scan and the loader may record facts concurrently in
    one instance (keep one per store in a process, or the last writer drops the other's facts).
    """

    VERSION = 2  # 2: one `scan` fact (sha256 and values) instead of `sha256` and `finite_dtypes`

    def __init__(self, store: Path | None) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._files: dict[str, dict[str, Any]] = self._read()
        self._write_failed = False

    def _read(self) -> dict[str, dict[str, Any]]:
        if self._store is None or not self._store.is_file():
            return {}
        try:
            data = json.loads(self._store.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("file facts cache %s unreadable (%s); starting a new one", self._store, exc)
            return {}
        files = data.get("files") if isinstance(data, dict) and data.get("version") == self.VERSION else None
        return files if isinstance(files, dict) else {}

    def _entry(self, identity: FileIdentity) -> dict[str, Any] | None:
        entry = self._files.get(identity.path)
        valid = isinstance(entry, dict) and (entry.get("size"), entry.get("mtime_ns")) == (identity.size,
                                                                                          identity.mtime_ns)
        return entry if valid else None

    def get(self, identity: FileIdentity, fact: str) -> Any:
        entry = self._entry(identity)
        return None if entry is None else entry.get(fact)

    def put(self, identity: FileIdentity, fact: str, value: Any) -> None:
        with self._lock:
            entry = self._entry(identity)
            if entry is None:
                entry = self._files[identity.path] = {"size": identity.size, "mtime_ns": identity.mtime_ns}
            entry[fact] = value
            self._write()

    def _write(self) -> None:
        if self._store is None or self._write_failed:
            return
        tmp = self._store.with_name(f"{self._store.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"version": self.VERSION, "files": self._files}, indent=1))
            tmp.replace(self._store)
        except OSError as exc:  # a read-only model folder: the facts are recomputed on the next load
            self._write_failed = True
            logger.warning("cannot write the file facts cache %s (%s); hashes will be recomputed", self._store, exc)

    def once(self, identity: FileIdentity, fact: str, key: str, check: Callable[[], None]) -> None:
        """Run `check` unless it already passed for `key` (a dtype, a config digest) on these contents;
        record the pass under `fact`. A check that raises records nothing, so it runs again next time."""
        passed = self.get(identity, fact) or []
        if key in passed:
            return
        check()
        self.put(identity, fact, sorted({*passed, key}))

    def recorded_scan(self, path: Path) -> ValueScan | None:
        """The file's `ValueScan` if one was recorded for its current contents (nothing is read)."""
        known = self.get(FileIdentity.of(path), "scan")
        with contextlib.suppress(KeyError, TypeError, ValueError):  # an edited store is only a cache miss
            return ValueScan(str(known["sha256"]), tuple(known["nonfinite"]), dict(known["largest"]))
        return None

    def scan(self, path: Path, stop: threading.Event | None = None) -> ValueScan | None:
        """The file's `ValueScan`: the recorded one, else read (None when `stop` cut the read short)
        and recorded, unless the file changed while it was read."""
        identity = FileIdentity.of(path)
        scan = self.recorded_scan(path)
        if scan is None:
            scan = scan_file(path, stop)
            if scan is not None and FileIdentity.of(path) == identity:
                self.put(identity, "scan", {"sha256": scan.sha256, "nonfinite": list(scan.nonfinite),
                                            "largest": scan.largest})
        return scan
