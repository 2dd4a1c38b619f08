"""Model-based ControlNet preprocessors: the network file a user puts in `models/ControlNetPreprocessor/`.

Each module reads `<module>.onnx` (e.g. `depth_anything.onnx`, an ONNX export of Depth Anything): one
image input (N, 3, H, W) and one output. The record below says how that network wants its pixels
(mean and std per channel, the step of its sides) and what its output means (depth, normals, lines),
which turns the output into the map the ControlNet was trained on. Pickles (`.pth`, `.pt`, `.ckpt`,
`.bin`) are never opened: one found in place of the ONNX file is named in the reason the module is
unavailable. onnxruntime comes with the optional `onnx` extra (`pip install -e .[onnx]`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

FOLDER_NAME = "models/ControlNetPreprocessor"
PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin", ".pkl")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)  # x/127.5 - 1


@dataclass(frozen=True)
class ModelRecipe:
    """How one network takes pixels and what its output is: "depth" (relative inverse depth, near = white),
    "normal" (3 channels in -1…1) or "lines" (one channel in -1…1, dark lines, inverted to white on black)."""

    module: str
    output: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    multiple: int


RECIPES = (
    ModelRecipe("depth_midas", "depth", HALF, HALF, 32),
    ModelRecipe("depth_anything", "depth", IMAGENET_MEAN, IMAGENET_STD, 14),
    ModelRecipe("normal_bae", "normal", IMAGENET_MEAN, IMAGENET_STD, 8),
    ModelRecipe("lineart_anime", "lines", HALF, HALF, 8),
)
MODEL_MODULES = tuple(recipe.module for recipe in RECIPES)


def _recipe(module: str) -> ModelRecipe:
    return next(recipe for recipe in RECIPES if recipe.module == module)


def model_file(module: str, folder: Path) -> Path:
    return folder / f"{module}.onnx"


def unavailable_reason(module: str, folder: Path) -> str:
    """Why `module` cannot run with the files in `folder` ("" when it can)."""
    if model_file(module, folder).is_file():
        if importlib.util.find_spec("onnxruntime") is None:
            return f"{module}.onnx needs onnxruntime: pip install -e .[onnx]"
        return ""
    pickles = [folder / f"{module}{suffix}" for suffix in PICKLE_SUFFIXES if (folder / f"{module}{suffix}").is_file()]
    if pickles:
        return (f"{pickles[0].name} is a pickle, which this app never opens (it can run code): export the network "
                f"to ONNX as {FOLDER_NAME}/{module}.onnx")
    return f"needs {FOLDER_NAME}/{module}.onnx (an ONNX export of the network)"


def run(module: str, pixels: np.ndarray, folder: Path) -> np.ndarray:
    """The map (uint8, HW or HWC, the size of `pixels`) `module`'s network makes of `pixels` (RGB uint8 HWC)."""
    reason = unavailable_reason(module, folder)
    if reason:
        raise ValueError(f"ControlNet preprocessor {module} is unavailable: {reason}")
    from app.controlnet import onnx_session  # only with the extra installed

    recipe = _recipe(module)
    batch = ((pixels.astype(np.float32) / 255.0 - np.array(recipe.mean, np.float32)) / np.array(recipe.std, np.float32))
    output = onnx_session.run_image(model_file(module, folder), batch.transpose(2, 0, 1)[None], recipe.multiple)
    return _to_map(output, recipe.output, pixels.shape[:2], module)


def _to_map(output: np.ndarray, kind: str, size: tuple[int, int], module: str) -> np.ndarray:
    planes = output.reshape(-1, *output.shape[-2:]) if output.ndim >= 2 else output
    wanted = 3 if kind == "normal" else 1
    if output.ndim < 2 or planes.shape[0] != wanted:
        raise ValueError(f"{module}.onnx gave an output of shape {tuple(output.shape)}; a {kind} network gives "
                         f"{wanted} plane(s) of H×W")
    if kind == "depth":
        low, high = float(planes.min()), float(planes.max())
        values = (planes[0] - low) / (high - low) if high > low else np.zeros_like(planes[0])
    elif kind == "normal":
        values = np.clip((planes.transpose(1, 2, 0) + 1) * 0.5, 0, 1)
    else:
        values = 1 - np.clip((planes[0] + 1) * 0.5, 0, 1)
    result = (values * 255).round().astype(np.uint8)
    height, width = size
    return cv2.resize(result, (width, height), interpolation=cv2.INTER_LINEAR) if result.shape[:2] != size else result
