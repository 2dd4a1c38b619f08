"""The LoRA browser's pieces: A1111 thumbnail names, search and sort, base-model badges, thumbnails."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from app.ui.lora_browser import THUMB_PX, Entry, Thumbnails, filtered, preview_path
from app.ui.lora_cards import base_badge


def test_preview_follows_a1111_names_and_order(tmp_path):
    lora = tmp_path / "my.style.v2.safetensors"
    lora.write_bytes(b"")
    assert preview_path(lora) is None
    (tmp_path / "my.style.v2.preview.jpg").write_bytes(b"")
    assert preview_path(lora).name == "my.style.v2.preview.jpg"
    (tmp_path / "my.style.v2.preview.png").write_bytes(b"")
    assert preview_path(lora).name == "my.style.v2.preview.png"  # png before jpg
    (tmp_path / "my.style.v2.png").write_bytes(b"")
    assert preview_path(lora).name == "my.style.v2.png"  # `name.png` before `name.preview.png`
    assert preview_path(tmp_path / "other.safetensors") is None


@pytest.mark.parametrize("recorded, badge", [
    ("sd_v1", "SD1.5"), ("sdxl_base_v1-0", "SDXL"), ("stable-diffusion-xl-v1-base/lora", "SDXL"),
    ("stable-diffusion-v1/lora", "SD1.5"), ("sd_v2_768_v", "SD2"), ("flux1", "Flux"), (None, "unknown"),
    ("something-else-entirely-long", "something-else-e"),
])
def test_base_badge_from_trainer_metadata(recorded, badge):
    assert base_badge(recorded) == badge


ENTRIES = [Entry("b-style", "SDXL", ("ink", "sketch"), 30.0, None), Entry("a-detail", "SD1.5", (), 10.0, None),
           Entry("C-light", "SD1.5", ("Golden hour",), 20.0, None)]


def test_search_matches_names_badges_and_trigger_words_and_sorts():
    assert [e.name for e in filtered(ENTRIES, "", "name")] == ["a-detail", "b-style", "C-light"]
    assert [e.name for e in filtered(ENTRIES, "", "newest first")] == ["b-style", "C-light", "a-detail"]
    assert [e.name for e in filtered(ENTRIES, "", "base model")] == ["a-detail", "C-light", "b-style"]
    assert [e.name for e in filtered(ENTRIES, "golden", "name")] == ["C-light"]
    assert [e.name for e in filtered(ENTRIES, " sd1.5 ", "name")] == ["a-detail", "C-light"]
    assert filtered(ENTRIES, "nothing like it", "name") == []


def test_thumbnails_crop_the_preview_and_fall_back_to_a_named_placeholder(tmp_path):
    picture = tmp_path / "wide.png"
    Image.new("RGB", (600, 200), (200, 40, 40)).save(picture)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    thumbs = Thumbnails()
    shown = thumbs.get(Entry("wide", "SDXL", (), 0.0, picture))
    assert shown.size == (THUMB_PX, THUMB_PX)
    assert shown.getpixel((THUMB_PX // 2, THUMB_PX // 2)) == (200, 40, 40)
    badge_corner = np.asarray(shown)[8:20, 8:20]
    assert (badge_corner == (31, 35, 40)).all(axis=-1).any(), "the badge is drawn in the corner"
    placeholder = thumbs.get(Entry("broken", "unknown", (), 0.0, broken))
    assert placeholder.size == (THUMB_PX, THUMB_PX)
    assert placeholder.getpixel((THUMB_PX - 2, THUMB_PX - 2)) == (208, 215, 222)  # the grey tile, not a crash
    assert thumbs.get(Entry("wide", "SDXL", (), 0.0, picture)) is shown  # cached by file identity
