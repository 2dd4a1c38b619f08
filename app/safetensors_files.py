"""Safe reading of `.safetensors` headers and file hashes, shared by checkpoints, LoRAs and embeddings.

Every file the app opens goes through `read_header` first, so a zero-byte, truncated, lying or
renamed-pickle file is refused with a message that says which of those it is — before any
loader sees it, and without ever unpickling anything.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from safetensors import SafetensorError, safe_open


class SafetensorsFileError(ValueError):
    """The file is not a readable `.safetensors` file; the message says why."""


def read_header(path: Path) -> tuple[frozenset[str], dict[str, str]]:
    """Tensor names and metadata; `safe_open` checks offsets and shapes against the file size."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return frozenset(handle.keys()), dict(handle.metadata() or {})
    except (SafetensorError, OSError) as exc:
        raise SafetensorsFileError(f"{path.name}: not a valid safetensors file ({_problem(path, exc)})") from exc


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


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, streamed (checkpoints are several GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
