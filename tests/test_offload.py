"""Offload modes on the CPU: every mode selectable, generation unchanged, switching leaves nothing behind.

On a CPU-only machine the compute and rest devices coincide, so these tests protect the
machinery (plans, hook install/removal, settle, verify) rather than transfer speed; the
`gpu` tests exercise real moves.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tiny
import torch

from app.adapters.specs import LoraSpec
from app.engine.engine import Engine
from app.engine.generate import GenerateParams
from app.engine.offload import balanced_budget_bytes
from app.engine.placement import Placement, plan_placement
from app.settings import OFFLOAD_CHOICES, Settings

FAST = dict(tiny.FAST, seed=4)


def _hook_count(pipe) -> int:
    from app.engine.placement import torch_components

    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
               for c in torch_components(pipe).values() for m in c.modules())


@pytest.fixture(scope="module")
def engine(demo_dir, tmp_path_factory):
    import shutil

    data = tmp_path_factory.mktemp("offload")
    shutil.copytree(demo_dir / "models", data / "models")
    eng = Engine(Settings(data_dir=data, device="cpu"))
    yield eng
    eng.close()


@pytest.mark.parametrize("model", ["tiny-sd15.safetensors", "tiny-sdxl.safetensors"])
def test_every_mode_generates_the_same_image(engine, model):
    """Offload changes where weights live, never what is computed: one seed, one image, every mode."""
    engine.load_model(model)
    engine.set_offload("none")
    reference = np.asarray(engine.generate(GenerateParams("a cat", **FAST))[0].image)
    for mode in OFFLOAD_CHOICES:
        snap = engine.set_offload(mode)
        assert snap.offload == mode
        image = np.asarray(engine.generate(GenerateParams("a cat", **FAST))[0].image)
        assert np.array_equal(image, reference), mode
        assert engine.snapshot().history[-1].violations_found == 0


@pytest.mark.parametrize("lora", [None, "demo-style-sd15"])
def test_switching_every_mode_to_every_other_three_times_leaves_no_hooks(engine, lora):
    """Any mode -> any other mode, three rounds: zero violations; each mode shows the same hooks every
    time it is entered (none pile up), and back in `none` the hook count equals the count right after
    load (a full remove leaves no hook behind). With a LoRA applied, the streamed modes carry exactly
    one on-the-fly hook pair per patched layer, and `none` none (the LoRA is fused again)."""
    engine.load_model("tiny-sd15.safetensors")
    engine.set_offload("none")
    baseline = _hook_count(engine.pipeline)
    engine.set_loras([LoraSpec(lora)] if lora else [])
    patched = len(engine._loaded.stack.patched_modules())
    assert (patched > 0) == bool(lora)
    found_before = engine.snapshot().violations_found_total
    per_mode: dict[str, int] = {}
    for _round in range(3):
        for src, dst in itertools.permutations(OFFLOAD_CHOICES, 2):
            engine.set_offload(src)
            engine.set_offload(dst)
            assert _hook_count(engine.pipeline) == per_mode.setdefault(dst, _hook_count(engine.pipeline)), (src, dst)
            engine.set_offload("none")
            assert _hook_count(engine.pipeline) == baseline, (src, dst)
    for mode in ("sequential", "group"):
        engine.set_offload(mode)
        engine.set_loras([])
        assert per_mode[mode] - _hook_count(engine.pipeline) == 2 * patched, mode
        engine.set_loras([LoraSpec(lora)] if lora else [])
    engine.set_offload("none")
    engine.set_loras([])
    snap = engine.snapshot()
    assert snap.violations_found_total == found_before
    assert all(h.outcome == "ok" for h in snap.history)


@pytest.mark.parametrize("mode", ["model", "sequential", "group", "balanced"])
def test_mode_installs_hooks_and_none_removes_them(engine, mode):
    """Each offload mode really installs hooks (it is not a no-op), and switching to none removes them."""
    engine.load_model("tiny-sd15.safetensors")
    engine.set_offload("none")
    baseline = _hook_count(engine.pipeline)
    engine.set_offload(mode)
    assert _hook_count(engine.pipeline) > baseline
    engine.set_offload("none")
    assert _hook_count(engine.pipeline) == baseline


def test_plan_distinguishes_rest_from_compute():
    """On a GPU, offloaded components rest on the CPU and compute on the GPU; under `none` both are
    the GPU, so a CPU tensor under `none` is a violation while under `model` it is correct."""
    from app.demo import build_tiny_pipeline

    pipe = build_tiny_pipeline("sd15")
    gpu = torch.device("cuda", 0)
    plan_none = plan_placement(pipe, torch.bfloat16, gpu, "none")
    plan_model = plan_placement(pipe, torch.bfloat16, gpu, "model")
    assert plan_none.expected("unet") == Placement(gpu, torch.bfloat16)
    assert plan_model.expected("unet") == Placement(torch.device("cpu"), torch.bfloat16)
    assert plan_model.components["unet"].compute == Placement(gpu, torch.bfloat16)
    assert plan_model.with_resident(frozenset({"unet"})).expected("unet") == Placement(gpu, torch.bfloat16)


def test_launch_flags_set_the_balanced_budget_and_nonsense_is_refused():
    """`--vram-watermark` and `--vram-budget` reach the settings and the balanced budget;
    a watermark outside (0, 1] or a non-positive budget is refused at start-up with a message."""
    import launch

    settings = launch.settings_from_args(launch.build_parser().parse_args(["--vram-watermark", "0.5",
                                                                           "--vram-budget", "3"]))
    assert (settings.balanced_watermark, settings.vram_budget_gib) == (0.5, 3.0)
    cpu = torch.device("cpu")
    assert balanced_budget_bytes(cpu, settings.vram_budget_gib, settings.balanced_watermark) == 3 * 2**30
    for bad in (dict(balanced_watermark=0.0), dict(balanced_watermark=1.5)):
        with pytest.raises(ValueError, match=r"VRAM watermark is a fraction of the GPU's memory in \(0, 1\]"):
            Settings(**bad)
    with pytest.raises(ValueError, match="VRAM budget must be a positive number of GiB"):
        Settings(vram_budget_gib=0)
