"""Upscaler model files: the folders A1111 and Forge read, names, and reading a file without unpickling.

A1111 keeps ESRGAN-class models in `models/ESRGAN/`, `models/RealESRGAN/`, `models/SwinIR/` and
`models/DAT/`; Forge (and ComfyUI) in `models/upscale_models/`. A model is named by its file stem, as
both name it (`4x-UltraSharp`), the first folder in that order winning a clash. `.safetensors` is
read first; a `.pth` (or `.pt`) is read only through `torch.load(weights_only=True)`, which builds
tensors, dicts and plain numbers and refuses any other pickled object: such a file is refused with
the reason, never unpickled.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from app.paths import utf8_names
from app.safetensors_files import SafetensorsFileError, read_header, refuse_bad_values

FOLDERS = ("ESRGAN", "RealESRGAN", "SwinIR", "DAT", "upscale_models")
SUFFIXES = (".safetensors", ".pth", ".pt")  # in the order a name is looked for
# Where `state_dict` wrappers keep the weights (BasicSR's `params_ema`, Lightning's `state_dict`, …):
# the keys spandrel's own canonicalisation unwraps.
_UNPICKLER_REASON = re.compile(r"WeightsUnpickler error: ([^\n]*?)(?:\. |\.?$)", re.MULTILINE)
_WRAPPERS = ("model_state_dict", "state_dict", "params_ema", "params-ema", "params", "model", "net")


class UpscalerFileError(ValueError):
    """An upscaler file that cannot be read safely; the message names it and says why."""


@dataclass(frozen=True)
class UpscalerEntry:
    name: str
    path: Path
    folder: str  # which of `FOLDERS` it lives in


class UpscalerLibrary:
    """The upscaler files under `models_dir`, listed afresh on every call (no refresh needed)."""

    def __init__(self, models_dir: Path) -> None:
        self.models_dir = models_dir

    def entries(self) -> list[UpscalerEntry]:
        found: dict[str, UpscalerEntry] = {}
        for folder in FOLDERS:
            root = self.models_dir / folder
            if not root.is_dir():
                continue
            files = [p for p in root.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES]
            for path in sorted(utf8_names(root, files, "upscaler"), key=lambda p: (p.stem, _rank(p))):
                found.setdefault(path.stem, UpscalerEntry(path.stem, path, folder))
        return sorted(found.values(), key=lambda e: e.name.lower())

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]

    def path_for(self, name: str) -> Path:
        """The file listed as `name` (a `.safetensors` before a `.pth` of the same stem): only a listed
        file, so a name from the API can never point anywhere else."""
        for entry in self.entries():
            if entry.name == name:
                return entry.path
        raise UpscalerFileError(f"upscaler {name!r} not found in {', '.join(f'models/{f}' for f in FOLDERS)} "
                                f"under {self.models_dir.parent}; choose one of: {', '.join(self.names()) or 'none'}")


def _rank(path: Path) -> int:
    return SUFFIXES.index(path.suffix.lower())


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors by name, on the CPU: refused if unreadable, holding anything but tensors,
    or holding NaN/Inf or values no half-precision file can hold."""
    if path.suffix.lower() == ".safetensors":
        try:
            read_header(path)  # names an empty, truncated or renamed-pickle file
        except SafetensorsFileError as exc:
            raise UpscalerFileError(str(exc)) from None
        tensors = load_file(str(path))
    else:
        tensors = _unwrap(path, _load_weights_only(path))
    refuse_bad_values(path, tensors, UpscalerFileError)
    return tensors


def _load_weights_only(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _UNPICKLER_REASON.search(str(exc))
        reason = found.group(1).strip() if found else "an object torch does not allow"
        raise UpscalerFileError(
            f"{path.name}: refused: it holds pickled objects that are not tensors ({reason}); only tensors are "
            "read from .pth files (torch.load with weights_only=True, nothing else is unpickled). Use a "
            ".safetensors copy of this model") from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise UpscalerFileError(f"{path.name}: not a readable PyTorch file ({exc})") from None


def _unwrap(path: Path, loaded: object) -> dict[str, torch.Tensor]:
    """The tensors of a `.pth`: a flat dict of them, or one inside a known wrapper key."""
    if isinstance(loaded, dict):
        inner = next((loaded[k] for k in _WRAPPERS if isinstance(loaded.get(k), dict)), loaded)
        if inner and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in inner.items()):
            return inner
    raise UpscalerFileError(f"{path.name}: not a state dict of named tensors (found {type(loaded).__name__}); "
                            "an upscaler file holds the model's weights by name")
