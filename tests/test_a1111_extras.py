"""A1111's variation seeds, prompt styles and SDXL refiner, on the tiny demo models.

The rules they protect are A1111's (`modules/rng.py` `ImageRNG`/`slerp`, `modules/processing.py`
seeds and infotext, `modules/styles.py`), restated in `app/engine/variation.py` and `app/styles.py`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch
from tiny import CHECKPOINTS, FAST

from app.engine import placement
from app.engine.generate import GenerateParams
from app.engine.variation import slerp
from app.engine.worker import Engine
from app.infotext import parse_infotext
from app.settings import Settings
from app.styles import PromptStyle, StyleBook, merge, read_styles, save_style
from app.ui.send_to import fields_from_infotext

PARAMS = GenerateParams("a red house", seed=5, batch=2, **FAST)


@pytest.fixture(scope="module")
def engine(demo_dir, tmp_path_factory):
    """One strict CPU engine for the module, on a private copy of the demo checkpoints."""
    data = tmp_path_factory.mktemp("extras")
    shutil.copytree(demo_dir / "models/Stable-diffusion", data / "models/Stable-diffusion", copy_function=os.link)
    eng = Engine(Settings(data_dir=data, device="cpu", strict=True))
    yield eng
    eng.close()


def _pixels(images) -> list[np.ndarray]:
    return [np.asarray(im.image, dtype=np.int16) for im in images]


def _same(a, b) -> list[bool]:
    return [np.array_equal(x, y) for x, y in zip(a, b, strict=True)]


# ------------------------------------------------------------------------------------- variation seeds
@pytest.mark.parametrize("family_name", ["sd15", "flux-dev"])
def test_variation_strength_runs_from_the_seeds_image_to_the_variation_seeds_image(engine, family_name):
    """Strength 0 is the plain seed's image bit for bit; strength 1 is the variation seed's image bit
    for bit (image i of the batch takes variation seed subseed + i, and every image keeps the seed);
    0.5 differs from both. SD's spatial latents and Flux's packed patches alike."""
    engine.load_model(CHECKPOINTS[family_name])
    plain = _pixels(engine.generate(PARAMS))
    other = _pixels(engine.generate(dataclasses.replace(PARAMS, seed=9)))
    none = engine.generate(dataclasses.replace(PARAMS, subseed=9, subseed_strength=0.0))
    full = engine.generate(dataclasses.replace(PARAMS, subseed=9, subseed_strength=1.0))
    half = _pixels(engine.generate(dataclasses.replace(PARAMS, subseed=9, subseed_strength=0.5)))
    assert _same(_pixels(none), plain) == [True, True] and [im.subseed for im in none] == [None, None]
    assert _same(_pixels(full), other) == [True, True]
    assert [(im.seed, im.subseed) for im in full] == [(5, 9), (5, 10)]
    assert _same(half, plain) == [False, False] and _same(half, other) == [False, False]
    assert engine.snapshot().violations_found_total == 0


def test_variation_infotext_round_trips_to_the_same_image(engine):
    """The PNG's infotext carries `Variation seed`, `Variation seed strength` and `Seed resize from` as
    A1111 writes them; read back as "send to Generate" reads it, the settings give the same image."""
    engine.load_model(CHECKPOINTS["sd15"])
    asked = dataclasses.replace(PARAMS, batch=1, subseed=-1, subseed_strength=0.3, seed_resize_from_w=32,
                                seed_resize_from_h=96)
    made = engine.generate(asked)[0]
    settings = parse_infotext(made.infotext).settings
    assert settings["Variation seed"] == str(made.subseed) and made.subseed != -1
    assert settings["Variation seed strength"] == "0.3" and settings["Seed resize from"] == "32x96"
    line = made.infotext.splitlines()[-1]
    assert line.index("Model:") < line.index("Variation seed:") < line.index("Seed resize from:")
    fields = fields_from_infotext(settings, [])
    rebuilt = dataclasses.replace(asked, **{k: fields[k] for k in ("seed", "subseed", "subseed_strength",
                                                                     "seed_resize_from_w", "seed_resize_from_h")})
    assert _same(_pixels(engine.generate(rebuilt)), _pixels([made])) == [True]
    plain = fields_from_infotext(parse_infotext(engine.generate(PARAMS)[0].infotext).settings, [])
    assert (plain["subseed_strength"], plain["seed_resize_from_w"], plain["seed_resize_from_h"]) == (0, 0, 0)


def test_slerp_ends_are_exact_and_img2img_refuses_a_variation(engine):
    """t = 0 and t = 1 return the two noises bit for bit (A1111's coefficient order); a variation on
    img2img is refused by name before anything is queued."""
    generator = torch.Generator().manual_seed(0)
    low, high = torch.randn(4, 8, 8, generator=generator), torch.randn(4, 8, 8, generator=generator)
    assert torch.equal(slerp(0.0, low, high), low) and torch.equal(slerp(1.0, low, high), high)
    engine.load_model(CHECKPOINTS["sd15"])
    image = engine.generate(dataclasses.replace(PARAMS, batch=1))[0].image
    with pytest.raises(ValueError, match="apply to txt2img"):
        engine.img2img(dataclasses.replace(PARAMS, subseed_strength=0.5), [image])


# ------------------------------------------------------------------------------------------------ styles
def test_styles_apply_as_a1111_applies_them(tmp_path):
    """`{prompt}` is replaced by the prompt, else the style is appended after ", " (no stray comma with
    an empty side); several styles apply in the order chosen, negative prompts alike; an unknown name
    is refused with the known ones."""
    assert merge("masterpiece, {prompt}, sharp", "a fox") == "masterpiece, a fox, sharp"
    assert merge("oil painting", " a fox ") == "a fox, oil painting"
    assert merge("oil painting", "") == "oil painting" and merge("", "a fox") == "a fox"
    path = tmp_path / "styles.csv"
    save_style(path, PromptStyle("frame", "framed, {prompt}", "blurry"))
    save_style(path, PromptStyle("oil", "oil painting", ""))
    assert StyleBook(path).apply(["frame", "oil"], "a fox", "ugly") == ("framed, a fox, oil painting", "ugly, blurry")
    assert StyleBook(path).apply(["oil", "frame"], "a fox", "") == ("framed, a fox, oil painting", "blurry")
    with pytest.raises(ValueError, match="'nope'.*known: frame, oil"):
        StyleBook(path).apply(["nope"], "a fox", "")


def test_styles_csv_is_read_and_written_in_a1111s_format(tmp_path):
    """A file as A1111 writes it (byte-order mark, `name,prompt,negative_prompt`, quoted commas and
    newlines) reads back; comment rows are skipped and an old file's `text` column is the prompt;
    saving replaces a style of the same name, keeps the others, writes A1111's header and keeps a
    `.bak` of the previous file."""
    path = tmp_path / "styles.csv"
    path.write_bytes('\ufeffname,prompt,negative_prompt\r\n"cine","cinematic, {prompt}","lowres,\nbad"\r\n'
                     '# note,x,y\r\nplain,watercolour,\r\n'.encode())
    styles = read_styles(path)
    assert list(styles) == ["cine", "plain"]
    assert styles["cine"] == PromptStyle("cine", "cinematic, {prompt}", "lowres,\nbad")
    save_style(path, PromptStyle("plain", "gouache", "grey"))
    raw = path.read_bytes()
    assert raw.startswith(b"\xef\xbb\xbfname,prompt,negative_prompt\r\n")
    assert read_styles(path) == {"cine": styles["cine"], "plain": PromptStyle("plain", "gouache", "grey")}
    assert read_styles(tmp_path / "styles.csv.bak") == styles
    old = tmp_path / "old.csv"
    old.write_text("name,text\nsketch,pencil sketch\n")
    assert read_styles(old) == {"sketch": PromptStyle("sketch", "pencil sketch", "")}
    with pytest.raises(ValueError, match="needs a name"):
        save_style(path, PromptStyle("# hidden", "x", ""))


# ----------------------------------------------------------------------------------------------- refiner
SDXL_OTHER = "tiny-sdxl-other.safetensors"
REFINED = GenerateParams("a red house", seed=5, **{**FAST, "steps": 4})


@pytest.fixture(scope="module")
def sdxl_engine(engine):
    """The module's engine on the tiny SDXL, plus a second tiny SDXL (other random weights) to refine with."""
    from app.demo import build_tiny_pipeline, write_single_file

    write_single_file(build_tiny_pipeline("sdxl", 1), "sdxl", engine.settings.checkpoints_dir / SDXL_OTHER)
    engine.load_model(CHECKPOINTS["sdxl"])
    return engine


def _refined(engine, checkpoint: str, switch_at: float):
    return engine.generate(dataclasses.replace(REFINED, refiner_checkpoint=checkpoint, refiner_switch_at=switch_at))


@pytest.mark.parametrize("parked", [False, True], ids=["cpu", "parked as on a gpu"])
def test_the_refiner_finishes_from_the_switch_point_with_every_stage_verified(sdxl_engine, monkeypatch, parked):
    """Strict mode: a placement violation would fail its stage. With the base as its own refiner and a
    deterministic sampler, switching at 0.5 gives the base's image bit for bit (the refiner goes on with the
    same schedule from the carried latents, adding no noise); another SDXL as refiner changes the image;
    switch at 1.0 is the base alone, bit for bit, with no refiner named. Each stage has its history row
    (base 2 of 4 steps, refiner 2), the infotext says `Refiner: name [hash], Refiner switch at: 0.5`.
    `parked`: the models make room for each other (hooks off, all on the CPU) as they do on a GPU."""
    engine = sdxl_engine
    if parked:
        monkeypatch.setattr(engine, "_needs_room", lambda: True)
    base = _pixels(engine.generate(REFINED))
    start = len(engine.snapshot().history)
    itself = _refined(engine, CHECKPOINTS["sdxl"], 0.5)[0]
    other = _refined(engine, SDXL_OTHER, 0.5)[0]
    rows = engine.snapshot().history[start:]
    assert [(r.command, r.detail.split(",")[0]) for r in rows[:4]] == [
        ("txt2img", "base pass 2 of 4 steps"), ("refiner load", CHECKPOINTS["sdxl"]),
        ("refiner", "2 steps from 0.5"), ("refiner unload", CHECKPOINTS["sdxl"])]
    assert all(r.outcome == "ok" and r.violations_found == 0 for r in rows), rows
    assert np.array_equal(_pixels([itself])[0], base[0])
    assert np.abs(_pixels([other])[0] - base[0]).mean() > 4
    settings = parse_infotext(other.infotext).settings
    assert settings["Refiner"] == f"{SDXL_OTHER} [{settings['Refiner'][-11:-1]}]" and len(settings["Refiner"]) > 13
    assert settings["Refiner switch at"] == "0.5" and settings["Model"] == CHECKPOINTS["sdxl"]
    last = _refined(engine, SDXL_OTHER, 1.0)[0]
    assert np.array_equal(_pixels([last])[0], base[0]) and "Refiner" not in last.infotext
    snap = engine.snapshot()
    assert snap.violations_found_total == 0 and snap.model == CHECKPOINTS["sdxl"] and snap.state == "READY"


def test_a_refiner_of_another_family_is_refused_and_the_engine_stays_ready(sdxl_engine):
    """An SD1.5 checkpoint cannot refine SDXL: the `refiner load` stage fails naming both families, the base
    is placed again and the next generation runs (SD1.5 itself having no refiner stage is tested through
    the A1111 API)."""
    with pytest.raises(ValueError, match="SD1.5 checkpoint; SDXL takes SDXL checkpoints as refiners"):
        _refined(sdxl_engine, CHECKPOINTS["sd15"], 0.5)
    assert sdxl_engine.snapshot().state == "READY" and sdxl_engine.generate(REFINED)
    assert placement.verify(sdxl_engine.pipeline, sdxl_engine.placement_plan) == []


@pytest.mark.gpu
def test_on_a_gpu_the_base_makes_room_for_the_refiner_and_gets_its_place_back(gpu_data_dir):
    """On CUDA (offload none): after a refined generation the base is back on the GPU by its plan with no
    violation, and the held refiner rests parked in host memory."""
    engine = Engine(Settings(data_dir=gpu_data_dir, device="cuda", strict=True))
    try:
        engine.load_model(CHECKPOINTS["sdxl"])
        _refined(engine, CHECKPOINTS["sdxl"], 0.6)
        assert placement.verify(engine.pipeline, engine.placement_plan) == []
        held = engine._refiner.pipeline
        assert {t.device.type for *_, t, _p in placement.iter_tensors(held)} == {"cpu"}
        assert engine.snapshot().violations_found_total == 0
    finally:
        engine.close()
