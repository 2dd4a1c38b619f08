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

from app.engine.generate import GenerateParams
from app.engine.variation import slerp
from app.engine.worker import Engine
from app.infotext import parse_infotext
from app.settings import Settings
from app.styles import PromptStyle, apply_styles, merge, read_styles, save_style
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
@pytest.mark.parametrize("arch", ["sd15", "flux-dev"])
def test_variation_strength_runs_from_the_seeds_image_to_the_variation_seeds_image(engine, arch):
    """Strength 0 is the plain seed's image bit for bit; strength 1 is the variation seed's image bit
    for bit (image i of the batch takes variation seed subseed + i, and every image keeps the seed);
    0.5 differs from both. SD's spatial latents and Flux's packed patches alike."""
    engine.load_model(CHECKPOINTS[arch])
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
    assert apply_styles(path, ["frame", "oil"], "a fox", "ugly") == ("framed, a fox, oil painting", "ugly, blurry")
    assert apply_styles(path, ["oil", "frame"], "a fox", "") == ("framed, a fox, oil painting", "blurry")
    with pytest.raises(ValueError, match="'nope'.*known: frame, oil"):
        apply_styles(path, ["nope"], "a fox", "")


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
