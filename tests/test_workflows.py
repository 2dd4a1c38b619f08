"""img2img, inpaint and hires fix on the tiny models: every stage a verified transition.

The acceptance sequence — txt2img → hires fix (its own LoRA strength from the hires prompt) →
img2img → inpaint, with the LoRAs re-weighted between the workflows — runs in strict mode (any
placement violation fails its transition) with strict forwards in every offload mode, for SD1.5,
SDXL and Flux dev, in fp32 and in bf16 (weights resting in fp32 and computing in bf16, where offload
moves are real casts: the family conformance suite, tests/families/). What it protects: zero
violations and every row `ok`; each stage its own history row; the stage pipelines share every
weight with the loaded pipeline (same objects, same data pointers); the LoRAs reach every stage;
one seed gives the same images in every mode.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from tiny import CHECKPOINTS, FAST

from app.adapters.specs import LoraSpec
from app.engine import image_ops, placement, stages
from app.engine.generate import GenerateParams, seed_generators
from app.engine.stage_params import HiresParams, hires_from_infotext
from app.engine.worker import Engine
from app.families import FAMILIES, family
from app.infotext import parse_infotext
from app.settings import OFFLOAD_CHOICES, Settings

PARAMS = GenerateParams("a red house", seed=5, **{**FAST, "steps": 3})
HIRES = HiresParams(scale=1.5, steps=2, denoising_strength=0.6)
# Weights resting in fp32 and computing in bf16: the family conformance suite (tests/families/) runs
# img2img and inpaint so in every offload mode, for every family.
DTYPES = {"fp32": {"dtype": "fp32"}, "bf16": {"dtype": "bf16"}}
STAGES = ["txt2img", "hires upscale", "hires fix", "restore_loras", "set_loras", "img2img encode", "img2img",
          "set_loras", "inpaint encode", "inpaint"]


def _mask() -> Image.Image:
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    return mask


def _pixels(result) -> np.ndarray:
    return np.asarray(result[0].image, dtype=np.int16)


def sequence(engine: Engine, family_name: str, loras: bool = True) -> list[np.ndarray]:
    """txt2img → hires fix → img2img → inpaint, the LoRAs re-weighted between the workflows."""
    style, detail = f"demo-style-{family_name}", f"demo-detail-{family_name}"
    engine.set_loras([LoraSpec(style, 1.0)] if loras else [])
    hires = dataclasses.replace(HIRES, prompt=f"a red house <lora:{style}:0.5>") if loras else HIRES
    first = _pixels(engine.generate(PARAMS))
    upscaled = engine.generate(PARAMS, hires=hires)
    engine.set_loras([LoraSpec(style, 0.8), LoraSpec(detail, 1.0)] if loras else [])
    moved = engine.img2img(PARAMS, [upscaled[0].image], denoising_strength=0.7, resize_mode="crop and resize")
    engine.set_loras([LoraSpec(detail, 0.6)] if loras else [])
    painted = engine.inpaint(PARAMS, moved[0].image, _mask(), denoising_strength=0.9, inpainting_fill="latent noise")
    return [first, _pixels(upscaled), _pixels(moved), _pixels(painted)]


def assert_shared_weights(engine: Engine) -> None:
    """Every stage pipeline holds the loaded pipeline's component objects and no tensor of its own."""
    main = engine.pipeline
    pointers = {t.data_ptr() for *_, t, _p in placement.iter_tensors(main)}
    for kind, stage in engine.stage_pipelines.items():
        for name, component in placement.torch_components(stage).items():
            assert component is getattr(main, name), (kind, name)
        assert {t.data_ptr() for *_, t, _p in placement.iter_tensors(stage)} <= pointers, kind


@pytest.fixture(scope="module", params=list(DTYPES))
def dtype_engine(request, demo_dir, tmp_path_factory):
    """A strict CPU engine per dtype configuration, on a private copy of the demo data."""
    import os
    import shutil

    data = tmp_path_factory.mktemp("workflows")
    for sub in ("models/Stable-diffusion", "models/Lora"):
        shutil.copytree(demo_dir / sub, data / sub, copy_function=os.link)
    # Every family's sequences in every mode run on this engine: keep all their history rows.
    engine = Engine(Settings(data_dir=data, device="cpu", strict=True, strict_forwards=True, history_size=1000,
                             **DTYPES[request.param]))
    yield request.param, engine
    engine.close()


@pytest.mark.parametrize("family_name", list(CHECKPOINTS))
def test_the_workflow_sequence_is_clean_in_every_offload_mode(dtype_engine, family_name):
    """Strict mode, every offload mode: every transition `ok`, zero violations, the stages in the
    history in order, no second copy of any weight, the LoRAs in every stage (the images differ
    from the same sequence without them by far more than modes differ from each other), and one
    seed gives the same images in every mode (bit for bit where whole components compute in one
    dtype; within two grey levels where streamed modes leave neighbours at rest in fp32)."""
    name, engine = dtype_engine
    engine.load_model(CHECKPOINTS[family_name])
    runs = {}
    for mode in OFFLOAD_CHOICES:
        engine.set_offload(mode)
        start = len(engine.snapshot().history)
        runs[mode] = sequence(engine, family_name)
        snap = engine.snapshot()
        rows = snap.history[start:]
        assert all(row.outcome == "ok" and row.violations_found == 0 for row in rows), (mode, rows)
        assert [r.command for r in rows if r.command in STAGES] == ["set_loras", *STAGES], mode
        assert snap.violations_found_total == 0 and placement.verify(engine.pipeline, engine.placement_plan) == []
        assert_shared_weights(engine)
    engine.set_offload("none")
    bare = sequence(engine, family_name, loras=False)
    for mode, images in runs.items():
        exact = mode in ("none", "model", "balanced")
        for stage, (image, expected) in enumerate(zip(images, runs["none"], strict=True)):
            diff = np.abs(image - expected).mean()
            assert diff == 0 if exact else diff < 2.0, (name, family_name, mode, stage, diff)
    for stage, (image, without) in enumerate(zip(runs["none"], bare, strict=True)):
        assert np.abs(image - without).mean() > 4.0, (name, family_name, stage)  # the LoRAs reached every stage


def test_the_same_seed_gives_the_same_images_and_the_hires_infotext_round_trips(engine):
    """Deterministic per seed (a second run is bit-identical), and the hires image's infotext parses
    back (`parse_infotext` + `hires_from_infotext`) to the very settings that made it, which give
    the same image again."""
    engine.load_model(CHECKPOINTS["sd15"])
    hires = HiresParams(scale=2, upscaler="Lanczos", steps=3, denoising_strength=0.55, sampler="DDIM",
                        prompt="a blue house")
    first = engine.generate(PARAMS, hires=hires)[0]
    assert _pixels([first]).tolist() == _pixels(engine.generate(PARAMS, hires=hires)).tolist()
    parsed = parse_infotext(first.infotext)
    for key, value in {"Denoising strength": "0.55", "Hires upscale": "2", "Hires steps": "3",
                       "Hires upscaler": "Lanczos", "Hires sampler": "DDIM", "Hires prompt": "a blue house",
                       "Size": "64x64"}.items():
        assert parsed.settings[key] == value, key
    assert hires_from_infotext(parsed.settings) == hires
    settings = parsed.settings
    rebuilt = GenerateParams(parsed.prompt, parsed.negative_prompt, steps=int(settings["Steps"]),
                             cfg=float(settings["CFG scale"]), seed=int(settings["Seed"]), sampler=settings["Sampler"],
                             width=64, height=64)
    assert rebuilt == PARAMS
    assert _pixels(engine.generate(rebuilt, hires=hires_from_infotext(settings))).tolist() == _pixels([first]).tolist()
    assert first.image.size == (128, 128)


def test_settings_out_of_range_are_refused_before_anything_runs(engine):
    """Hires past the size limit or the pixel-step cap, a pass that would run no step, an unknown
    upscaler, resize mode or masked content: a ValueError naming the setting, and no transition."""
    engine.load_model(CHECKPOINTS["sd15"])
    rows = len(engine.snapshot().history)
    image = Image.new("RGB", (64, 64), (90, 30, 30))
    big = dataclasses.replace(PARAMS, width=1600, height=1600)
    cases = [
        (lambda: engine.generate(big, hires=HiresParams(scale=2)), "over the limit of 2048"),
        (lambda: engine.generate(dataclasses.replace(PARAMS, steps=1), hires=HiresParams(denoising_strength=0.5)),
         "run no step"),
        (lambda: engine.generate(PARAMS, hires=HiresParams(upscaler="4x-UltraSharp")), "unknown hires upscaler"),
        (lambda: HiresParams(scale=8), "hires_scale must be a number in 1…4"),
        (lambda: engine.img2img(PARAMS, [image], denoising_strength=0.2), "run no step"),
        (lambda: engine.img2img(PARAMS, [image], resize_mode="stretch"), "resize mode must be one of"),
        (lambda: engine.img2img(PARAMS, [image], mask=_mask(), inpainting_fill=7), "masked content must be one of"),
        (lambda: engine.img2img(PARAMS, []), "at least one init image"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert len(engine.snapshot().history) == rows


def test_an_empty_mask_fails_its_stage_and_leaves_the_engine_ready_with_its_loras(engine):
    """A mask with nothing painted fails the encode stage with a clear message; the stage rolls
    back, the prompt-tag LoRAs are taken off again, and the next workflow runs."""
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([LoraSpec("demo-style-sd15", 0.7)])
    image = Image.new("RGB", (64, 64), (90, 30, 30))
    tagged = dataclasses.replace(PARAMS, prompt="a red house <lora:demo-detail-sd15:1>")
    with pytest.raises(ValueError, match="the mask is empty"):
        engine.inpaint(tagged, image, Image.new("L", (64, 64), 0))
    snap = engine.snapshot()
    commands = [(r.command, r.outcome) for r in snap.history[-4:]]
    assert commands == [("set_loras", "ok"), ("apply_loras", "ok"), ("inpaint encode", "failed, rolled back"),
                        ("restore_loras", "ok")]
    assert snap.state == "READY" and snap.loras == (LoraSpec("demo-style-sd15", 0.7),)
    assert engine.inpaint(PARAMS, image, _mask())[0].image.size == (64, 64)


def test_a_misplaced_carried_tensor_is_found_and_repaired(engine):
    """Tensors a stage hands to the next are part of what verify checks: one in the wrong dtype is
    a violation the next transition counts and repairs (to float32 on the execution device)."""
    engine.load_model(CHECKPOINTS["sd15"])
    carry = engine._lifecycle.carry
    carry._tensors["latents"] = torch.zeros(1, 4, 8, 8, dtype=torch.float16)
    row = engine.set_offload("none").history[-1]
    assert (row.outcome, row.violations_found, row.violations_repaired) == ("ok", 1, 1)
    assert carry.get("latents").dtype == torch.float32
    carry.clear()


def test_an_inpainting_checkpoint_inpaints_and_runs_img2img_as_a_full_mask(engine):
    """The 9-channel demo checkpoint: inpaint feeds it the mask and the masked-image latents;
    img2img runs as inpaint with the whole picture masked (A1111's way). Outside the mask the
    pixels are the original's exactly (the overlay). txt2img and hires fix run on it as A1111 runs
    them (a blank picture masked whole as its conditioning), the same seed giving the same image."""
    snap = engine.load_model("tiny-sd15-inpainting.safetensors")
    assert engine.pipeline.unet.config.in_channels == 9 and snap.family == "sd15"
    image = Image.new("RGB", (64, 64), (40, 120, 200))
    painted = _pixels(engine.inpaint(PARAMS, image, _mask(), mask_blur=0, inpainting_fill="fill"))
    assert (painted[:8] == np.asarray(image)[:8]).all() and (painted[24:40, 24:40] != (40, 120, 200)).any()
    assert engine.img2img(PARAMS, [image], denoising_strength=0.8)[0].image.size == (64, 64)
    assert all(row.outcome == "ok" for row in engine.snapshot().history)
    first, again = _pixels(engine.generate(PARAMS)), _pixels(engine.generate(PARAMS))
    assert first.shape == (64, 64, 3) and first.std() > 1 and np.array_equal(first, again)
    assert engine.generate(PARAMS, hires=HIRES)[0].image.size[0] > 64
    assert engine.snapshot().state == "READY" and all(row.outcome == "ok" for row in engine.snapshot().history)


def test_a_real_inpainting_single_file_gets_a_nine_channel_unet_config():
    """A full-size SD1.5 inpainting file carries no config: its first UNet conv's 9 input channels
    (read from the header) replace the bundled 4, and a regular file keeps the bundled config."""
    from app.engine.models import unet_channel_override
    from app.families import family
    from app.families.ldm_layout import UNET_PREFIX

    key, config_dir = UNET_PREFIX + "input_blocks.0.0.weight", family("sd15").files.config_dir
    override = unet_channel_override(config_dir, {key: (320, 9, 3, 3)})
    assert override["unet"]["in_channels"] == 9 and override["unet"]["out_channels"] == 4
    assert unet_channel_override(config_dir, {key: (320, 4, 3, 3)}) == {}


def test_a_family_without_stage_pipelines_refuses_the_workflows_before_queueing(engine, monkeypatch):
    """A family that registers no stage pipeline (a new family file's default) refuses each workflow by
    name, with no transition run and the model untouched."""
    engine.load_model(CHECKPOINTS["sd15"])
    monkeypatch.setitem(FAMILIES, "sd15", dataclasses.replace(family("sd15"), stage_pipelines={}))
    rows = len(engine.snapshot().history)
    image = Image.new("RGB", (64, 64), (90, 30, 30))
    for call in (lambda: engine.img2img(PARAMS, [image]), lambda: engine.inpaint(PARAMS, image, _mask()),
                 lambda: engine.generate(PARAMS, hires=HIRES)):
        with pytest.raises(ValueError, match="is not available for SD1.5 models yet"):
            call()
    assert len(engine.snapshot().history) == rows and engine.snapshot().state == "READY"


def test_flux_stages_follow_the_seed_the_guidance_and_the_mask(engine):
    """Flux dev, as SD: a stage pass runs int(steps x strength) steps (diffusers' Flux rule would run
    one more here); a second run is bit-identical; the distilled guidance reaches the img2img pass
    and is written as Forge writes it, beside A1111's workflow fields; inpaint keeps every pixel
    outside the mask exactly (the overlay); and our encode is diffusers' Flux encode to the bit (the
    VAE's shift and scale, before the pipeline packs the latents into patches)."""
    engine.load_model(CHECKPOINTS["flux-dev"])
    image = engine.generate(PARAMS)[0].image
    moved = engine.img2img(PARAMS, [image], denoising_strength=0.7)
    assert engine.stage_pipelines["img2img"].num_timesteps == int(PARAMS.steps * 0.7) == 2
    assert _pixels(moved).tolist() == _pixels(engine.img2img(PARAMS, [image], denoising_strength=0.7)).tolist()
    guided = engine.img2img(dataclasses.replace(PARAMS, cfg=1.5), [image], denoising_strength=0.7)
    assert np.abs(_pixels(guided) - _pixels(moved)).mean() > 1.0
    settings = parse_infotext(moved[0].infotext).settings
    assert (settings["CFG scale"], settings["Distilled CFG Scale"], settings["Denoising strength"]) == ("1", "5", "0.7")
    upscaled = engine.generate(PARAMS, hires=HIRES)
    assert _pixels(upscaled).tolist() == _pixels(engine.generate(PARAMS, hires=HIRES)).tolist()
    assert hires_from_infotext(parse_infotext(upscaled[0].infotext).settings) == HIRES
    assert upscaled[0].image.size == (96, 96)
    painted = _pixels(engine.inpaint(PARAMS, image, _mask(), mask_blur=0, inpainting_fill="latent nothing"))
    original = np.asarray(image, dtype=np.int16)
    assert (painted[:16] == original[:16]).all() and (painted[20:44, 20:44] != original[20:44, 20:44]).any()
    with torch.no_grad():
        ours = stages.encode(engine.pipeline, [image], 9)
        theirs = engine.stage_pipelines["img2img"]._encode_vae_image(image_ops.to_tensor([image]),
                                                                     seed_generators(9, 1)[0])
    assert torch.equal(ours, theirs)
    assert all(row.outcome == "ok" for row in engine.snapshot().history)


def test_interrupt_in_the_first_pass_keeps_its_image_and_skips_the_hires_pass(engine):
    """Interrupt while the first pass denoises: the first pass's image comes back at the first
    pass's size, marked with the step it stopped at, no upscale or hires pass runs, and the
    engine is READY with nothing carried over."""
    import threading
    import time

    engine.load_model(CHECKPOINTS["sd15"])
    long = dataclasses.replace(PARAMS, steps=150)
    done: dict = {}
    worker = threading.Thread(target=lambda: done.setdefault("images", engine.generate(long, hires=HIRES)))
    worker.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        progress = engine.snapshot().progress
        if progress is not None and progress.phase.startswith("first pass") and progress.step >= 2:
            break
        time.sleep(0.01)
    assert engine.interrupt()
    worker.join(timeout=120)
    (image,) = done["images"]
    assert image.image.size == (64, 64) and image.stopped_at is not None and image.stopped_at < 150
    snap = engine.snapshot()
    assert snap.history[-1].command == "txt2img" and snap.history[-1].outcome == "interrupted"
    assert "hires upscale" not in {row.command for row in snap.history} and snap.state == "READY"
    assert "latents" not in engine._lifecycle.carry
