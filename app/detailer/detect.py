"""Detectors by name: the built-in face detector and the user's YOLO exports in `models/adetailer/`.

Names are what ADetailer lists and clients send (`GET /adetailer/v1/ad_model`): the built-in
`face_opencv_haar` (`haar_face`: no file, no download) first, then the folder's `.onnx` files by
file name. ADetailer's own names end in `.pt` (`face_yolov8n.pt`); such a name is served by the ONNX
export of the same stem when the folder has one, so a client written for ADetailer keeps working
once the file is converted. The `.pt` files themselves are ultralytics pickles and are never read;
a `.safetensors` detector is refused too, because its tensors come without an architecture that
this app could build them into (ultralytics defines its networks in code, per version).

What a detector finds is its file name's first word, as ADetailer's models are named (`face_`,
`hand_`, `person_`); a YOLO file's own class names (its metadata) must agree, and where it finds
more classes (a COCO model named `person_…`) only the named task's classes count.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from PIL import Image

from app.detailer import haar_face
from app.detailer.regions import Region
from app.paths import utf8_names

log = logging.getLogger(__name__)

BUILTIN_FACE = "face_opencv_haar"
TASKS = ("face", "hand", "person")
ONNX = ".onnx"
_PICKLES = (".pt", ".pth")
_SAFETENSORS = ".safetensors"
_HOW_TO_CONVERT = ("convert it once where ultralytics is installed: `yolo export model={file} format=onnx`, put "
                   "{stem}.onnx in {folder} and install the onnx extra (`pip install -e '.[onnx]'`)")


class DetectorError(ValueError):
    """A detector that cannot be used; the message names it and says why and what to do."""


def task_of(name: str) -> str | None:
    """What a detector finds, from its name's first word ("face_yolov8n.onnx" → "face"), or None."""
    head = re.split(r"[_\-.]", name.lower(), maxsplit=1)[0]
    return head if head in TASKS else None


class DetectorLibrary:
    """The detectors the app can run, the folder listed afresh on every call (no refresh needed)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        files = [p for p in self.folder.iterdir() if p.is_file()]
        return sorted(utf8_names(self.folder, files, "detector"), key=lambda p: p.name.lower())

    def names(self) -> list[str]:
        """The built-in face detector, then every `.onnx` file of the folder."""
        return [BUILTIN_FACE, *(p.name for p in self._files() if p.suffix.lower() == ONNX)]

    def refused(self) -> list[tuple[str, str]]:
        """Files in the folder that are not offered, with the reason: the Detailer tab shows them."""
        return [(p.name, _refusal(p, self.folder)) for p in self._files()
                if p.suffix.lower() in (*_PICKLES, _SAFETENSORS)]

    def path_for(self, name: str) -> Path:
        """The ONNX file `name` is served by (itself, or the export of a `.pt` name's stem)."""
        files = {p.name: p for p in self._files()}
        wanted = Path(name)
        if wanted.name != name or name.startswith("."):
            raise DetectorError(f"detector {name!r}: a file name in {self.folder} is expected, not a path")
        if wanted.suffix.lower() in _PICKLES and wanted.stem + ONNX in files:
            return files[wanted.stem + ONNX]
        if name in files and wanted.suffix.lower() == ONNX:
            return files[name]
        if name in files:
            raise DetectorError(_refusal(files[name], self.folder))
        if wanted.suffix.lower() in _PICKLES:
            raise DetectorError(f"detector {name!r} is ADetailer's ultralytics file, which this app does not download "
                                "and would not unpickle; " + _HOW_TO_CONVERT.format(
                                    file=name, stem=wanted.stem, folder=self.folder))
        raise DetectorError(f"detector {name!r} not found; choose one of: {', '.join(self.names())}")

    def _open(self, name: str) -> tuple[object, tuple[int, ...] | None]:
        """The opened ONNX detector and the class indices that count for its task."""
        path = self.path_for(name)
        try:
            from app.detailer import onnx_detector
        except ImportError:
            raise DetectorError(f"detector {name!r} is an ONNX file, which needs onnxruntime: install the onnx "
                                "extra (`pip install -e '.[onnx]'`)") from None
        try:
            model = onnx_detector.open_file(path)
        except ValueError as exc:
            raise DetectorError(str(exc)) from None
        if model.task not in onnx_detector.REGION_TASKS:
            raise DetectorError(f"{path.name} is a YOLO {model.task!r} model; the Detailer needs one that finds "
                                f"regions ({' or '.join(onnx_detector.REGION_TASKS)})")
        return model, _classes(path.name, model.names)

    def check(self, name: str) -> None:
        """Refuse, before a generation starts, a detector that `detect` would refuse."""
        if name != BUILTIN_FACE:
            self._open(name)

    def detect(self, image: Image.Image, name: str, confidence: float) -> list[Region]:
        """What detector `name` finds in `image` scoring at least `confidence`."""
        if name == BUILTIN_FACE:
            return haar_face.find_faces(image, confidence)
        from app.detailer import onnx_detector  # _open has checked it imports
        model, classes = self._open(name)
        return onnx_detector.run(model, image, confidence, classes)


def _classes(file_name: str, names: dict[int, str]) -> tuple[int, ...] | None:
    """The class indices that count: those whose names hold the file name's task word (None: all, for a
    file whose name or metadata names no task). A model whose classes never name its task is refused."""
    task = task_of(file_name)
    if task is None or all(label.isdigit() for label in names.values()):
        return None
    matching = tuple(i for i, label in names.items() if task in label.lower())
    if not matching:
        found = ", ".join(list(names.values())[:6]) + (", …" if len(names) > 6 else "")
        raise DetectorError(f"{file_name} is named as a {task} detector, but the model finds {found}: a detector for "
                            f"another task; use a {task} detector, or rename the file after what it finds")
    return None if len(matching) == len(names) else matching


def _refusal(path: Path, folder: Path) -> str:
    if path.suffix.lower() == _SAFETENSORS:
        return (f"{path.name}: a .safetensors detector holds weights without the network that uses them, and no "
                "detector architecture is defined for it here; export the detector to ONNX instead "
                f"(`yolo export model=<its .pt> format=onnx`) and put the .onnx file in {folder}")
    return (f"{path.name} is an ultralytics PyTorch file, which is a pickle: loading it could run code hidden in it, "
            "so it is not read; " + _HOW_TO_CONVERT.format(file=path.name, stem=path.stem, folder=folder))
