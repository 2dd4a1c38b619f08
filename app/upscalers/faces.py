"""Face-restoration model files: the folders A1111 reads them from and what a request for face restoration needs.

A1111 keeps GFPGAN models in `models/GFPGAN/` and CodeFormer in `models/Codeformer/`; a model is named by its
file stem, read by the upscalers' rules (`.safetensors` first, a `.pth` only without unpickling). The
restoration itself (find the faces, align, restore, paste back) is not built yet: the API lists the files
(`/sdapi/v1/face-restorers`) and refuses `restore_faces` by name, so a client never gets back a picture it
believes restored.
"""

from __future__ import annotations

from pathlib import Path

from app.paths import utf8_names
from app.upscalers.files import SUFFIXES

FACE_FOLDERS = ("GFPGAN", "Codeformer")


def model_files(models_dir: Path) -> list[Path]:
    """The face-restoration model files under `models_dir`, folder by folder in A1111's order, by name."""
    out = []
    for folder in FACE_FOLDERS:
        root = models_dir / folder
        if root.is_dir():
            files = [p for p in root.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES]
            out += sorted(utf8_names(root, files, "face restorer"), key=lambda p: p.name.lower())
    return out

