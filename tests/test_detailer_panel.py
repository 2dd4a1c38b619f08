"""The Detailer accordion's pure parts (app/ui/detailer_panel.py), no server: the form's values become the
engine's detail passes through the API's own unit checks, Send-to's fields from an infotext rebuild the same
units, and the mask preview lays each redrawn mask over its picture."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from app.detailer.detect import BUILTIN_FACE
from app.detailer.units import DetailUnit, infotext_settings
from app.engine.generate import GeneratedImage
from app.infotext import format_infotext, parse_infotext
from app.settings import Settings
from app.ui.detailer_panel import UNIT_FIELDS, details_from_form, fields_from_infotext, mask_previews


def _ctx(tmp_path):
    return SimpleNamespace(settings=Settings(data_dir=tmp_path))


def _form(*units: DetailUnit | None) -> list:
    """The accordion's values for `units` (None: a tab left on detector "None")."""
    values = []
    for unit in (*units, None)[:2]:
        values += [("None" if unit is None else unit.model) if name == "model" else
                   getattr(unit or DetailUnit(BUILTIN_FACE), name) for name in UNIT_FIELDS]
    return values


def test_the_form_gives_the_engines_passes_with_adetailers_switches(tmp_path):
    """Ticked, the first tab's unit becomes a pass whose own size, steps and CFG apply only where their
    switches are on; unticked there is no pass; the infotext pairs are ADetailer's."""
    unit = DetailUnit(BUILTIN_FACE, prompt="a face", denoising_strength=0.5, use_inpaint_width_height=True,
                      inpaint_width=64, inpaint_height=96, steps=9)
    assert details_from_form(_ctx(tmp_path), False, False, False, *_form(unit)) is None
    details = details_from_form(_ctx(tmp_path), True, True, False, *_form(unit))
    (one,) = details.passes
    assert details.skip_img2img and (one.width, one.height, one.steps, one.cfg) == (64, 96, 0, None)
    assert (one.prompt, one.denoising_strength, one.label) == ("a face", 0.5, BUILTIN_FACE)
    assert dict(details.infotext)["ADetailer model"] == BUILTIN_FACE


def test_a_bad_value_or_no_detector_is_one_clear_message(tmp_path):
    """A value out of ADetailer's range is refused naming the unit and the key; an enabled Detailer whose
    tabs all say "None" says what to do; a pickled detector is refused by name."""
    with pytest.raises(ValueError, match="Detailer 1st unit: ad_denoising_strength must be in 0…1"):
        details_from_form(_ctx(tmp_path), True, False, False, *_form(DetailUnit(BUILTIN_FACE), None)[:12], 1.5,
                          *_form(DetailUnit(BUILTIN_FACE), None)[13:])
    with pytest.raises(ValueError, match="every unit's detector is None"):
        details_from_form(_ctx(tmp_path), True, False, False, *_form(None, None))
    with pytest.raises(ValueError, match=r"face_yolov8n\.pt"):
        details_from_form(_ctx(tmp_path), True, False, False, *_form(DetailUnit("face_yolov8n.pt")))


def test_send_to_fields_rebuild_the_units_of_an_infotext(tmp_path):
    """An infotext's `ADetailer …` keys fill the accordion so that it asks for the same units again; an
    infotext without them turns the Detailer off and leaves the tabs alone."""
    units = (DetailUnit(BUILTIN_FACE, prompt="a smiling face", mask_k=1, x_offset=3),
             DetailUnit(BUILTIN_FACE, confidence=0.5, use_steps=True, steps=12))
    text = format_infotext("a portrait", "", [("Steps", 20), *infotext_settings(units)], ())
    notes: list[str] = []
    fields = fields_from_infotext(parse_infotext(text).settings, notes)
    assert fields["ad_enable"] is True and notes == []
    form = [fields[f"ad_{index}_{name}"] for index in range(2) for name in UNIT_FIELDS]
    again = details_from_form(_ctx(tmp_path), True, False, False, *form)
    assert again.infotext == tuple(infotext_settings(units))
    assert fields_from_infotext({"Steps": "20"}, notes) == {"ad_enable": False}


def test_mask_previews_tint_each_redrawn_region():
    """One preview per mask, red where the mask is white, the picture elsewhere, captioned with its image."""
    picture = Image.new("RGB", (32, 32), (0, 0, 200))
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (8, 8, 16, 16))
    (preview, caption), = mask_previews([GeneratedImage(picture, 1, "", masks=(mask,))])
    pixels = np.asarray(preview)
    assert caption == "detailer mask 1 · image 1"
    assert pixels[12, 12, 0] > 100 and tuple(pixels[0, 0]) == (0, 0, 200)
