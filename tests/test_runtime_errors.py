"""Runtime errors inside patched layers: attributed to the LoRAs patched there, counted, and past
`Settings.max_lora_errors` the LoRA is disabled and taken out of the model — except in strict
mode, where every error surfaces as is and nothing is disabled. `set_loras` re-enables.

The failure is injected the way a broken adapter or kernel would show up: a forward pre-hook on
one module of `engine.pipeline` raises `RuntimeError` during denoising. The hook belongs to the
module, not to the LoRA, so once a LoRA is disabled the tests remove the hook themselves before
checking that the next generation succeeds without it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import tiny
from weight_digest import weights_digest

from app.adapters.specs import LoraSpec
from app.adapters.synthetic import write_adapter
from app.demo import build_tiny_pipeline
from app.engine import offload, placement
from app.engine.generate import GenerateParams
from app.engine.worker import Engine, EngineState
from app.settings import OFFLOAD_CHOICES, Settings

FAST = dict(tiny.FAST, seed=5)
MAX_ERRORS = 3
SD15 = "tiny-sd15.safetensors"
# Which modules each test LoRA patches (tiny SD1.5 UNet): A and B are disjoint, C shares A's to_q.
TO_Q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
CONV1 = "down_blocks.1.resnets.0.conv1"
TARGETS = {
    "lora-a": ("unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
               "unet.up_blocks.1.attentions.0.proj_in"),
    "lora-b": ("unet.down_blocks.1.resnets.0.conv1", "unet.mid_block.resnets.0.conv1"),
    "lora-c": ("unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",),
}
A, B, C = (LoraSpec(name, 0.8) for name in TARGETS)


class InjectedFailure(RuntimeError):
    """What the test hook raises: a stand-in for a kernel or shape error inside a layer."""


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("runtime_errors")
    for sub in ("models/Stable-diffusion", "embeddings"):
        shutil.copytree(demo_dir / sub, target / sub, copy_function=os.link)
    pipe = build_tiny_pipeline("sd15")
    for i, (name, targets) in enumerate(TARGETS.items()):
        write_adapter(target / "models" / "Lora" / f"{name}.safetensors", pipe, "sd15", "lora", "kohya",
                      targets=targets, seed=i, alpha=4.0)
    return target


@pytest.fixture(scope="module")
def reference(data) -> dict[tuple[str, ...], str]:
    """Weight digests of fresh fuses: () is the checkpoint itself."""
    eng = Engine(Settings(data_dir=data, device="cpu"))
    try:
        eng.load_model(SD15, dtype="fp32")
        out = {(): weights_digest(eng.pipeline)}
        for specs in ((A,), (B,), (A, B), (C,), (A, C)):
            eng.set_loras([])
            eng.set_loras(list(specs))
            out[tuple(s.name for s in specs)] = weights_digest(eng.pipeline)
        return out
    finally:
        eng.close()


@pytest.fixture
def engine(data):
    eng = Engine(Settings(data_dir=data, device="cpu", max_lora_errors=MAX_ERRORS))
    eng.load_model(SD15, dtype="fp32")
    yield eng
    eng.close()


class RaisingHook:
    """A forward pre-hook on one module of the live pipeline that raises while installed."""

    def __init__(self, engine: Engine, component: str, path: str) -> None:
        module = getattr(engine.pipeline, component).get_submodule(path)
        self.calls = 0
        self._handle = module.register_forward_pre_hook(self._raise)

    def _raise(self, _module, _args):
        self.calls += 1
        raise InjectedFailure("injected failure in the layer's forward")

    def remove(self) -> None:
        self._handle.remove()


def failing_generate(engine: Engine) -> None:
    with pytest.raises(InjectedFailure, match="injected failure"):
        engine.generate(GenerateParams("a cat", **FAST))
    snap = engine.snapshot()
    assert snap.state == EngineState.READY.value
    assert (snap.history[-1].command, snap.history[-1].outcome) == ("generate", "failed, rolled back")


def counters(engine: Engine, name: str):
    return engine.snapshot().lora_counters[name]


def assert_placement_clean(engine: Engine) -> None:
    snap = engine.snapshot()
    plan = offload.plan_for(engine.pipeline, placement.DTYPES[snap.dtype], engine.device, snap.offload)
    assert placement.verify(engine.pipeline, plan) == []


@pytest.mark.parametrize("offload", OFFLOAD_CHOICES)
def test_error_in_patched_layer_counts_against_that_lora_only(engine, offload):
    """An error raised inside a layer patched by LoRA A (only) is counted against A — with the
    error in its message — and not against B, which patches other layers; below the limit A
    stays applied. Holds under every offload mode (their hooks wrap the same forward)."""
    engine.set_offload(offload)
    engine.set_loras([A, B])
    hook = RaisingHook(engine, "unet", TO_Q)
    failing_generate(engine)
    assert hook.calls == 1
    a, b = counters(engine, "lora-a"), counters(engine, "lora-b")
    assert (a.runtime_errors, a.disabled) == (1, False)
    assert a.message == f"runtime error 1/{MAX_ERRORS}: injected failure in the layer's forward"
    assert (b.runtime_errors, b.disabled, b.message) == (0, False, "")
    assert engine.snapshot().loras == (A, B)
    assert_placement_clean(engine)


def test_error_in_layer_shared_by_two_loras_counts_against_both(engine):
    """A layer patched by A and C: an error there is counted against both, not against B."""
    engine.set_loras([A, B, C])
    hook = RaisingHook(engine, "unet", TO_Q)
    failing_generate(engine)
    hook.remove()
    assert counters(engine, "lora-a").runtime_errors == 1
    assert counters(engine, "lora-c").runtime_errors == 1
    assert counters(engine, "lora-b").runtime_errors == 0


def test_error_in_unpatched_layer_counts_against_no_lora(engine, reference):
    """An error in a layer no LoRA patches (the UNet's conv_in) is the model's, not a LoRA's: no
    counter moves, nothing is disabled, the weights stay those of the fused list."""
    engine.set_loras([A, B])
    hook = RaisingHook(engine, "unet", "conv_in")
    for _ in range(MAX_ERRORS + 1):
        failing_generate(engine)
    hook.remove()
    for name in ("lora-a", "lora-b"):
        c = counters(engine, name)
        assert (c.runtime_errors, c.disabled) == (0, False)
    assert engine.snapshot().loras == (A, B)
    assert weights_digest(engine.pipeline) == reference[("lora-a", "lora-b")]


def test_strict_mode_reraises_and_never_disables(engine, reference):
    """In strict mode every runtime error reaches the caller unchanged, however many there are,
    and no LoRA is disabled or removed: debugging needs the failing state as it is."""
    engine.set_debug(strict=True)
    engine.set_loras([A])
    hook = RaisingHook(engine, "unet", TO_Q)
    try:
        for _ in range(MAX_ERRORS + 2):
            failing_generate(engine)
    finally:
        hook.remove()
        engine.set_debug(strict=False)
    a = counters(engine, "lora-a")
    assert a.runtime_errors == MAX_ERRORS + 2 and not a.disabled
    assert engine.snapshot().loras == (A,)
    assert weights_digest(engine.pipeline) == reference[("lora-a",)]


def test_lora_disabled_after_max_errors_and_removed_from_the_model(engine, reference):
    """After `max_lora_errors` errors in its layer the only LoRA is disabled with a message that
    says so, it is taken out of the model (weights back to the checkpoint bit for bit, no backup
    kept), and — the faulty hook removed — the next generation succeeds without it."""
    engine.set_loras([A])
    hook = RaisingHook(engine, "unet", TO_Q)
    for i in range(1, MAX_ERRORS + 1):
        failing_generate(engine)
        a = counters(engine, "lora-a")
        assert a.runtime_errors == i and a.disabled == (i == MAX_ERRORS)
    assert a.message == f"disabled after {MAX_ERRORS} runtime errors; last: injected failure in the layer's forward"
    snap = engine.snapshot()
    assert snap.loras == ()
    assert weights_digest(engine.pipeline) == reference[()]
    assert engine.lora_stack._backups == {}
    hook.remove()
    images = engine.generate(GenerateParams("a cat", **FAST))
    assert len(images) == 1 and "lora-a" not in images[0].infotext
    snap = engine.snapshot()
    assert snap.history[-1].outcome == "ok" and snap.loras == ()
    assert counters(engine, "lora-a").disabled
    assert weights_digest(engine.pipeline) == reference[()]
    assert_placement_clean(engine)


def test_disabling_one_lora_keeps_the_others(engine, reference):
    """With A and B applied, disabling A (errors in A's layer) leaves exactly B fused: the weights
    equal a fresh fuse of B alone, and generation with B goes on."""
    engine.set_loras([A, B])
    hook = RaisingHook(engine, "unet", TO_Q)
    for _ in range(MAX_ERRORS):
        failing_generate(engine)
    hook.remove()
    assert counters(engine, "lora-a").disabled and not counters(engine, "lora-b").disabled
    assert engine.snapshot().loras == (B,)
    assert weights_digest(engine.pipeline) == reference[("lora-b",)]
    images = engine.generate(GenerateParams("a cat", **FAST))
    assert "lora-b" in images[0].infotext and "lora-a" not in images[0].infotext
    assert engine.snapshot().loras == (B,)


def test_set_loras_reenables_a_disabled_lora(engine, reference):
    """An explicit set_loras re-enables a disabled LoRA: counters reset (no errors, no message)
    and it is fused again exactly as a fresh fuse."""
    engine.set_loras([A])
    hook = RaisingHook(engine, "unet", TO_Q)
    for _ in range(MAX_ERRORS):
        failing_generate(engine)
    hook.remove()
    assert counters(engine, "lora-a").disabled
    snap = engine.set_loras([A])
    a = snap.lora_counters["lora-a"]
    assert (a.disabled, a.runtime_errors, a.message) == (False, 0, "")
    assert snap.loras == (A,)
    assert weights_digest(engine.pipeline) == reference[("lora-a",)]
    assert len(engine.generate(GenerateParams("a cat", **FAST))) == 1


def test_model_load_reenables_a_disabled_lora(engine, reference):
    """A model load also re-enables (the engine's documented rule): the desired list is applied
    again in full on the fresh model."""
    engine.set_loras([A])
    hook = RaisingHook(engine, "unet", TO_Q)
    for _ in range(MAX_ERRORS):
        failing_generate(engine)
    hook.remove()
    snap = engine.load_model(SD15, dtype="fp32")
    assert not snap.lora_counters["lora-a"].disabled and snap.loras == (A,)
    assert weights_digest(engine.pipeline) == reference[("lora-a",)]


def test_errors_below_the_limit_then_success_keep_the_lora(engine, reference):
    """Errors below the limit do not disable; a successful generation afterwards runs with the
    LoRA still fused exactly."""
    engine.set_loras([A])
    hook = RaisingHook(engine, "unet", TO_Q)
    for _ in range(MAX_ERRORS - 1):
        failing_generate(engine)
    hook.remove()
    images = engine.generate(GenerateParams("a cat", **FAST))
    assert "lora-a" in images[0].infotext
    assert not counters(engine, "lora-a").disabled
    assert weights_digest(engine.pipeline) == reference[("lora-a",)]
