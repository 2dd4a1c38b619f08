"""A user's YOLO detector exported to ONNX, run by onnxruntime (the optional `onnx` extra).

Why ONNX: ADetailer's detectors are ultralytics `.pt` files, which are pickles (loading one runs
code); `yolo export model=face_yolov8n.pt format=onnx` writes the same network as a graph plus
weights that run no code on load. ultralytics stores what the network finds in the file's metadata
(`task`: detect, segment, pose, …; `names`: {0: 'face'}; `imgsz`), read here to refuse a network
that cannot give regions. It runs on the CPU: a YOLOv8n pass is tens of milliseconds there, and the
accelerator's memory stays the engine's. Its session is opened by `app.controlnet.onnx_session`, the one
module that imports onnxruntime.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from app.controlnet.onnx_session import open_session
from app.detailer import yolo
from app.detailer.regions import Region

REGION_TASKS = ("detect", "segment")
_DEFAULT_SIZE = 640  # ultralytics' export size when the file states none


@dataclass(frozen=True)
class YoloFile:
    """An opened export: its session, what it finds (`names` by class index), its input size."""

    session: object  # onnxruntime.InferenceSession
    task: str
    names: dict[int, str]
    width: int
    height: int


def _literal(text: str | None) -> object:
    """A metadata value ultralytics writes as a Python literal ("{0: 'face'}", "[640, 640]"); literals only."""
    try:
        return ast.literal_eval(text) if text else None
    except (ValueError, SyntaxError):
        return None


def open_file(path: Path) -> YoloFile:
    """Open `path`; ValueError naming the file when onnxruntime cannot read it or its outputs are not
    a YOLOv8 head's."""
    session = open_session(path, ["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1 or len(inputs[0].shape) != 4 or len(outputs[0].shape) != 3:
        raise ValueError(f"{path.name}: not a YOLOv8 export (one image input (1, 3, H, W) and a (1, 4 + classes, N) "
                         f"output); it has inputs {[i.shape for i in inputs]}, outputs {[o.shape for o in outputs]}")
    task = meta.get("task") or ("segment" if len(outputs) == 2 else "detect")
    rows = outputs[0].shape[1]
    names = _literal(meta.get("names"))
    if not isinstance(names, dict):
        if not isinstance(rows, int):
            raise ValueError(f"{path.name}: the number of classes is neither in its metadata nor in its output shape")
        count = rows - 4 - (yolo.MASK_COEFFICIENTS if task == "segment" else 0)
        names = {i: str(i) for i in range(count)}
    height, width = inputs[0].shape[2:]
    size = _literal(meta.get("imgsz"))
    if not (isinstance(height, int) and isinstance(width, int)):
        height, width = size if isinstance(size, list) and len(size) == 2 else (_DEFAULT_SIZE, _DEFAULT_SIZE)
    return YoloFile(session, task, {int(k): str(v) for k, v in names.items()}, int(width), int(height))


def run(model: YoloFile, image: Image.Image, confidence: float, classes: tuple[int, ...] | None) -> list[Region]:
    """The regions `model` finds in `image` at `confidence`, of the given class indices (None: all)."""
    batch, fit = yolo.letterbox(image, model.width, model.height)
    outputs = model.session.run(None, {model.session.get_inputs()[0].name: batch})
    boxes, scores, coefficients = yolo.decode(np.asarray(outputs[0], dtype=np.float32), len(model.names),
                                              confidence, classes)
    masks = None
    if model.task == "segment" and len(outputs) > 1:
        masks = yolo.segment_masks(coefficients, np.asarray(outputs[1], dtype=np.float32), boxes, fit, image.size)
    return yolo.to_regions(boxes, scores, fit, image.size, masks)
