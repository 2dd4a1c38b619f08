"""ControlNet preprocessors (`app/controlnet/preprocessors.py`): each built-in module on a drawn picture, the
module list the UI and `/controlnet/module_list` show, and the model-file path (ONNX run end to end, pickles
never opened)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from app.controlnet import preprocessor_models
from app.controlnet.preprocessors import PREPROCESSORS, detect_map, find, inpaint_condition, module_list

SIDE = 128
SQUARE = (32, 32, 95, 95)  # a 64-pixel black square drawn on white


def _square(ink: str = "black") -> Image.Image:
    image = Image.new("RGB", (SIDE, SIDE), "white")
    ImageDraw.Draw(image).rectangle(SQUARE, fill=ink)
    return image


def _gradient(rows: int = 64) -> Image.Image:
    """Every value 0…255 once per row, three channels shifted so each channel differs."""
    row = np.arange(256, dtype=np.uint8)
    pixels = np.stack([np.tile(np.roll(row, shift), (rows, 1)) for shift in (0, 85, 170)], axis=2)
    return Image.fromarray(pixels, "RGB")


def _plane(image: Image.Image) -> np.ndarray:
    pixels = np.asarray(image)
    assert image.mode == "RGB" and (pixels == pixels[..., :1]).all(), "a one-plane map is written as gray RGB"
    return pixels[..., 0]


def _near_border(ys: np.ndarray, xs: np.ndarray, slack: int = 1) -> bool:
    left, top, right, bottom = SQUARE
    on_x = (np.abs(xs - left) <= slack) | (np.abs(xs - right) <= slack)
    on_y = (np.abs(ys - top) <= slack) | (np.abs(ys - bottom) <= slack)
    inside = (xs >= left - slack) & (xs <= right + slack) & (ys >= top - slack) & (ys <= bottom + slack)
    return bool(((on_x | on_y) & inside).all())


def test_canny_finds_the_squares_outline_and_honours_its_two_thresholds():
    """canny: a 64-px black square on white gives its one-pixel outline, 4·64−4 = 252 edge pixels, all on the
    border; a faint square (contrast 30) passes the defaults' high threshold 200 nowhere, but thresholds 10/20
    (threshold_a/b = low/high) find it: the thresholds reach OpenCV."""
    edges = _plane(detect_map("canny", _square(), SIDE, -1, -1))
    ys, xs = np.nonzero(edges)
    assert len(ys) == 252 and set(np.unique(edges)) == {0, 255}
    assert _near_border(ys, xs)
    faint = Image.new("RGB", (SIDE, SIDE), (128, 128, 128))
    ImageDraw.Draw(faint).rectangle(SQUARE, fill=(98, 98, 98))
    assert _plane(detect_map("canny", faint, SIDE, -1, -1)).sum() == 0
    assert (_plane(detect_map("canny", faint, SIDE, 10, 20)) > 0).sum() == 252


def test_invert_and_threshold_are_exact():
    """invert is 255 − pixel, at the picture's own size whatever the resolution; threshold is white where a
    channel is above the level (threshold_a; -1 = the extension's default 127), black elsewhere, exactly."""
    picture = _gradient()
    pixels = np.asarray(picture).astype(np.int16)
    inverted = detect_map("invert", picture, 512, -1, -1)
    assert inverted.size == picture.size and (np.asarray(inverted) == 255 - pixels).all()
    for level, asked in ((127, -1), (100, 100), (0, 0)):
        binary = np.asarray(detect_map("threshold", picture, 64, asked, -1))
        assert (binary == np.where(pixels > level, 255, 0)).all(), level


def test_scribble_xdog_and_lineart_draw_white_lines_along_the_outline_only():
    """scribble_xdog and lineart_standard: white strokes on black, all within a few pixels of the square's
    border, none in the flat inside or background; a higher XDoG threshold keeps fewer stroke pixels."""
    for module in ("scribble_xdog", "lineart_standard"):
        lines = _plane(detect_map(module, _square(), SIDE, -1, -1))
        ys, xs = np.nonzero(lines > 64)
        assert len(ys) > 4 * 64, module
        assert _near_border(ys, xs, slack=8), module
        assert lines[64, 64] == 0 and lines[4, 4] == 0, module
    few = (_plane(detect_map("scribble_xdog", _square(), SIDE, 64, -1)) > 0).sum()
    many = (_plane(detect_map("scribble_xdog", _square(), SIDE, 1, -1)) > 0).sum()
    assert few < many


def test_resolution_sets_the_maps_short_side_and_tile_resample_downsamples_by_its_rate():
    """A module with the resolution slider returns its map with the short side at `resolution` (a 256×128
    picture at 64 gives 128×64); tile_resample keeps the size at rate 1 (pixels equal) and divides it at 2."""
    wide = _square().resize((256, 128))
    assert detect_map("canny", wide, 64, -1, -1).size == (128, 64)
    assert detect_map("blur_gaussian", wide, 256, -1, -1).size == (512, 256)
    picture = _square()
    assert (np.asarray(detect_map("tile_resample", picture, 512, -1, -1)) == np.asarray(picture)).all()
    half = detect_map("tile_resample", picture, 512, 2.0, -1)
    assert half.size == (SIDE // 2, SIDE // 2)
    assert np.asarray(half)[8, 8].tolist() == [255, 255, 255] and np.asarray(half)[32, 32].tolist() == [0, 0, 0]


def test_blur_gaussian_smooths_more_with_a_larger_sigma_and_keeps_the_mean():
    """blur_gaussian (threshold_a = sigma): the mean brightness stays (within 1 level), the sharpest step
    between neighbours shrinks, and more with sigma 8 than with sigma 1."""
    picture = _square()

    def steepest(sigma: float) -> tuple[float, int]:
        pixels = _plane(detect_map("blur_gaussian", picture, SIDE, sigma, -1)).astype(np.int16)
        return float(pixels.mean()), int(np.abs(np.diff(pixels, axis=1)).max())

    mean = float(np.asarray(picture)[..., 0].mean())
    (mean_1, step_1), (mean_8, step_8) = steepest(1.0), steepest(8.0)
    assert abs(mean_1 - mean) < 1 and abs(mean_8 - mean) < 1
    assert step_8 < step_1 < 255


def test_inpaint_only_blanks_the_masked_pixels_and_gives_the_engine_minus_one_there():
    """inpaint_only: the map is the picture with the masked pixels (mask white > 127) black and the rest
    unchanged; `inpaint_condition` (what the inpaint ControlNet takes, diffusers' make_inpaint_condition) is
    the picture in 0…1 with exactly the masked pixels at -1. Without a mask nothing is blanked."""
    picture = _gradient()
    mask = Image.new("L", picture.size, 0)
    ImageDraw.Draw(mask).rectangle((10, 10, 29, 19), fill=255)
    masked = np.asarray(mask) > 127
    shown = np.asarray(detect_map("inpaint_only", picture, 512, -1, -1, mask=mask))
    assert (shown[masked] == 0).all() and (shown[~masked] == np.asarray(picture)[~masked]).all()
    condition = inpaint_condition(picture, mask)
    assert condition.dtype == np.float32 and (condition[masked] == -1).all()
    assert np.array_equal(condition[~masked], np.asarray(picture, dtype=np.float32)[~masked] / 255)
    assert (np.asarray(detect_map("inpaint_only", picture, 512, -1, -1)) == np.asarray(picture)).all()


def test_bad_module_resolution_or_threshold_is_one_clear_error():
    """An unknown module names the choices; the extension's alias names work; a resolution or threshold out of
    the extension's range is refused naming the slider and its range; a map over 4096² pixels (a thin picture
    at a high resolution) is refused before any memory is taken for it."""
    with pytest.raises(ValueError, match="unknown ControlNet preprocessor 'sobel'.*canny"):
        detect_map("sobel", _square(), 512, -1, -1)
    assert find("invert (from white bg & black line)").name == "invert" and find("Canny").name == "canny"
    with pytest.raises(ValueError, match="Preprocessor Resolution must be in 64…2048, got 4096"):
        detect_map("canny", _square(), 4096, -1, -1)
    with pytest.raises(ValueError, match="Canny High Threshold must be in 1…255, got 300"):
        detect_map("canny", _square(), 512, 100, 300)
    with pytest.raises(ValueError, match="a 2048x8 picture at preprocessor resolution 2048 makes a 524288x2048 map"):
        detect_map("canny", Image.new("RGB", (2048, 8)), 2048, -1, -1)  # 1 G pixels, refused before resizing


# ------------------------------------------------------------------------------ model-based modules


class _Trap:
    """Unpickling this writes a marker file: proof that something opened the pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def test_model_modules_are_listed_unavailable_naming_their_file_and_a_pickle_is_never_opened(tmp_path):
    """Without files, every model-based module is listed unavailable with the file it needs; a `.pth` pickle
    in its place is named as refused and stays unopened (its payload would write a marker file); the built-in
    ones are available. Asking one that is unavailable is a ValueError with the same reason."""
    rows = {row.name: row for row in module_list(tmp_path)}
    assert set(rows) == {pre.name for pre in PREPROCESSORS}
    assert all(rows[name].available for name in ("none", "canny", "invert", "threshold", "inpaint_only"))
    for name in preprocessor_models.MODEL_MODULES:
        assert not rows[name].available and f"models/ControlNetPreprocessor/{name}.onnx" in rows[name].reason
    marker = tmp_path / "opened"
    (tmp_path / "depth_midas.pth").write_bytes(pickle.dumps(_Trap(marker)))
    reason = {row.name: row for row in module_list(tmp_path)}["depth_midas"].reason
    assert "depth_midas.pth is a pickle" in reason and "depth_midas.onnx" in reason
    with pytest.raises(ValueError, match="depth_midas is unavailable: depth_midas.pth is a pickle"):
        detect_map("depth_midas", _square(), 64, -1, -1, models_dir=tmp_path)
    assert not marker.exists()


def _write_depth_onnx(path: Path, fixed: int | None = None) -> None:
    """A tiny "depth" network in ONNX: the mean of the three input channels, one output plane."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    side = fixed or "H"
    x = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [1, 3, side, side if fixed else "W"])
    y = helper.make_tensor_value_info("depth", TensorProto.FLOAT, [1, 1, side, side if fixed else "W"])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    node = helper.make_node("ReduceMean", ["pixels", "axes"], ["depth"], keepdims=1)
    graph = helper.make_graph([node], "tiny_depth", [x], [y], initializer=[axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_an_onnx_depth_model_runs_end_to_end(tmp_path):
    """depth_anything with `depth_anything.onnx` in the folder: listed available, and its map equals the
    recipe computed here by hand: ImageNet-normalised pixels, the network's output (channel mean), min-max
    scaled to 0…255 (near = white). A network with a fixed 32×32 input is fed a resized picture and its map is
    brought back to the picture's size. A corrupt .onnx is one clear error naming the file."""
    pytest.importorskip("onnxruntime")
    _write_depth_onnx(tmp_path / "depth_anything.onnx")
    assert {row.name: row for row in module_list(tmp_path)}["depth_anything"].available
    picture = _gradient(rows=70).crop((0, 0, 196, 70))  # sides multiples of 14: fed as is
    depth = _plane(detect_map("depth_anything", picture, 70, -1, -1, models_dir=tmp_path))
    mean = np.array(preprocessor_models.IMAGENET_MEAN, np.float32)
    std = np.array(preprocessor_models.IMAGENET_STD, np.float32)
    expected = ((np.asarray(picture, np.float32) / 255 - mean) / std).mean(axis=2)
    expected = ((expected - expected.min()) / (expected.max() - expected.min()) * 255).round()
    assert depth.shape == (70, 196) and np.abs(depth.astype(np.int16) - expected).max() <= 1
    _write_depth_onnx(tmp_path / "depth_midas.onnx", fixed=32)
    assert detect_map("depth_midas", _square(), SIDE, -1, -1, models_dir=tmp_path).size == (SIDE, SIDE)
    (tmp_path / "normal_bae.onnx").write_bytes(b"not a protobuf at all")
    with pytest.raises(ValueError, match="normal_bae.onnx is not an ONNX model onnxruntime can read"):
        detect_map("normal_bae", _square(), 64, -1, -1, models_dir=tmp_path)
