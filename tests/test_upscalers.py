"""Upscaler models on the engine (CPU): the demo RealESRGAN-compact file through Extras and the hires fix.

What a user relies on: an upscaler run through the engine gives exactly what spandrel's own call of
the model gives; cutting a large image into tiles leaves no seam; a `.pth` is read without unpickling
anything; every offload mode places the upscaler as the plan says, and Interrupt stops it between tiles.
"""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
import torch
from peak_rss import peak_rss_while
from PIL import Image

from app.engine import placement
from app.engine.generate import GenerateParams
from app.engine.stage_params import HiresParams
from app.engine.upscaler_slot import COMPONENT
from app.engine.worker import Engine
from app.settings import OFFLOAD_CHOICES, Settings
from app.ui.common import UiContext
from app.ui.extras_tab import run_extras
from app.upscalers import arch, files, tiling
from app.upscalers.demo import DEMO_NAME
from app.upscalers.extras import ExtrasParams

# 8-bit levels, and the share of pixels that may reach it: float rounding of convolutions over different
# extents (~1e-6) moves a value across a rounding boundary in a handful of pixels, no more.
SEAM_TOLERANCE, SEAM_SHARE = 1, 1e-4


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=generator) * 255).byte().numpy())


@pytest.fixture(scope="module")
def upscaler_dir(demo_dir, tmp_path_factory) -> Path:
    """A data folder holding only the demo upscaler (and the SD1.5 checkpoint, for the hires fix)."""
    root = tmp_path_factory.mktemp("upscalers")
    for sub, name in (("models/RealESRGAN", f"{DEMO_NAME}.safetensors"),
                      ("models/Stable-diffusion", "tiny-sd15.safetensors")):
        (root / sub).mkdir(parents=True)
        (root / sub / name).hardlink_to(demo_dir / sub / name)
    return root


@pytest.fixture(scope="module")
def engine(upscaler_dir):
    eng = Engine(Settings(data_dir=upscaler_dir, device="cpu"))
    yield eng
    eng.close()


def _spandrel_model(path: Path):
    return arch.describe(files.read_state_dict(path), "reference")


def test_engine_upscale_equals_spandrels_own_call_bit_exactly(engine, upscaler_dir):
    """Extras ×4 in fp32 on one tile gives spandrel's own model call on the same tile, bit for bit (float
    output and the 8-bit image), and the upscaler shows as a placed, verified component."""
    image = _noise(72, 56)
    [result] = engine.extras([image], ExtrasParams(DEMO_NAME, factor=4))
    reference = _spandrel_model(upscaler_dir / "models/RealESRGAN" / f"{DEMO_NAME}.safetensors")
    tile = tiling.to_tensor(image)
    want = reference(tile)
    assert torch.equal(engine.upscaler_slot.run_tile(tile), want)
    assert np.array_equal(np.asarray(result.image), np.asarray(tiling.to_image(want)))
    assert result.image.size == (288, 224) and result.infotext == \
        f"Postprocess upscale by: 4, Postprocess upscaler: {DEMO_NAME}"
    with Image.open(result.path) as saved:
        assert saved.text["postprocessing"] == result.infotext and "parameters" not in saved.text
    snap = engine.snapshot()
    assert (snap.upscaler.name, snap.upscaler.arch, snap.upscaler.scale, snap.upscaler.dtype) == \
        (DEMO_NAME, "RealESRGAN Compact", 4, "fp32")
    assert snap.history[-1].command == "upscale" and snap.history[-1].outcome == "ok"
    assert snap.violations_found_total == 0 and any(row.component == COMPONENT for row in snap.placement)


def test_tiled_result_equals_the_untiled_one_within_the_seam_tolerance(engine):
    """A 300×260 image in 64-pixel tiles with 8 pixels of context equals the untiled result within
    `SEAM_TOLERANCE` in at most `SEAM_SHARE` of its pixels; with 2 pixels of context (less than the model's
    reach) it does not. The untiled 8-bit result is the model's own call, rounded."""
    engine.extras([_noise(8, 8)], ExtrasParams(DEMO_NAME, factor=4))  # loaded
    image = _noise(300, 260, seed=1)
    run, never = engine.upscaler_slot.run_tile, lambda done, total: False
    untiled = np.asarray(tiling.upscale_tiled(image, run, 4, tiling.Tiling(1024, 0), never), dtype=np.int16)
    assert np.array_equal(untiled, np.asarray(tiling.to_image(run(tiling.to_tensor(image)))))

    def off(tiles: tiling.Tiling) -> np.ndarray:
        return np.abs(np.asarray(tiling.upscale_tiled(image, run, 4, tiles, never), dtype=np.int16) - untiled)
    seams = off(tiling.Tiling(64, 8))
    assert seams.max() <= SEAM_TOLERANCE and (seams > 0).mean() <= SEAM_SHARE
    assert (off(tiling.Tiling(64, 2)) > 0).mean() > 100 * SEAM_SHARE


class _Touch:
    """A pickled object whose unpickling would create a file: proof that nothing was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_pth_is_read_weights_only_and_a_pickled_object_is_refused(engine, upscaler_dir, tmp_path):
    """A `.pth` state dict (in BasicSR's `params_ema` wrapper) loads like the `.safetensors`; a `.safetensors`
    wins over a `.pth` of the same name; a `.pth` holding a pickled object is refused with the reason,
    the object never built, and the engine stays usable."""
    folder = upscaler_dir / "models/upscale_models"
    folder.mkdir(exist_ok=True)
    tensors = files.read_state_dict(upscaler_dir / "models/RealESRGAN" / f"{DEMO_NAME}.safetensors")
    torch.save({"params_ema": tensors}, folder / "plain-x4.pth")
    assert all(torch.equal(a, tensors[k]) for k, a in files.read_state_dict(folder / "plain-x4.pth").items())
    torch.save(tensors, folder / f"{DEMO_NAME}.pth")  # same stem as the .safetensors
    assert engine.upscalers.path_for(DEMO_NAME).suffix == ".safetensors"
    marker = tmp_path / "unpickled"
    torch.save({**tensors, "config": _Touch(marker)}, folder / "evil-x4.pth")
    with pytest.raises(files.UpscalerFileError, match=r"evil-x4\.pth: refused: it holds pickled objects"):
        engine.extras([_noise(16, 16)], ExtrasParams("evil-x4"))
    assert not marker.exists()
    assert engine.snapshot().history[-1].outcome == "failed, rolled back"
    assert engine.extras([_noise(16, 16)], ExtrasParams("plain-x4", factor=4))[0].image.size == (64, 64)
    with pytest.raises(ValueError, match="unknown upscaler 'nope'; choose one of None, Lanczos, Nearest, .*plain-x4"):
        engine.extras([_noise(16, 16)], ExtrasParams("nope"))
    with pytest.raises(pickle.UnpicklingError):  # what torch itself says, so the refusal above is its doing
        torch.load(folder / "evil-x4.pth", weights_only=True)


def test_every_offload_mode_places_the_upscaler_and_interrupt_stops_between_tiles(upscaler_dir):
    """Resting in fp32 and computing in bf16 (so every move is a real cast on the CPU), each offload mode
    leaves the upscaler exactly where its plan says with its mode's hooks and gives the same bf16 result
    bit for bit; Interrupt during a 1,024-tile run stops it between two tiles, nothing kept."""
    eng = Engine(Settings(data_dir=upscaler_dir, device="cpu", dtype="bf16", rest_dtype="fp32"))
    try:
        image, reference = _noise(40, 32), None
        for mode in OFFLOAD_CHOICES:
            eng.set_offload(mode)
            [result] = eng.extras([image], ExtrasParams(DEMO_NAME, factor=4))
            slot, snap = eng.upscaler_slot, eng.snapshot()
            plan = slot.plan
            at_rest = torch.float32 if mode in ("model", "sequential", "group") else torch.bfloat16  # balanced:
            want = placement.Placement(torch.device("cpu"), at_rest)  # kept resident, so in its compute placement
            assert plan.expected(COMPONENT) == want and snap.upscaler.dtype == "bf16"
            assert all(t.dtype == want.dtype for t in slot.model.parameters())
            hooks = {row.module: row.hooks for row in snap.placement if row.component == COMPONENT}
            expected = {"none": set(), "model": {"offload.component"}, "balanced": {"offload.component"},
                        "sequential": {"offload.stream"}, "group": {"offload.stream"}}[mode]
            assert {h for names in hooks.values() for h in names} - {"offload.inputs"} == expected, (mode, hooks)
            assert snap.violations_found_total == 0, (mode, snap.violations)
            pixels = np.asarray(result.image)
            reference = pixels if reference is None else reference
            assert np.array_equal(pixels, reference), mode  # the same bf16 math, whatever moved the weights
        eng.tiling = tiling.Tiling(16, 4)
        started = threading.Event()
        threading.Thread(target=lambda: (started.wait(60), eng.interrupt()), daemon=True).start()
        watcher = threading.Thread(target=_wait_for_tiles, args=(eng, started), daemon=True)
        watcher.start()
        assert eng.extras([_noise(512, 512)], ExtrasParams(DEMO_NAME, factor=4)) == []
        assert eng.snapshot().violations_found_total == 0
        assert eng.upscaler_slot.verify_and_repair("after the interrupt") == ([], 0)
    finally:
        eng.close()


def _wait_for_tiles(eng: Engine, started: threading.Event) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        progress = eng.snapshot().progress
        if progress is not None and progress.phase.startswith("upscaling") and progress.step >= 2:
            started.set()
            return
        time.sleep(0.005)


def test_hires_fix_with_the_upscaler_model(engine):
    """The hires fix upscales the first pass with the model (A1111's infotext names it), each stage a clean
    transition; an unknown upscaler is refused before anything is queued, with the choices."""
    engine.load_model("tiny-sd15.safetensors")
    params = GenerateParams("a cat", steps=2, width=64, height=64, cfg=5.0, seed=3, sampler="Euler")
    before = len(engine.snapshot().history)
    with pytest.raises(ValueError, match=f"unknown hires upscaler 'nope'; choose one of Latent, .*{DEMO_NAME}"):
        engine.generate(params, hires=HiresParams(1.25, "nope", 0, 0.5))
    assert len(engine.snapshot().history) == before
    [model] = engine.generate(params, hires=HiresParams(1.25, DEMO_NAME, 0, 0.5))
    [lanczos] = engine.generate(params, hires=HiresParams(1.25, "Lanczos", 0, 0.5))
    assert model.image.size == (80, 80) and f"Hires upscaler: {DEMO_NAME}" in model.infotext
    assert not np.array_equal(np.asarray(model.image), np.asarray(lanczos.image))
    rows = engine.snapshot().history[-6:-3]
    assert [(r.command, r.outcome, r.violations_found) for r in rows] == \
        [("txt2img", "ok", 0), ("hires upscale", "ok", 0), ("hires fix", "ok", 0)]


def test_extras_tab_upscales_the_batch_when_its_tab_is_open(engine):
    """The Extras tab's handler takes the batch gallery's (image, caption) pairs when Batch is the open
    sub-tab, and says which is empty otherwise."""
    ctx = UiContext(engine, engine.settings)
    batch = [(_noise(16, 16), None), (_noise(24, 16, seed=2), None)]
    items, text = run_extras(ctx, None, batch, "batch", "Scale by", 2, 512, 512, True, "Lanczos", "None", 0)
    assert [caption for _path, caption in items] == ["32x32", "48x32"]
    assert text == "Postprocess upscale by: 2, Postprocess upscaler: Lanczos"
    with pytest.raises(gr.Error, match="upload an image first"):
        run_extras(ctx, None, batch, "single", "Scale by", 2, 512, 512, True, "Lanczos", "None", 0)


def test_extras_holds_no_float32_result_of_a_large_upscale(engine):
    """Issue 43 finding 2: the tiled upscaler assembled the whole float32 result, then made full-size
    copies of it to round it to 8 bits (1024² x4: +0.6 GiB; 4096² -> 8192², whose x4 pass makes 16384²,
    passed 6.2 GiB). Now each tile's core goes straight into the 8-bit result image and each tile's input
    is read from the 8-bit source: the same 1024² x4 holds under +400 MiB (measured +0.2 GiB), and its
    pixels are the old path's, bit for bit (the untiled result is the model's own call, rounded: the seam
    test; every tile's core is rounded alone, as the whole was)."""
    engine.extras([_noise(8, 8)], ExtrasParams(DEMO_NAME, factor=4))  # loaded
    image = _noise(1024, 1024, seed=2)
    [result], grown = peak_rss_while(lambda: engine.extras([image], ExtrasParams(DEMO_NAME, factor=4)))
    print(f"Extras 1024² x4: RSS +{grown / 2**20:.0f} MiB")
    assert result.image.size == (4096, 4096)
    assert grown < 400 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB"
