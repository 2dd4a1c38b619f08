"""Running one ONNX network on one image batch (the optional `onnx` extra: onnxruntime).

Why ONNX: a model-based preprocessor (depth, normals, lineart) is a network the app does not build
in; ONNX carries the graph and the weights together in a format that runs no code on load, unlike
the `.pth` pickles the extension downloads. Only this module imports onnxruntime (the Detailer's ONNX detectors
open their sessions here too), so the app runs without the extra and lists those modules as unavailable
(`preprocessor_models`).
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import onnxruntime


def open_session(path: Path, providers: list[str] | None = None) -> onnxruntime.InferenceSession:
    """An onnxruntime session on `path` (`providers`: every available one when None); ValueError naming the file
    when onnxruntime cannot read it."""
    try:
        return onnxruntime.InferenceSession(str(path), providers=providers or onnxruntime.get_available_providers())
    except Exception as exc:  # onnxruntime's own error types (InvalidProtobuf, Fail, …) share no base but Exception
        raise ValueError(f"{path.name} is not an ONNX model onnxruntime can read: {exc}") from None


def run_image(path: Path, batch: np.ndarray, multiple: int) -> np.ndarray:
    """The network's first output for `batch` (NCHW float32). A network with a fixed input size gets the batch
    resized to it by the caller's `resize`; one with free sizes takes it as is (`multiple`: its sides' step)."""
    session = open_session(path)
    inputs = session.get_inputs()
    if len(inputs) != 1 or len(inputs[0].shape) != 4:
        raise ValueError(f"{path.name}: a preprocessor network takes one image input (N, C, H, W), this one takes "
                         f"{[tuple(i.shape) for i in inputs]}")
    height, width = inputs[0].shape[2:]
    if isinstance(height, int) and isinstance(width, int):
        batch = _resized(batch, height, width)
    elif batch.shape[2] % multiple or batch.shape[3] % multiple:
        batch = _resized(batch, *(max(multiple, round(side / multiple) * multiple) for side in batch.shape[2:]))
    return np.asarray(session.run(None, {inputs[0].name: batch})[0], dtype=np.float32)


def _resized(batch: np.ndarray, height: int, width: int) -> np.ndarray:
    planes = [cv2.resize(np.ascontiguousarray(plane), (width, height), interpolation=cv2.INTER_CUBIC)
              for plane in batch[0]]
    return np.stack(planes)[None].astype(np.float32)
