"""Out-of-memory recovery, proven on the CPU (issue 14, finding 8).

A GPU running out of memory raises `torch.OutOfMemoryError` from whatever allocates: a layer's
forward, a LoRA's delta math, a component's move, a model's construction. Each test injects that
error at one of those places through the engine's public API and then checks the promise:
the engine is READY, the model, offload mode and LoRAs are what they were, every stored weight
is bit-identical, every tensor is where the plan says, and the next generation works.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from weight_digest import weights_digest

from app.adapters.algos.lora import LoRA
from app.adapters.specs import LoraSpec
from app.engine import offload, placement
from app.engine.generate import GenerateParams
from app.engine.worker import Engine, EngineState
from app.families import family

FAST = dict(tiny.FAST, seed=11)
SD15, SDXL = tiny.CHECKPOINTS["sd15"], tiny.CHECKPOINTS["sdxl"]
A, B = LoraSpec("demo-style-sd15", 0.8), LoraSpec("demo-detail-sd15", 0.6)  # the demo LoRAs
OOM = "CUDA out of memory. Tried to allocate 20.00 GiB (injected by the test)"


@pytest.fixture
def engine(engine):
    """The shared CPU engine with tiny SD1.5 in fp32 and LoRA A applied."""
    engine.load_model(SD15, dtype="fp32")
    engine.set_loras([A])
    return engine


def _raise_oom(*_args, **_kwargs):
    raise torch.OutOfMemoryError(OOM)


def _once(real):
    """`real`, except that its first call raises the OOM (a transient failure: the rollback may retry)."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            _raise_oom()
        return real(*args, **kwargs)

    return wrapper


def assert_recovered(engine: Engine, digest: str, mode: str, loras: tuple[LoraSpec, ...]) -> None:
    """READY, same model/offload/LoRAs, weights bit-identical, placement clean, next generation works."""
    snap = engine.snapshot()
    assert snap.state == EngineState.READY.value, snap.last_error
    assert (snap.model, snap.offload, snap.loras) == (SD15, mode, loras)
    assert weights_digest(engine.pipeline) == digest
    plan = offload.plan_for(engine.pipeline, placement.DTYPES[snap.dtype], engine.device, snap.offload)
    assert placement.verify(engine.pipeline, plan) == []
    images = engine.generate(GenerateParams("a lighthouse", **FAST))
    assert len(images) == 1 and images[0].image.size == (64, 64)
    assert weights_digest(engine.pipeline) == digest


@pytest.mark.parametrize("offload", ["none", "sequential"])
def test_oom_inside_a_forward(engine, offload):
    """An OOM raised by a UNet layer mid-denoise fails that generation only; with LoRA A applied
    (fused under `none`, on the fly under `sequential`) no weight is left changed."""
    engine.set_offload(offload)
    digest = weights_digest(engine.pipeline)
    handle = engine.pipeline.unet.mid_block.register_forward_pre_hook(_raise_oom)
    try:
        with pytest.raises(MemoryError, match="out of GPU memory"):
            engine.generate(GenerateParams("a cat", **FAST))
    finally:
        handle.remove()
    assert_recovered(engine, digest, offload, (A,))


def test_oom_inside_a_lora_patch(engine, monkeypatch):
    """An OOM in the delta math while adding LoRA B leaves the previous list (A) fused exactly."""
    digest = weights_digest(engine.pipeline)
    monkeypatch.setattr(LoRA, "accumulate", _once(LoRA.accumulate))
    with pytest.raises(Exception, match="out of memory"):
        engine.set_loras([A, B])
    monkeypatch.undo()
    assert_recovered(engine, digest, "none", (A,))


def test_oom_inside_a_bypass_lora_forward(engine, monkeypatch):
    """Under `sequential` the LoRA math runs in each patched layer's forward (a bypass): an OOM
    there fails the generation, every streamed weight goes back, and the stored weights are
    unchanged."""
    engine.set_offload("sequential")
    digest = weights_digest(engine.pipeline)
    monkeypatch.setattr(LoRA, "bypass_forward", _raise_oom)
    with pytest.raises(MemoryError, match="out of GPU memory"):
        engine.generate(GenerateParams("a cat", **FAST))
    monkeypatch.undo()
    assert_recovered(engine, digest, "sequential", (A,))


def test_oom_in_lora_math_is_reported_as_memory_not_counted_against_the_lora(engine, monkeypatch):
    """Running out of memory is the GPU's state, not the LoRA's fault: it is reported as out of
    memory and never counts toward disabling the LoRA."""
    engine.set_offload("sequential")
    monkeypatch.setattr(LoRA, "bypass_forward", _raise_oom)
    with pytest.raises(MemoryError, match="out of GPU memory"):
        engine.generate(GenerateParams("a cat", **FAST))
    assert engine.snapshot().lora_counters[A.name].runtime_errors == 0


@pytest.mark.parametrize("target", ["model", "balanced", "sequential", "group"])
def test_oom_inside_a_move(engine, monkeypatch, target):
    """An OOM while moving a component for an offload switch leaves the previous mode in place."""
    digest = weights_digest(engine.pipeline)
    monkeypatch.setattr(placement, "move_component", _once(placement.move_component))
    with pytest.raises(Exception, match="out of memory"):
        engine.set_offload(target)
    monkeypatch.undo()
    assert_recovered(engine, digest, "none", (A,))


@pytest.mark.parametrize("where", ["building", "placing"])
def test_oom_inside_a_load(engine, monkeypatch, where):
    """An OOM while building the SDXL pipeline, or while placing it, keeps SD1.5 with LoRA A loaded."""
    digest = weights_digest(engine.pipeline)
    if where == "building":
        monkeypatch.setattr(family("sdxl").pipeline_class, "from_single_file", _raise_oom)
    else:
        monkeypatch.setattr(placement, "move_component", _once(placement.move_component))
    with pytest.raises(Exception, match="out of memory"):
        engine.load_model(SDXL)
    monkeypatch.undo()
    assert_recovered(engine, digest, "none", (A,))
