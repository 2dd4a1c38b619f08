"""Face-restoration model files: the folders A1111 reads them from, which one runs, and what spandrel builds.

A1111 keeps GFPGAN models in `models/GFPGAN/` and CodeFormer in `models/Codeformer/`; a model is named by its
file stem, read by the upscalers' rules (`.safetensors` first, a `.pth` only through
`torch.load(weights_only=True)`, never unpickled). A1111 downloads a model when none is there; this app never
downloads, so `restore_faces` with no file is refused naming the folders (`FaceModelError`).

Which file runs: A1111's setting `face_restoration_model` picks GFPGAN or CodeFormer; here the first file found
runs, `models/GFPGAN/` before `models/Codeformer/`, and the infotext names its kind as A1111 writes it
(`Face restoration: GFPGAN`). spandrel 0.4.2 builds GFPGAN (v1 "clean") and RestoreFormer from their tensors;
CodeFormer is in `spandrel_extra_arches`, under a non-commercial licence, so this app does not depend on it:
a CodeFormer file is refused with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import spandrel
import torch

from app.paths import utf8_names
from app.upscalers.arch import UpscalerFormatError, build
from app.upscalers.files import SUFFIXES

FACE_FOLDERS = ("GFPGAN", "Codeformer")
KINDS = {"GFPGAN": "GFPGAN", "Codeformer": "CodeFormer"}  # folder -> the name A1111's infotext gives
PURPOSE = "FaceSR"  # spandrel's purpose of face-restoration models
DEFAULT_SIZE = 512  # the face side GFPGAN, CodeFormer and RestoreFormer were trained at
_CODEFORMER_KEYS = ("position_emb", "idx_pred_layer.0.weight")  # tensors only a CodeFormer file holds
_EXTRA_ARCHES = "spandrel_extra_arches"


class FaceModelError(ValueError):
    """No face-restoration model to run, or one that cannot be built; the message says which and why."""


@dataclass(frozen=True)
class FaceModel:
    name: str  # the file stem
    path: Path
    kind: str  # "GFPGAN" or "CodeFormer": the folder's, as A1111's infotext writes it


def model_files(models_dir: Path, folders: tuple[str, ...] = FACE_FOLDERS) -> list[Path]:
    """The face-restoration model files under `models_dir`, folder by folder in A1111's order, by name."""
    out = []
    for folder in folders:
        root = models_dir / folder
        if root.is_dir():
            files = [p for p in root.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES]
            out += sorted(utf8_names(root, files, "face restorer"), key=lambda p: p.name.lower())
    return out


def first_model(models_dir: Path, folders: tuple[str, ...] = FACE_FOLDERS) -> FaceModel:
    """The model `restore_faces` runs (see the module docstring; Extras names one folder), or why there is none."""
    files = model_files(models_dir, folders)
    if not files:
        kinds = " or ".join(KINDS[f] for f in folders)
        raise FaceModelError(f"face restoration needs a {kinds} model file (.safetensors, or a .pth "
                             f"of tensors) in {' or '.join(f'models/{f}' for f in folders)} under "
                             f"{models_dir.parent}; A1111 would download one, which this app never does")
    path = files[0]
    return FaceModel(path.stem, path, KINDS[path.parent.name])


def describe(state_dict: dict[str, torch.Tensor], name: str):
    """spandrel's descriptor of a face-restoration model (on the CPU, eval mode), or `UpscalerFormatError`."""
    if all(k in state_dict for k in _CODEFORMER_KEYS):
        raise UpscalerFormatError(f"face restorer {name!r} is a CodeFormer model: spandrel builds it only with "
                                  f"the separate package {_EXTRA_ARCHES} (non-commercial licence, so not a "
                                  "dependency of this app); use a GFPGAN or RestoreFormer model")
    descriptor = build(state_dict, f"face restorer {name!r}", spandrel.MAIN_REGISTRY)
    if getattr(descriptor, "purpose", None) != PURPOSE or (descriptor.input_channels,
                                                          descriptor.output_channels) != (3, 3):
        raise UpscalerFormatError(f"face restorer {name!r}: a {descriptor.architecture.name} model for "
                                  f"{getattr(descriptor, 'purpose', 'another task')}, not an RGB face restorer")
    descriptor.model.eval().requires_grad_(False)
    return descriptor


def input_size(descriptor) -> int:
    """The face side the model takes: spandrel's minimum where it states one (GFPGAN: 512), else 512, rounded
    up to the multiple it needs (RestoreFormer: 32)."""
    needs = descriptor.size_requirements
    side = max(needs.minimum or 0, DEFAULT_SIZE)
    return -(-side // needs.multiple_of) * needs.multiple_of
