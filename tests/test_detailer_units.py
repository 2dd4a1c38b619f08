"""The Detailer's unit record read as ADetailer's clients send it and written as ADetailer writes infotext.

Protects: `webuiapi.ADetailer` dicts parse to units with ADetailer's defaults (its `adetailer/args.py`,
25.3.0), the old `ad_mask_k_largest` spelling webuiapi still sends included; `[enable, skip_img2img?,
{ad_*}, …]` as ADetailer reads it; one clear error naming the key for bad input; infotext keys as
ADetailer writes them (" 2nd" suffix, default-valued keys left out by its rules) read back exactly.
"""

from __future__ import annotations

import pytest
import webuiapi

from app.detailer.units import (
    DetailRequest,
    DetailUnit,
    from_alwayson,
    infotext_pairs,
    infotext_settings,
    parse_args,
    units_from_infotext,
)
from app.infotext import format_infotext, parse_infotext


def test_webuiapi_dicts_parse_to_adetailers_defaults():
    """webuiapi's default dict (ADetailer's defaults) gives DetailUnit's defaults; its `ad_mask_k_largest`
    (sent as a float, 2.0) lands in `mask_k`; a leading True and a "None" model unit dropped as ADetailer does."""
    sent = webuiapi.ADetailer(ad_model="face_opencv_haar", ad_mask_k_largest=2.0).to_dict()
    request = parse_args([True, sent, webuiapi.ADetailer().to_dict()])
    assert request == DetailRequest(True, False, (DetailUnit("face_opencv_haar", mask_k=2),))
    assert parse_args([True, webuiapi.ADetailer(ad_model="face_opencv_haar").to_dict()]).units == (
        DetailUnit("face_opencv_haar"),)


def test_args_switch_and_skip_img2img():
    """A leading False turns it off; a second bool is "skip img2img"; only "None" units left: not enabled;
    the alwayson key matches without case; more than two units are refused."""
    unit = {"ad_model": "face_opencv_haar"}
    assert parse_args([False, unit]).enabled is False
    assert parse_args([True, True, unit]) == DetailRequest(True, True, (DetailUnit("face_opencv_haar"),))
    assert parse_args([unit]).enabled is True  # no leading bool: on
    assert parse_args([True, {"ad_model": "None"}]).enabled is False
    same = {"ad_use_checkpoint": True, "ad_checkpoint": "Use same checkpoint", "ad_use_vae": False, "ad_vae": "x"}
    assert parse_args([{**unit, **same}]).units == (DetailUnit("face_opencv_haar"),)  # asks for nothing different
    assert from_alwayson({"adetailer": {"args": [True, unit]}}).units == (DetailUnit("face_opencv_haar"),)
    assert from_alwayson({"controlnet": {"args": []}}) is None
    with pytest.raises(ValueError, match="at most 2 ADetailer units"):
        parse_args([True, unit, unit, unit])


@pytest.mark.parametrize(("bad", "named"), [
    ({"ad_confidence": 1.5}, "ad_confidence must be in 0…1"),
    ({"ad_steps": 2.5}, "ad_steps must be int"),
    ({"ad_inpaint_only_masked": "yes"}, "ad_inpaint_only_masked must be bool"),
    ({"ad_mask_merge_invert": "Invert"}, "ad_mask_merge_invert must be one of"),
    ({"ad_mask_min_ratio": 0.6, "ad_mask_max_ratio": 0.5}, "ad_mask_min_ratio"),
    ({"ad_colour": 1}, "unknown ADetailer setting 'ad_colour'"),
    ({"ad_restore_face": True}, "ad_restore_face: face restoration"),
    ({"ad_use_checkpoint": True, "ad_checkpoint": "x"}, "ad_use_checkpoint: a separate checkpoint"),
    ({"ad_controlnet_model": "control_v11p_sd15_inpaint"}, "ad_controlnet_model"),
    ({"ad_use_vae": True, "ad_vae": "vae-ft-mse.safetensors"}, "ad_use_vae: a separate VAE"),
])
def test_bad_unit_is_refused_naming_the_key(bad, named):
    """Each bad setting is one ValueError that names the ad_* key and the unit."""
    with pytest.raises(ValueError, match="ADetailer 2nd unit: ") as err:
        parse_args([True, {"ad_model": "face_opencv_haar"}, {"ad_model": "face_opencv_haar", **bad}])
    assert named in str(err.value)


def test_infotext_keys_as_adetailer_writes_them_and_read_back():
    """The second unit's keys end in " 2nd"; keys at ADetailer's defaults are left out by its rules (the
    padding with inpaint-only-masked off, but that switch kept); PNG Info reads the same two units back."""
    first = DetailUnit("face_opencv_haar", prompt="a smiling face, detailed", mask_k=1, x_offset=3)
    second = DetailUnit("hand_yolov8n.onnx", inpaint_only_masked=False, use_steps=True, steps=12,
                        mask_merge_invert="Merge")
    keys = [key for key, _ in infotext_pairs(second, 1)]
    assert keys == ["ADetailer model 2nd", "ADetailer confidence 2nd", "ADetailer dilate erode 2nd",
                    "ADetailer mask merge invert 2nd", "ADetailer mask blur 2nd", "ADetailer denoising strength 2nd",
                    "ADetailer inpaint only masked 2nd", "ADetailer use separate steps 2nd", "ADetailer steps 2nd"]
    text = format_infotext("a portrait", "", [("Steps", 20), ("Seed", 1), *infotext_settings((first, second))])
    settings = parse_infotext(text).settings
    assert settings["ADetailer prompt"] == "a smiling face, detailed" and settings["ADetailer version"] == "25.3.0"
    assert "ADetailer mask min ratio" not in settings and "ADetailer x offset" in settings
    assert units_from_infotext(settings) == (first, second)
