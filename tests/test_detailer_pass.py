"""The detail pass (ADetailer's) on the tiny SD1.5, in strict mode with strict forwards: every stage a
verified transition (app/engine/detailing.py).

What it protects: with skip img2img every pixel outside the blurred mask is the input's bit for bit and
the region is redrawn; a LoRA named in the detail prompt changes the region only and leaves the model bit
for bit as before (a plain generation after the job equals one before); the pass costs the denoiser calls
of an inpaint of the crop's size; txt2img and img2img run it after their own passes; no region found and a
mask covering everything each leave the image as it was with one clear note; Interrupt lands inside a pass;
the live preview, the history and the bug report name the detail stages; ADetailer's prompt syntax.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from weight_digest import weights_digest

from app.adapters.specs import LoraSpec
from app.detailer import passes
from app.detailer.detect import BUILTIN_FACE, DetectorLibrary
from app.detailer.units import DetailUnit
from app.engine.detailing import DetailParams, DetailPass, crop_box, region_prompts, target_size
from app.engine.generate import GenerateParams
from app.engine.stage_params import HiresParams
from app.engine.worker import Engine
from app.families import FAMILIES
from app.report import build_bug_report
from app.settings import Settings

PARAMS = GenerateParams("a red house", seed=5, steps=4, width=128, height=128, cfg=5.0, sampler="Euler")
BOX = (40, 40, 80, 72)
DETAIL_STAGES = ["detail detect", "detail encode", "detail"]


def _box_mask(size: tuple[int, int], box=BOX) -> Image.Image:
    mask = Image.new("L", size, 0)
    mask.paste(255, box)
    return mask


def _unit(**changes) -> DetailPass:
    settings = {"label": "box", "find": lambda image: ([_box_mask(image.size)], ""), "denoising_strength": 0.5,
                "width": 64, "height": 64, **changes}
    return DetailPass(**settings)


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


@pytest.fixture(scope="module")
def strict(demo_dir, tmp_path_factory):
    """A strict CPU engine (violations fail their transition, strict forwards on) with the tiny SD1.5 loaded."""
    data = tmp_path_factory.mktemp("detailer")
    for sub in ("models/Stable-diffusion", "models/Lora"):
        shutil.copytree(demo_dir / sub, data / sub, copy_function=os.link)
    engine = Engine(Settings(data_dir=data, device="cpu", strict=True, strict_forwards=True, history_size=1000))
    engine.load_model("tiny-sd15.safetensors")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def picture(strict) -> Image.Image:
    return strict.generate(PARAMS)[0].image


def _rows_since(engine: Engine, start: int):
    return engine.snapshot().history[start:]


def test_skip_img2img_redraws_the_region_and_keeps_every_other_pixel_bit_for_bit(strict, picture):
    """ADetailer's skip img2img: the picture is detailed as it is. Where the blurred mask is 0 every pixel
    is the input's exactly; inside the mask the region is redrawn. Its stages are transitions of their
    own, in order, `ok` with zero violations."""
    start = len(strict.snapshot().history)
    out = strict.img2img(PARAMS, [picture], details=DetailParams((_unit(),), skip_img2img=True))[0]
    blurred = np.asarray(_box_mask(picture.size).filter(ImageFilter.GaussianBlur(4)))
    before, after = _pixels(picture), _pixels(out.image)
    assert np.array_equal(before[blurred == 0], after[blurred == 0])
    core = np.zeros(blurred.shape, bool)
    core[BOX[1]:BOX[3], BOX[0]:BOX[2]] = True
    assert np.abs(before[core] - after[core]).mean() > 4.0
    rows = _rows_since(strict, start)
    assert [r.command for r in rows if r.command.startswith("detail")] == DETAIL_STAGES
    assert all(r.outcome == "ok" and r.violations_found == 0 for r in rows), rows
    assert rows[0].command == "detail detect" and out.masks and out.notes == ()


def test_a_lora_in_the_detail_prompt_changes_the_region_only_and_the_model_comes_back_bit_for_bit(strict, picture):
    """`<lora:…>` in a unit's prompt applies to that pass only, exactly as if it were selected: the region
    equals, bit for bit, the same pass with the LoRA selected and the tag left out, and differs from the pass
    without it; nothing outside the mask moves; afterwards the weights are bit for bit as before and a plain
    generation draws the image it drew before the job."""
    digest = weights_digest(strict.pipeline)
    plain = _pixels(strict.generate(PARAMS)[0].image)
    without = strict.img2img(PARAMS, [picture], details=DetailParams((_unit(prompt="a face"),), skip_img2img=True))
    tagged = DetailParams((_unit(prompt="a face <lora:demo-detail-sd15:1>"),), skip_img2img=True)
    with_lora = strict.img2img(PARAMS, [picture], details=tagged)
    assert weights_digest(strict.pipeline) == digest and strict.snapshot().loras == ()
    assert np.array_equal(_pixels(strict.generate(PARAMS)[0].image), plain)
    strict.set_loras([LoraSpec("demo-detail-sd15", 1.0)])
    try:
        selected = strict.img2img(PARAMS, [picture], details=DetailParams((_unit(prompt="a face"),),
                                                                          skip_img2img=True))
    finally:
        strict.set_loras([])
    outside = np.asarray(_box_mask(picture.size).filter(ImageFilter.GaussianBlur(4))) == 0
    a, b = _pixels(without[0].image), _pixels(with_lora[0].image)
    assert np.array_equal(a[outside], b[outside]) and np.array_equal(b[outside], _pixels(picture)[outside])
    assert np.abs(a[~outside] - b[~outside]).mean() > 2.0
    assert np.array_equal(b, _pixels(selected[0].image))
    assert weights_digest(strict.pipeline) == digest


def _count_denoiser_calls(engine: Engine, run) -> int:
    calls = []
    handle = engine.pipeline.unet.register_forward_hook(lambda *_: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("own_size", [True, False], ids=["own size", "native area"])
def test_a_detail_pass_makes_the_denoiser_calls_of_an_inpaint_of_the_crop_size(strict, picture, own_size):
    """The CPU proxy of the speed acceptance: a detail pass runs exactly as many denoiser forwards as the
    engine's inpaint of a picture the size of its crop (own width/height, or the model's native area at
    the crop's aspect), at the same steps and strength; detection and pasting add none."""
    unit = _unit() if own_size else _unit(width=0, height=0)
    box = crop_box(_box_mask(picture.size).filter(ImageFilter.GaussianBlur(4)), unit.padding)
    size = (64, 64) if own_size else target_size(box, strict.snapshot().native_size, 8)
    detailed = _count_denoiser_calls(strict, lambda: strict.img2img(
        PARAMS, [picture], details=DetailParams((unit,), skip_img2img=True)))
    crop = GenerateParams(PARAMS.prompt, seed=5, steps=4, width=size[0], height=size[1], cfg=5.0, sampler="Euler")
    inpainted = _count_denoiser_calls(strict, lambda: strict.inpaint(
        crop, picture.resize(size), _box_mask(size, (8, 8, size[0] - 8, size[1] - 8)), denoising_strength=0.5))
    assert detailed == inpainted == int(PARAMS.steps * 0.5)


def test_txt2img_hires_and_img2img_run_the_detail_pass_after_their_own(strict, picture):
    """txt2img (its first pass a stage of its own), txt2img with the hires fix and img2img, each followed by
    the detail stages: the detailed txt2img image equals its plain image outside the blurred mask and
    differs inside; after the hires fix the pass details the upscaled picture."""
    start = len(strict.snapshot().history)
    detailed = strict.generate(PARAMS, details=DetailParams((_unit(),)))[0].image
    outside = np.asarray(_box_mask(picture.size).filter(ImageFilter.GaussianBlur(4))) == 0
    assert np.array_equal(_pixels(detailed)[outside], _pixels(picture)[outside])
    assert not np.array_equal(_pixels(detailed), _pixels(picture))
    strict.img2img(PARAMS, [picture], denoising_strength=0.5, details=DetailParams((_unit(),)))
    hires = HiresParams(scale=1.5, upscaler="Lanczos", steps=2, denoising_strength=0.5)
    assert strict.generate(PARAMS, hires=hires, details=DetailParams((_unit(),)))[0].image.size == (192, 192)
    names = [r.command for r in _rows_since(strict, start)]
    assert names == ["txt2img", *DETAIL_STAGES, "img2img encode", "img2img", *DETAIL_STAGES,
                     "txt2img", "hires upscale", "hires fix", *DETAIL_STAGES], names


def test_no_region_found_returns_the_image_unchanged_with_a_note(strict, picture):
    """A detector that finds nothing: the picture comes back bit for bit, and the image carries a note
    naming the unit; no encode or detail stage runs."""
    start = len(strict.snapshot().history)
    out = strict.img2img(PARAMS, [picture], details=DetailParams((_unit(label="face", find=lambda image: ([], "")),),
                                                                 skip_img2img=True))[0]
    assert np.array_equal(_pixels(out.image), _pixels(picture))
    assert out.notes == ("detailer unit 1 (face): no region found; the image is unchanged",)
    assert [r.command for r in _rows_since(strict, start) if r.command.startswith("detail")] == ["detail detect"]


def test_a_mask_covering_everything_is_one_clear_message(strict, picture):
    """A region mask over the whole picture would be img2img, not a detail pass: the picture comes back as
    it was with one note saying so and what to change; a second, ordinary unit still runs."""
    everything = _unit(find=lambda image: ([Image.new("L", image.size, 255)], ""))
    out = strict.img2img(PARAMS, [picture], details=DetailParams((everything, _unit()), skip_img2img=True))[0]
    assert len(out.notes) == 1 and "covers the whole image" in out.notes[0] and "dilation" in out.notes[0]
    assert not np.array_equal(_pixels(out.image), _pixels(picture))  # the second unit ran


def test_an_interrupt_inside_a_detail_pass_leaves_the_region_as_it_was(strict, picture):
    """Interrupt lands inside a detail pass (between two of its steps): the region is left as it was, the
    note says where it stopped, the job ends ok and the model is ready; the pass showed its progress as a
    detail phase."""
    phases = []
    original = strict._set_progress

    def watch(phase, step, total, *rest):
        phases.append(phase)
        if phase.startswith("detail") and step == 1:
            strict.interrupt()
        original(phase, step, total, *rest)

    strict._set_progress = watch
    try:
        out = strict.img2img(PARAMS, [picture], details=DetailParams((_unit(denoising_strength=1.0),),
                                                                     skip_img2img=True))[0]
    finally:
        del strict._set_progress
    assert np.array_equal(_pixels(out.image), _pixels(picture))
    assert out.notes == ("detailer unit 1 (box) region 1: stopped at step 1 of 4; the region was left as it was",)
    assert any(p.startswith("detail 1.1") for p in phases)
    assert strict.snapshot().state == "READY"


def test_skip_inside_a_detail_pass_ends_that_run_only(strict):
    """Skip inside the first run's detail pass: that run's image is its txt2img image as it was (the region
    left alone, a note says so), and the second run is detailed as usual."""
    params = dataclasses.replace(PARAMS, n_iter=2)
    plain = strict.generate(params)
    original, skipped = strict._set_progress, []

    def watch(phase, step, total, *rest):
        if phase.startswith("detail") and step == 1 and not skipped:
            skipped.append(strict.skip())
        original(phase, step, total, *rest)

    strict._set_progress = watch
    try:
        runs = strict.generate(params, details=DetailParams((_unit(denoising_strength=1.0),)))
    finally:
        del strict._set_progress
    assert skipped == [True] and len(runs) == 2
    assert np.array_equal(_pixels(runs[0].image), _pixels(plain[0].image)) and "stopped at step 1" in runs[0].notes[0]
    assert not np.array_equal(_pixels(runs[1].image), _pixels(plain[1].image)) and runs[1].notes == ()


def test_diagnostics_and_the_bug_report_name_the_detail_stages(strict, picture):
    """The job's timeline is the detail workflow's, with its detect and paste phases beside the denoising,
    and the bug report's history names its stages."""
    strict.img2img(PARAMS, [picture], details=DetailParams((_unit(),), skip_img2img=True))
    spent = strict.snapshot().last_generation
    assert spent.command == "detail" and all(spent.phase(p) for p in ("detect", "detail paste", "denoise"))
    with zipfile.ZipFile(io.BytesIO(build_bug_report(strict, strict.settings))) as bundle:
        report = json.loads(bundle.read("report.json"))
    commands = [row["command"] if isinstance(row, dict) else row[0] for row in report["history"]]
    assert set(DETAIL_STAGES) <= set(commands)


def test_what_cannot_run_is_refused_before_anything_runs(strict, monkeypatch):
    """An inpaint size past the limits, and a family without an inpaint stage (the detailer redraws by
    inpainting), are refused by name before the job is queued: no transition runs."""
    rows = len(strict.snapshot().history)
    with pytest.raises(ValueError, match="detailer unit 1's inpaint width must be a whole number in 64…2048"):
        strict.generate(PARAMS, details=DetailParams((_unit(width=4096),)))
    monkeypatch.setitem(FAMILIES, "sd15", dataclasses.replace(FAMILIES["sd15"], stage_pipelines={}))
    with pytest.raises(ValueError, match="SD1.5 models cannot do yet"):
        strict.generate(PARAMS, details=DetailParams((_unit(),)))
    assert len(strict.snapshot().history) == rows


def test_adetailer_prompts():
    """ADetailer's prompt syntax: empty is the main prompt, `[PROMPT]` inserts it, `[SEP]` gives region i
    part i (the last part for regions past the parts)."""
    assert region_prompts("", "main", 2) == ["main", "main"]
    assert region_prompts("[PROMPT], smiling", "main", 1) == ["main, smiling"]
    assert region_prompts("left [SEP] right [SEP][SKIP]", "m", 4) == ["left", "right", "[SKIP]", "[SKIP]"]
    assert region_prompts("a [SEP]", "m", 2) == ["a", "m"]


def test_crop_and_target_sizes():
    """The crop box is the blurred mask's painted box plus padding, inside the picture; with no own size
    the target is the native area at the crop's aspect, in whole multiples."""
    assert crop_box(_box_mask((128, 128)), 8) == (32, 32, 88, 80)
    assert crop_box(_box_mask((128, 128)), 64) == (0, 0, 128, 128)
    assert target_size((0, 0, 100, 50), 512, 8) == (720, 360)
    assert torch.tensor(target_size((0, 0, 50, 50), 256, 8)).tolist() == [256, 256]


def test_a_real_photograph_face_is_found_and_redrawn_and_nothing_else_moves(strict, tmp_path):
    """The acceptance on a real photograph (scikit-image's `astronaut`, a NASA portrait): the built-in face
    detector finds the face through ADetailer's unit (detector → mask rules → pass), skip img2img redraws
    it, and every pixel outside the dilated, blurred mask is the input's bit for bit; the image carries the
    mask it redrew and ADetailer's infotext keys."""
    skdata = pytest.importorskip("skimage.data")
    photo = Image.fromarray(skdata.astronaut()).resize((256, 256), Image.Resampling.LANCZOS)
    unit = DetailUnit(BUILTIN_FACE, prompt="a smiling face", denoising_strength=0.6, use_inpaint_width_height=True,
                      inpaint_width=64, inpaint_height=64)
    details = passes.detail_params([unit], DetectorLibrary(tmp_path), skip_img2img=True)
    out = strict.img2img(PARAMS, [photo], details=details)[0]
    assert len(out.masks) == 1 and out.notes == ()
    x0, y0, x1, y1 = out.masks[0].getbbox()
    assert x0 < 110 < x1 and y0 < 55 < y1  # the face (measured on the photograph: about 88…137 × 33…82)
    outside = np.asarray(out.masks[0].filter(ImageFilter.GaussianBlur(unit.mask_blur))) == 0
    before, after = _pixels(photo), _pixels(out.image)
    assert outside.mean() > 0.8 and np.array_equal(before[outside], after[outside])
    assert np.abs(before[~outside] - after[~outside]).mean() > 4.0
    assert "ADetailer model: face_opencv_haar" in out.infotext and "ADetailer prompt: a smiling face" in out.infotext
