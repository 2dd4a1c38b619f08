"""Safe reading of `.safetensors` headers and file hashes, shared by checkpoints, LoRAs and embeddings.

Every file the app opens goes through `read_header` first, so a zero-byte, truncated, lying or
renamed-pickle file is refused with a message that says which of those it is — before any
loader sees it, and without ever unpickling anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# The largest finite fp16 value. A LoRA factor, alpha or embedding element beyond it cannot come
# from a file trained or saved in half precision, and with every factor below it the float32 delta
# math stays finite for every algorithm (LoHa's four-factor product stays under 2e19 per rank
# term). Such values only come from corrupt or hostile files: a LoRA x1e30 fuses to Inf weights
# and black images with no error. What can still overflow an fp16 weight when fused is caught
# during sampling (`NonFiniteLatentsError`).
MAX_ABS_VALUE = float(torch.finfo(torch.float16).max)


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


def read_header(path: Path) -> tuple[frozenset[str], dict[str, str]]:
    """Tensor names and metadata."""
    with _opened(path) as handle:
        return frozenset(handle.keys()), dict(handle.metadata() or {})


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the header alone (no tensor data is read)."""
    with _opened(path) as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}


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


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, streamed (checkpoints are several GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
