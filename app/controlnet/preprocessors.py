"""ControlNet preprocessors: a unit's picture -> the control map its model was trained on, by A1111 module name.

Why one registry: the UI's module menu, `/controlnet/module_list` (with the extension's slider details),
the API's unit check and the engine's `detect_map` call all read the same records, so a module the
list offers is a module that runs, with the same thresholds and defaults. Names, threshold labels,
ranges and defaults are sd-webui-controlnet's, because clients send its names and numbers.

The built-in modules need no download (numpy and OpenCV). Model-based ones (depth, normals, anime
lineart) read `<module>.onnx` from `models/ControlNetPreprocessor/` (`preprocessor_models`): never a
pickle; without the file they are listed as unavailable, with the file they need.

Sizes: a module that takes the "Preprocessor Resolution" scales the picture so its short side is that
resolution (area filter down, cubic up) before detecting, and returns the map at that size; the engine
resizes the map to the generation by the unit's resize mode. `none`, `invert`, `tile_resample` and
`inpaint_only` keep the picture's size, as the extension does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from app.controlnet import preprocessor_models

RESOLUTION_LABEL = "Preprocessor Resolution"  # the extension's label for processor_res
RESOLUTION_RANGE = (64, 2048, 512)  # low, high, default
MAX_MAP_PIXELS = 4096 * 4096  # one map, as one input picture (`app.image_inputs.MAX_INPUT_PIXELS`)


@dataclass(frozen=True)
class Slider:
    """One threshold slider as the extension describes it (`module_detail`)."""

    label: str
    default: float
    low: float
    high: float
    step: float = 1.0

    def value(self, asked: float) -> float:
        """`asked`, or the default where a client sent -1 (the extension's "use the default")."""
        if asked == -1:
            return self.default
        if not self.low <= asked <= self.high:
            raise ValueError(f"{self.label} must be in {self.low:g}…{self.high:g}, got {asked:g}")
        return float(asked)


Detect = Callable[[np.ndarray, float, float], np.ndarray]  # RGB uint8 HWC, threshold a, b -> map (HW or HWC)


@dataclass(frozen=True)
class Preprocessor:
    """One module: its A1111 name (and the extension's longer UI alias), its sliders, and how it detects."""

    name: str
    detect: Detect | None  # None: a model-based module (`preprocessor_models` runs it)
    uses_resolution: bool = True
    threshold_a: Slider | None = None
    threshold_b: Slider | None = None
    alias: str | None = None
    takes_mask: bool = False

    def sliders(self) -> list[dict | None]:
        """The extension's `module_detail[...]["sliders"]`: resolution (or None), then the thresholds."""
        low, high, default = RESOLUTION_RANGE
        first = {"name": RESOLUTION_LABEL, "value": default, "min": low, "max": high} if self.uses_resolution else None
        rest = [{"name": s.label, "value": s.default, "min": s.low, "max": s.high, "step": s.step}
                for s in (self.threshold_a, self.threshold_b) if s is not None]
        return [first, *rest] if first or rest else []


def _gray(image: np.ndarray) -> np.ndarray:
    return cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)


def _canny(image: np.ndarray, low: float, high: float) -> np.ndarray:
    return cv2.Canny(image, low, high)


def _threshold(image: np.ndarray, level: float, _b: float) -> np.ndarray:
    """Each channel white where it is above the level, black elsewhere (the extension's binarization)."""
    return np.where(image > level, 255, 0).astype(np.uint8)


def _scribble_xdog(image: np.ndarray, level: float, _b: float) -> np.ndarray:
    """Difference of Gaussians (σ 0.5 minus σ 5) on the darkest channel, white where twice it passes the
    XDoG threshold: the strokes a pencil would draw, as white scribbles on black."""
    pixels = image.astype(np.float32)
    fine = cv2.GaussianBlur(pixels, (0, 0), 0.5)
    coarse = cv2.GaussianBlur(pixels, (0, 0), 5.0)
    darkening = np.clip(np.min(coarse - fine, axis=2), 0, 255)
    return np.where(2 * darkening > level, 255, 0).astype(np.uint8)


def _lineart_standard(image: np.ndarray, _a: float, _b: float) -> np.ndarray:
    """How much darker each pixel is than its σ-6 surroundings (lines on any background), scaled by the
    median of the clear lines so the strokes come out near half-white: white lines on black."""
    pixels = image.astype(np.float32)
    darkening = np.clip(np.min(cv2.GaussianBlur(pixels, (0, 0), 6.0) - pixels, axis=2), 0, 255)
    lines = darkening[darkening > 8]
    scale = max(16.0, float(np.median(lines))) if lines.size else 16.0
    return np.clip(darkening / scale * 127, 0, 255).astype(np.uint8)


def _tile_resample(image: np.ndarray, rate: float, _b: float) -> np.ndarray:
    """Down-sampled by `rate` (area filter): the tile model then adds the detail back. Below 1.1: unchanged."""
    if rate < 1.1:
        return image
    height, width = image.shape[:2]
    size = (max(1, round(width / rate)), max(1, round(height / rate)))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)


def _blur(image: np.ndarray, sigma: float, _b: float) -> np.ndarray:
    return cv2.GaussianBlur(image, (0, 0), sigma)


def _same(image: np.ndarray, _a: float, _b: float) -> np.ndarray:
    return image


def _invert(image: np.ndarray, _a: float, _b: float) -> np.ndarray:
    return 255 - image


PREPROCESSORS: tuple[Preprocessor, ...] = (
    Preprocessor("none", _same, uses_resolution=False),
    Preprocessor("canny", _canny, threshold_a=Slider("Canny Low Threshold", 100, 1, 255),
                 threshold_b=Slider("Canny High Threshold", 200, 1, 255)),
    Preprocessor("invert", _invert, uses_resolution=False, alias="invert (from white bg & black line)"),
    Preprocessor("threshold", _threshold, threshold_a=Slider("Binarization Threshold", 127, 0, 255)),
    Preprocessor("scribble_xdog", _scribble_xdog, threshold_a=Slider("XDoG Threshold", 32, 1, 64)),
    Preprocessor("lineart_standard", _lineart_standard, alias="lineart_standard (from white bg & black line)"),
    Preprocessor("tile_resample", _tile_resample, uses_resolution=False,
                 threshold_a=Slider("Down Sampling Rate", 1.0, 1.0, 8.0, 0.01)),
    Preprocessor("blur_gaussian", _blur, threshold_a=Slider("Sigma", 9.0, 0.01, 64.0, 0.01)),
    Preprocessor("inpaint_only", None, uses_resolution=False, takes_mask=True),
    *(Preprocessor(name, None) for name in preprocessor_models.MODEL_MODULES),
)


def find(module: str) -> Preprocessor:
    """The module by its name or the extension's alias (any case); a ValueError naming the choices."""
    asked = (module or "none").strip().lower()
    for pre in PREPROCESSORS:
        if asked in (pre.name, (pre.alias or "").lower()):
            return pre
    raise ValueError(f"unknown ControlNet preprocessor {module!r}; GET /controlnet/module_list lists "
                     f"{', '.join(p.name for p in PREPROCESSORS)}")


@dataclass(frozen=True)
class ModuleInfo:
    """One row of the module list: whether it runs here, and why not."""

    name: str
    alias: str
    available: bool
    reason: str
    sliders: list


def module_list(models_dir: Path) -> list[ModuleInfo]:
    """Every module, with whether it can run now (model-based ones need their file in `models_dir`)."""
    rows = []
    for pre in PREPROCESSORS:
        reason = preprocessor_models.unavailable_reason(pre.name, models_dir) if pre.detect is None and \
            not pre.takes_mask else ""
        rows.append(ModuleInfo(pre.name, pre.alias or pre.name, not reason, reason, pre.sliders()))
    return rows


def check_module(module: str, models_dir: Path) -> Preprocessor:
    """The module when it can run now; a ValueError saying why not (unknown name, missing or unsafe file)."""
    pre = find(module)
    if pre.detect is None and not pre.takes_mask:
        reason = preprocessor_models.unavailable_reason(pre.name, models_dir)
        if reason:
            raise ValueError(f"ControlNet preprocessor {pre.name} is unavailable: {reason}")
    return pre


def fit_short_side(image: np.ndarray, resolution: int) -> np.ndarray:
    """`image` scaled so its short side is `resolution` (area filter down, cubic up; unchanged when equal). A
    map over `MAX_MAP_PIXELS` is refused: a 4096×64 picture at resolution 2048 would be 131072×2048 (800 MB)."""
    height, width = image.shape[:2]
    scale = resolution / min(height, width)
    if scale == 1:
        return image
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    if size[0] * size[1] > MAX_MAP_PIXELS:
        raise ValueError(f"a {width}x{height} picture at {RESOLUTION_LABEL.lower()} {resolution} makes a "
                         f"{size[0]}x{size[1]} map, over {MAX_MAP_PIXELS:,} pixels: lower the resolution")
    return cv2.resize(image, size, interpolation=cv2.INTER_CUBIC if scale > 1 else cv2.INTER_AREA)


def inpaint_condition(image: Image.Image, mask: Image.Image | None) -> np.ndarray:
    """The inpaint ControlNet's input (diffusers' `make_inpaint_condition`): RGB in 0…1, float32, HWC, with the
    masked pixels (mask > 127, white = repaint, A1111's convention) set to -1 so the model knows what to fill."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    if mask is not None:
        masked = np.asarray(mask.convert("L").resize(image.size, Image.Resampling.NEAREST)) > 127
        pixels[masked] = -1.0
    return pixels


def _inpaint_map(image: Image.Image, mask: Image.Image | None) -> np.ndarray:
    """What the preview shows for `inpaint_only`: the picture with the masked pixels black (-1 clipped to 0).
    The engine gives the model `inpaint_condition` itself, which keeps the -1 marking."""
    return (np.clip(inpaint_condition(image, mask), 0, 1) * 255).round().astype(np.uint8)


def _as_rgb(result: np.ndarray) -> Image.Image:
    return Image.fromarray(np.repeat(result[..., None], 3, axis=2) if result.ndim == 2 else result, "RGB")


def detect_map(module: str, image: Image.Image, resolution: int, threshold_a: float, threshold_b: float, *,
               mask: Image.Image | None = None, models_dir: Path | None = None) -> Image.Image:
    """The control map (RGB) `module` detects in `image`. `resolution` is the unit's processor resolution
    (64…2048), the thresholds its threshold_a/b (-1: the module's default); `mask` is the unit's inpaint mask
    (`inpaint_only` only); `models_dir` the folder of model files (model-based modules only)."""
    pre = find(module)
    if pre.uses_resolution and not RESOLUTION_RANGE[0] <= resolution <= RESOLUTION_RANGE[1]:
        raise ValueError(f"{RESOLUTION_LABEL} must be in {RESOLUTION_RANGE[0]}…{RESOLUTION_RANGE[1]}, got "
                         f"{resolution}")
    a = pre.threshold_a.value(threshold_a) if pre.threshold_a else 0.0
    b = pre.threshold_b.value(threshold_b) if pre.threshold_b else 0.0
    if pre.takes_mask:
        return _as_rgb(_inpaint_map(image, mask))
    pixels = np.asarray(image.convert("RGB"))
    if pre.uses_resolution:
        pixels = fit_short_side(pixels, resolution)
    if pre.detect is None:
        if models_dir is None:
            raise ValueError(f"ControlNet preprocessor {pre.name} needs the folder of its model file "
                             f"({preprocessor_models.FOLDER_NAME})")
        return _as_rgb(preprocessor_models.run(pre.name, pixels, models_dir))
    return _as_rgb(pre.detect(pixels, a, b))
