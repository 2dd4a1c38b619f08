"""Offload modes on the CPU: every mode selectable, generation unchanged, switching leaves nothing behind.

On a CPU-only machine the compute and rest devices coincide, so these tests protect the
machinery (plans, named hooks, settle, verify); tests/test_offload_moves.py makes the rest
dtype differ from the compute dtype so every move really happens, and the `gpu` tests exercise
real device transfers.
"""

from __future__ import annotations

import itertools

import pytest
import tiny
import torch
from hook_plan import actual_hooks, expected_hooks

from app.adapters.specs import LoraSpec
from app.engine.offload import balanced_budget_bytes, plan_for
from app.engine.placement import Placement
from app.engine.worker import Engine
from app.settings import OFFLOAD_CHOICES, Settings

FAST = dict(tiny.FAST, seed=4)


@pytest.fixture(scope="module")
def engine(demo_dir, tmp_path_factory):
    import shutil

    data = tmp_path_factory.mktemp("offload")
    shutil.copytree(demo_dir / "models", data / "models")
    eng = Engine(Settings(data_dir=data, device="cpu"))
    yield eng
    eng.close()


@pytest.mark.parametrize("lora", [None, "demo-style-sd15"])
def test_switching_every_mode_to_every_other_three_times_leaves_exactly_the_planned_hooks(engine, lora):
    """Any mode -> any other mode, three rounds: zero violations, and after every switch each
    module carries exactly the named hooks its mode plans (none pile up, none are left behind by
    the previous mode): `offload.inputs` at each component's entry, `offload.component` on the
    components and their children (model, balanced), `offload.stream` on each module with tensors
    (sequential) or each block (group), and `lora.bypass` on every patched layer in the streamed
    modes — the LoRA is fused (no hook) in the others."""
    engine.load_model("tiny-sd15.safetensors")
    engine.set_offload("none")
    engine.set_loras([LoraSpec(lora)] if lora else [])
    patched = set(engine.lora_stack.patched_modules())
    assert bool(patched) == bool(lora)
    found_before = engine.snapshot().violations_found_total
    for _round in range(3):
        for src, dst in itertools.permutations(OFFLOAD_CHOICES, 2):
            for mode in (src, dst):
                snap = engine.set_offload(mode)
                bypassed = patched if mode in ("sequential", "group") else set()
                assert actual_hooks(snap) == expected_hooks(engine.pipeline, mode, bypassed), (src, dst, mode)
                assert snap.lora_mode == ("bypass" if bypassed else "fused")
    engine.set_offload("sequential")
    assert all("lora.bypass" not in names for names in actual_hooks(engine.set_loras([])).values())
    snap = engine.set_offload("none")
    assert actual_hooks(snap) == {}
    assert snap.violations_found_total == found_before
    assert all(h.outcome == "ok" for h in snap.history)


def test_plan_distinguishes_rest_from_compute():
    """On a GPU, offloaded components rest on the CPU and compute on the GPU; under `none` both are
    the GPU, so a CPU tensor under `none` is a violation while under `model` it is correct."""
    from app.demo import build_tiny_pipeline

    pipe = build_tiny_pipeline("sd15")
    gpu = torch.device("cuda", 0)
    plan_none = plan_for(pipe, torch.bfloat16, gpu, "none")
    plan_model = plan_for(pipe, torch.bfloat16, gpu, "model")
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


def test_an_offload_mode_on_a_machine_without_a_gpu_says_it_changes_nothing(tmp_path, caplog):
    """On the CPU every mode keeps the model in RAM, where it computes: picking one (the `--offload` flag or the
    page's choice) says so in the log, once per choice; "none" says nothing."""
    import logging

    caplog.set_level(logging.INFO, logger="app.engine.worker")
    engine = Engine(Settings(data_dir=tmp_path, device="cpu", offload="model"))
    try:
        engine.set_offload("sequential")
        engine.set_offload("none")
    finally:
        engine.close()
    said = [r.getMessage() for r in caplog.records if "changes nothing on this machine" in r.getMessage()]
    assert [m.split("'")[1] for m in said] == ["model", "sequential"], said
    assert all("there is no GPU, so the model computes in RAM" in m for m in said)
