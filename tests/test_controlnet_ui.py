"""The ControlNet accordion's rules without a browser (`app/ui/controlnet_panel.py`): the form's values become
the same checked `ControlUnit`s the API builds, and Send-to reads the extension's `ControlNet N` infotext entries
into the accordion's fields (the browser test drives the page itself)."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pytest
from PIL import Image

from app.settings import Settings
from app.ui.controlnet_panel import FIELDS, build_controlnet_panel, fields_from_infotext, units_from_form

PICTURE = Image.new("RGB", (32, 32), "white")
EXTENSION_TEXT = ("Module: canny, Model: tiny-canny [0123abcd], Weight: 0.5, Resize Mode: Resize and Fill, "
                  "Processor Res: 256, Threshold A: 100, Threshold B: 200, Guidance Start: 0.1, Guidance End: 0.9, "
                  "Pixel Perfect: True, Control Mode: My prompt is more important")


@pytest.fixture
def settings(tmp_path) -> Settings:
    folder = tmp_path / "models" / "ControlNet"
    folder.mkdir(parents=True)
    (folder / "tiny-canny.safetensors").write_bytes(b"\0" * 8)
    return Settings(data_dir=tmp_path)


def _form(**changes) -> list:
    unit = {"enabled": True, "module": "canny", "model": "tiny-canny", "weight": 0.5, "guidance_start": 0.1,
            "guidance_end": 0.9, "control_mode": "ControlNet is more important", "resize_mode": "Just Resize",
            "pixel_perfect": True, "processor_res": 256, "threshold_a": 50, "threshold_b": 150} | changes
    image = unit.pop("image", PICTURE)
    return [image, *(unit[name] for name in FIELDS)]


def test_the_forms_units_are_checked_control_units(settings):
    """Enabled units become `ControlUnit`s with every setting (a model titled `name [hash]` taken by name); a
    disabled unit is skipped whatever it holds; on Generate a unit without a picture is refused by name, on
    img2img it is kept (the init image is the control image)."""
    values = [*_form(), *_form(enabled=False, model="gone", module="sobel"), *_form(model="tiny-canny [0123abcd]")]
    first, second = units_from_form(settings, values, needs_image=True)
    assert (first.module, first.model, first.weight, first.guidance_start, first.guidance_end, first.control_mode,
            first.resize_mode, first.pixel_perfect, first.processor_res, first.threshold_a, first.threshold_b) == (
        "canny", "tiny-canny", 0.5, 0.1, 0.9, "ControlNet is more important", "Just Resize", True, 256, 50.0, 150.0)
    assert first.image is PICTURE and second.model == "tiny-canny"
    with pytest.raises(ValueError, match="ControlNet unit 0 is enabled without a control image"):
        units_from_form(settings, _form(image=None), needs_image=True)
    assert units_from_form(settings, _form(image=None), needs_image=False)[0].image is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"model": "None"}, "ControlNet unit 0: a ControlNet unit needs a model"),
    ({"model": "gone"}, "ControlNet unit 0: model 'gone' is not in models/ControlNet/ (have: tiny-canny)"),
    ({"module": "depth_midas"}, "ControlNet unit 0: ControlNet preprocessor depth_midas is unavailable"),
    ({"guidance_start": 0.9, "guidance_end": 0.1}, "guidance start and end must satisfy"),
    ({"processor_res": None}, "ControlNet unit 0: int() argument must be"),
])
def test_a_unit_the_app_cannot_run_is_one_error_naming_it(settings, changes, message):
    with pytest.raises(ValueError) as refused:
        units_from_form(settings, _form(**changes), needs_image=True)
    assert message in str(refused.value)


def test_send_to_reads_the_extensions_infotext_into_the_accordions_fields(settings):
    """`ControlNet 0: "Module: …, Model: name [hash], …"` as the extension writes it fills unit 0's fields (the
    model by name), units the text does not name are switched off, and every field it fills is a component of
    the accordion (what Send-to writes to); a model this app lacks is named in the notes and left as it was."""
    notes: list[str] = []
    fields = fields_from_infotext({"ControlNet 0": EXTENSION_TEXT}, notes, settings)
    assert fields == {"cn0_enabled": True, "cn1_enabled": False, "cn2_enabled": False, "cn0_module": "canny",
                      "cn0_model": "tiny-canny", "cn0_weight": 0.5, "cn0_resize_mode": "Resize and Fill",
                      "cn0_processor_res": 256.0, "cn0_threshold_a": 100.0, "cn0_threshold_b": 200.0,
                      "cn0_guidance_start": 0.1, "cn0_guidance_end": 0.9, "cn0_pixel_perfect": True,
                      "cn0_control_mode": "My prompt is more important"}
    assert notes == []
    with gr.Blocks():
        panel = build_controlnet_panel(SimpleNamespace(settings=settings), "t")
    assert set(fields) <= set(panel.fields())
    fields = fields_from_infotext({"ControlNet 1": EXTENSION_TEXT.replace("tiny-canny", "elsewhere"),
                                   "ControlNet 3": EXTENSION_TEXT}, notes, settings)
    assert "cn1_model" not in fields and fields["cn1_enabled"] and not fields["cn0_enabled"]
    assert notes == ["ControlNet 1: model 'elsewhere' is not available here; left as it was",
                     "only the first 3 ControlNet units were filled in"]
    assert fields_from_infotext({}, [], settings) == {"cn0_enabled": False, "cn1_enabled": False, "cn2_enabled": False}
