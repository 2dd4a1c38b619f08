"""The ControlNet extension's API (`app/a1111/controlnet.py`), driven as clients drive it: `webuiapi`
(`controlnet_*` calls, `ControlNetUnit` in `alwayson_scripts`) and raw HTTP for the refusals.

One app per module on the tiny SD1.5 demo model, with a ControlNet file and a diffusers folder in
`models/ControlNet/` (for the listing and the unit check; generation with them is cn-engine's). The expected
shapes are sd-webui-controlnet's own (`scripts/api.py`, `external_code.py`, `processor.py`'s sliders)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import requests
from PIL import Image, ImageDraw
from served_app import free_port, make_ui_data, running_app

from app.a1111.controlnet import request_units
from app.a1111.errors import ApiError
from app.controlnet.files import FOLDER_WEIGHTS, model_names
from app.controlnet.preprocessors import detect_map
from app.settings import Settings

webuiapi = pytest.importorskip("webuiapi")
MODEL = "tiny-canny"
FOLDER_MODEL = "tiny-depth-folder"


def _picture() -> Image.Image:
    image = Image.new("RGB", (96, 64), "white")
    ImageDraw.Draw(image).rectangle((24, 16, 71, 47), fill="black")
    return image


def _add_controlnets(data, demo_dir) -> None:
    """Two stand-ins (listed, never loaded), a pickle, and the demo's tiny ControlNets where the demo writes them."""
    folder = data / "models" / "ControlNet"
    (folder / FOLDER_MODEL).mkdir(parents=True)
    demo = demo_dir / "models" / "ControlNet"
    for path in demo.iterdir() if demo.is_dir() else ():
        (folder / path.name).symlink_to(path)
    (folder / FOLDER_MODEL / "config.json").write_text("{}")
    (folder / FOLDER_MODEL / FOLDER_WEIGHTS).write_bytes(b"\0" * 8)  # a folder is listed with its weights
    (folder / f"{MODEL}.safetensors").write_bytes(b"\0" * 8)
    (folder / "old.pth").write_bytes(b"\0" * 8)  # a pickle: never listed


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("a1111-controlnet"), demo_dir)
    _add_controlnets(data, demo_dir)
    settings = Settings(data_dir=data, device="cpu", port=free_port())
    with running_app(settings) as (server, _engine):
        yield server.local_url.rstrip("/"), settings


@pytest.fixture(scope="module")
def api(app):
    """The client as scripts make it (its ControlNet calls strip `/sdapi/v1` from this base)."""
    return webuiapi.WebUIApi(baseurl=app[0] + "/sdapi/v1", steps=1)


def _png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_version_model_list_and_module_list_answer_as_the_extension(api, app):
    """`/controlnet/version` is API version 2; `model_list` names the .safetensors file and the diffusers folder
    (not the pickle); `module_list` names the modules that run here, and `module_detail` every module with the
    extension's sliders (canny: resolution 512 in 64…2048, low 100 and high 200 in 1…255) plus ours, `available`
    and `reason` (depth_anything unavailable, naming its file); `alias_names=true` gives the extension's aliases."""
    assert api.controlnet_version() == 2
    listed = api.controlnet_model_list()
    assert MODEL in listed and FOLDER_MODEL in listed and "old" not in listed
    answer = requests.get(f"{app[0]}/controlnet/module_list", timeout=30).json()
    assert {"none", "canny", "invert", "threshold", "scribble_xdog", "tile_resample", "blur_gaussian",
            "inpaint_only", "lineart_standard"} <= set(answer["module_list"])
    assert "depth_anything" not in answer["module_list"]
    assert answer["module_detail"]["canny"]["sliders"] == [
        {"name": "Preprocessor Resolution", "value": 512, "min": 64, "max": 2048},
        {"name": "Canny Low Threshold", "value": 100, "min": 1, "max": 255, "step": 1.0},
        {"name": "Canny High Threshold", "value": 200, "min": 1, "max": 255, "step": 1.0}]
    depth = answer["module_detail"]["depth_anything"]
    assert not depth["available"] and "models/ControlNetPreprocessor/depth_anything.onnx" in depth["reason"]
    aliased = requests.get(f"{app[0]}/controlnet/module_list", params={"alias_names": True}, timeout=30).json()
    assert "invert (from white bg & black line)" in aliased["module_list"]
    assert requests.get(f"{app[0]}/controlnet/settings", timeout=30).json() == {"control_net_unit_count": 3}


def test_detect_through_webuiapi_returns_the_map_detect_map_makes(api, app):
    """`webuiapi.controlnet_detect` (data: URLs under `controlnet_images`) answers the canny map pixel for pixel
    as `detect_map` makes it; `controlnet_input_images` with `controlnet_masks` runs inpaint_only with the mask."""
    picture = _picture()
    answer = api.controlnet_detect([picture], module="canny", processor_res=64, threshold_a=50, threshold_b=150)
    expected = np.asarray(detect_map("canny", picture, 64, 50, 150))
    assert answer.info == "Success" and np.array_equal(np.asarray(answer.images[0].convert("RGB")), expected)
    mask = Image.new("L", picture.size, 0)
    ImageDraw.Draw(mask).rectangle((0, 0, 9, 9), fill=255)
    raw = requests.post(f"{app[0]}/controlnet/detect", timeout=60, json={
        "controlnet_module": "inpaint_only", "controlnet_input_images": [webuiapi.raw_b64_img(picture)],
        "controlnet_masks": [webuiapi.raw_b64_img(mask)]}).json()
    shown = _png(raw["images"][0])
    assert (shown[:10, :10] == 0).all() and np.array_equal(shown[20:, 20:], np.asarray(picture)[20:, 20:])


@pytest.mark.parametrize(("body", "detail"), [
    ({"controlnet_module": "sobel", "controlnet_input_images": ["x"]}, "unknown ControlNet preprocessor 'sobel'"),
    ({"controlnet_module": "canny"}, "No image selected"),
    ({"controlnet_module": "canny", "controlnet_input_images": ["bm90IGFuIGltYWdl"]}, "not a PNG, JPEG or WebP"),
    ({"controlnet_module": "depth_midas", "controlnet_input_images": ["x"]}, "depth_midas.onnx"),
    ({"controlnet_module": "canny", "controlnet_input_images": ["x"], "controlnet_threshold_b": 999},
     None),
])
def test_detect_refuses_what_it_cannot_do_with_one_clear_422(app, body, detail):
    """An unknown or unavailable module, no picture, a picture that is not one, a threshold out of its range:
    each one 422 whose `detail` names the problem (A1111's error shape), never a 500."""
    if detail is None:  # a real picture with a threshold out of range
        body = body | {"controlnet_input_images": [webuiapi.raw_b64_img(_picture())]}
        detail = "Canny High Threshold must be in 1…255, got 999"
    answer = requests.post(f"{app[0]}/controlnet/detect", json=body, timeout=30)
    assert answer.status_code == 422 and detail in answer.json()["detail"], answer.text


# ------------------------------------------------------------------------------ alwayson_scripts units


def _scripts(*units: dict, key: str = "ControlNet") -> dict:
    return {key: {"args": list(units)}}


def test_webuiapi_units_become_control_units_field_by_field(app):
    """`webuiapi.ControlNetUnit(...).to_dict()` (and the extension's spellings: `input_image`, `guidance`,
    `{image, mask}`, a model titled `name [hash]`, modes by index, name or the extension's alias, key
    `controlnet` in any case) parse into `ControlUnit`s with every setting carried; a disabled unit is skipped;
    `processor_res` -1 is 512 and webuiapi's thresholds pass as sent."""
    settings = app[1]
    picture, mask = _picture(), Image.new("L", (96, 64), 255)
    first = webuiapi.ControlNetUnit(image=picture, module="canny", model=MODEL, weight=0.7, resize_mode="Just Resize",
                                    processor_res=256, threshold_a=50, threshold_b=150, guidance_start=0.1,
                                    guidance_end=0.9, control_mode=2, pixel_perfect=True).to_dict()
    second = {"input_image": {"image": webuiapi.raw_b64_img(picture), "mask": webuiapi.raw_b64_img(mask)},
              "module": "inpaint_only", "model": f"{FOLDER_MODEL} [0123abcd]", "guidance": 0.5,
              "control_mode": "My prompt is more important", "resize_mode": "Envelope (Outer Fit)", "processor_res": -1}
    off = webuiapi.ControlNetUnit(image=picture, model="missing", enabled=False).to_dict()
    units = request_units(_scripts(first, off, second, key="controlnet"), settings)
    assert len(units) == 2
    one, two = units
    assert (one.module, one.model, one.weight, one.resize_mode, one.processor_res, one.threshold_a, one.threshold_b,
            one.guidance_start, one.guidance_end, one.control_mode, one.pixel_perfect) == (
        "canny", MODEL, 0.7, "Just Resize", 256, 50.0, 150.0, 0.1, 0.9, "ControlNet is more important", True)
    assert np.array_equal(np.asarray(one.image.convert("RGB")), np.asarray(picture)) and one.mask is None
    assert (two.module, two.model, two.guidance_end, two.control_mode, two.resize_mode, two.processor_res) == (
        "inpaint_only", FOLDER_MODEL, 0.5, "My prompt is more important", "Resize and Fill", 512)
    assert np.asarray(two.mask).min() == 255
    no_image = request_units(_scripts(webuiapi.ControlNetUnit(model=MODEL).to_dict()), settings)[0]
    assert no_image.image is None  # img2img: the init image is the control image, as in the extension
    assert request_units({}, settings) == () and request_units(_scripts(), settings) == ()


@pytest.mark.parametrize(("change", "detail"), [
    ({"model": "None"}, "ControlNet unit 0: model is missing"),
    ({"model": "nope"}, "ControlNet model 'nope' not found in models/ControlNet/; available: tiny-canny"),
    ({"model": "old"}, "ControlNet model 'old' not found"),
    ({"module": "sobel"}, "ControlNet unit 0: unknown ControlNet preprocessor 'sobel'"),
    ({"module": "normal_bae"}, "normal_bae is unavailable: needs models/ControlNetPreprocessor/normal_bae.onnx"),
    ({"image": "bm90IGFuIGltYWdl"}, "ControlNet unit 0 image: not a PNG, JPEG or WebP"),
    ({"image": 12}, "image must be a base64 image"),
    ({"weight": 3}, "ControlNet weight must be in 0…2"),
    ({"weight": "heavy"}, "weight must be a number"),
    ({"guidance_start": 0.8, "guidance_end": 0.2}, "guidance start and end must satisfy"),
    ({"control_mode": 7}, "control_mode 7 is not one of Balanced"),
    ({"resize_mode": "Stretch"}, "resize_mode 'Stretch' is not one of"),
    ({"processor_res": 8}, "processor resolution must be in 64…2048"),
    ({"hr_option": "Low only"}, "hr_option 'Low only' is not one of Both"),
    ({"advanced_weighting": [0.5] * 13}, "not supported by this app: advanced_weighting"),
])
def test_a_unit_the_app_cannot_run_is_refused_by_name(app, change, detail):
    """Each unit the app cannot run (no or unknown model, a pickle's name, an unknown or unavailable module, a
    picture that is not one, a number out of range, an unknown mode, an extension feature set) is a 422 naming
    the unit and the problem."""
    unit = webuiapi.ControlNetUnit(image=_picture(), module="canny", model=MODEL).to_dict() | change
    with pytest.raises(ApiError) as refused:
        request_units(_scripts(unit), app[1])
    assert refused.value.status_code == 422 and detail in refused.value.detail, refused.value.detail


def test_txt2img_refuses_bad_units_more_than_three_and_other_scripts_before_generating(app):
    """Through the served app: a txt2img with four enabled units, with a unit naming a missing model, or with an
    always-on script other than ControlNet is answered 422 in A1111's error shape (never run with the units
    dropped); `args` that is not a list is refused the same way."""
    unit = webuiapi.ControlNetUnit(image=_picture(), module="canny", model=MODEL).to_dict()
    cases = [(_scripts(*[unit] * 4), "at most 3 ControlNet units run at once, got 4 enabled"),
             (_scripts(unit | {"model": "nope"}), "ControlNet model 'nope' not found"),
             ({"Self Attention Guidance": {"args": [True]}}, "the always-on script 'Self Attention Guidance'"),
             ({"controlnet": {"args": {"image": "x"}}}, 'alwayson_scripts.controlnet takes {"args": [unit, ...]}')]
    for scripts, detail in cases:
        answer = requests.post(f"{app[0]}/sdapi/v1/txt2img", timeout=60,
                               json={"prompt": "p", "steps": 1, "width": 64, "height": 64, "alwayson_scripts": scripts})
        assert answer.status_code == 422 and detail in answer.json()["detail"], answer.text


def test_txt2img_and_img2img_carry_webuiapi_units_to_the_engine(api, app, monkeypatch):
    """With a demo ControlNet: `api.txt2img(controlnet_units=[...])` and `api.img2img(...)`
    hand the engine the parsed units on `GenerateParams.controlnet_units` and answer an image each (what the
    units do to the picture is cn-engine's to test)."""
    from app.engine.worker import Engine

    demo = ["tiny-sd15-controlnet"]  # the demo's, for the SD1.5 model the app loads first
    assert demo[0] in model_names(app[1].controlnet_dir)
    seen = []
    for name in ("generate", "img2img"):
        original = getattr(Engine, name)

        def spy(self, params, *args, _original=original, **kwargs):
            seen.append(params.controlnet_units)
            return _original(self, params, *args, **kwargs)

        monkeypatch.setattr(Engine, name, spy)
    unit = webuiapi.ControlNetUnit(image=_picture(), module="canny", model=demo[0], weight=0.5)
    # fresh dicts: webuiapi fills its default `alwayson_scripts={}` in place, and every later call would send the unit
    made = [api.txt2img(prompt="p", steps=1, width=64, height=64, controlnet_units=[unit], alwayson_scripts={}),
            api.img2img(images=[_picture()], prompt="p", steps=2, width=64, height=64, controlnet_units=[unit],
                        alwayson_scripts={})]
    assert all(len(result.images) == 1 for result in made)
    assert len(seen) == 2 and all(len(u) == 1 and u[0].module == "canny" and u[0].weight == 0.5 for u in seen)
