"""The moving code, run on a CPU-only machine: weights rest in fp32 and compute in bf16.

On the CPU the rest and compute devices coincide, so without this every offload move would be a
no-op and `move_component`, `stream_in`/`stream_out`, `sync` and the strategies' bookkeeping
would only run on a GPU box. With `Settings(rest_dtype="fp32")` dtype is the second axis: each
onload really casts to bf16 and each offload really goes back. What it protects: every mode
draws the same image (they all compute in bf16 from the same activations), every tensor is back
at rest, bit for bit, after each generation (onload and offload are symmetric), Parameters keep
their identity, a tensor left in the compute dtype is repaired by the next transition, and a
LoRA under a resting dtype is a bypass (never fused into the fp32 copies).
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny import CHECKPOINTS, FAST

from app.adapters.specs import LoraSpec
from app.adapters.synthetic import adapter_state_digests
from app.engine import placement
from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.settings import Settings

MOVING = ("model", "balanced", "sequential", "group")
PARAMS = GenerateParams("a cat", seed=9, **FAST)


@pytest.fixture(scope="module")
def engines(demo_dir, tmp_path_factory):
    """(reference engine computing in bf16 with nothing offloaded, engine resting in fp32)."""
    import shutil

    data = tmp_path_factory.mktemp("moves")
    shutil.copytree(demo_dir / "models", data / "models")
    reference = Engine(Settings(data_dir=data, device="cpu", dtype="bf16"))
    axis = Engine(Settings(data_dir=data, device="cpu", dtype="bf16", rest_dtype="fp32"))
    yield reference, axis
    reference.close()
    axis.close()


class Spy:
    """Counts calls of the placement functions that move tensors (and still calls them); for
    `stream_in` and `stream_out`, the tensors each streamed (a group copied ahead is topped up by a
    second `stream_in`, so calls need not pair up, tensors must)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = {"move_component": 0, "stream_in": 0, "stream_out": 0, "sync": 0}
        for name in self.calls:
            original = getattr(placement, name)
            monkeypatch.setattr(placement, name, self._counting(name, original))

    def _counting(self, name, original):
        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            self.calls[name] += len(result) if name == "stream_in" else len(args[1]) if name == "stream_out" else 1
            return result
        return wrapped


def _params(engine) -> dict[str, int]:
    return {f"{c}.{p}.{n}": id(t) for c, p, _m, n, t, is_param in placement.iter_tensors(engine.pipeline) if is_param}


@pytest.mark.parametrize("model", [CHECKPOINTS["sd15"], CHECKPOINTS["sdxl"]])
def test_every_moving_mode_casts_in_and_back_out_exactly(engines, model, monkeypatch):
    """Each moving mode: the generation's tensors really moved (spied calls), the modes draw the
    same image (streamed ones within two grey levels on average), close to the one computed with nothing
    offloaded, and afterwards every tensor is fp32 at rest with the bf16 checkpoint's values bit
    for bit and the same Parameter objects."""
    reference, engine = engines
    reference.load_model(model)
    engine.load_model(model)
    plain = np.asarray(reference.generate(PARAMS)[0].image, dtype=np.int16)
    checkpoint = {k: v.float() for k, v in reference.pipeline.unet.state_dict().items()}
    images = {}
    for mode in MOVING:
        engine.set_offload(mode)
        ids, spy = _params(engine), Spy(monkeypatch)
        images[mode] = np.asarray(engine.generate(PARAMS)[0].image, dtype=np.int16)
        moved = spy.calls["move_component"] if mode in ("model", "balanced") else spy.calls["stream_in"]
        assert moved > 0 and spy.calls["stream_in"] == spy.calls["stream_out"], (mode, spy.calls)
        snap, plan = engine.snapshot(), engine.placement_plan
        assert snap.violations == () and snap.history[-1].outcome == "ok", mode
        assert placement.verify(engine.pipeline, plan) == [], mode
        # balanced keeps components resident (in bf16) while they fit; the others rest in fp32
        assert all(plan.expected(c).dtype == placement.DTYPES["fp32"] for c in plan.components
                   if c not in plan.resident), mode
        assert _params(engine) == ids, f"{mode}: a Parameter was replaced"
        if "unet" not in engine.placement_plan.resident:
            state = engine.pipeline.unet.state_dict()
            assert all(state[k].equal(v) for k, v in checkpoint.items()), f"{mode}: UNet not back bit for bit"
    # Whole-component casts compute identically; streamed modes leave a module's neighbours at
    # rest in fp32 while it runs, so code that reads a component's dtype (`self.dtype`) sees fp32
    # and a few intermediates run wider: the same image to within two grey levels on average.
    assert np.array_equal(images["balanced"], images["model"])
    for mode in ("sequential", "group"):
        assert np.abs(images[mode] - images["model"]).mean() < 2.0, mode
    assert np.abs(images["model"] - plain).mean() < 2.0


def test_a_tensor_left_in_the_compute_dtype_is_repaired_by_the_next_transition(engines):
    """A weight found in bf16 while its component rests in fp32 is a violation: the next
    transition finds it, casts it back (exactly: bf16 values fit fp32) and records both."""
    _reference, engine = engines
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_offload("model")
    conv = engine.pipeline.unet.conv_in
    before = conv.weight.detach().clone()
    conv.weight.data = conv.weight.data.to(placement.DTYPES["bf16"])
    snap = engine.set_offload("model")
    row = snap.history[-1]
    assert (row.outcome, row.violations_found, row.violations_repaired) == ("ok", 1, 1)
    assert conv.weight.dtype == before.dtype and conv.weight.equal(before)


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_a_lora_on_weights_resting_in_another_dtype_is_a_bypass(engines, mode):
    """Fusing into the fp32 resting copies would round differently from the bf16 compute copies,
    so LoRAs are bypass forwards there: stored weights stay the checkpoint's, the snapshot says
    bypass, and the image matches the fused bf16 reference within a grey level or two."""
    reference, engine = engines
    lora = [LoraSpec("demo-style-sd15", 0.9)]
    reference.load_model(CHECKPOINTS["sd15"])
    reference.set_loras(lora)
    fused = np.asarray(reference.generate(PARAMS)[0].image, dtype=np.int16)
    reference.set_loras([])
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_offload(mode)
    stored = adapter_state_digests(engine.pipeline)
    snap = engine.set_loras(lora)
    assert snap.lora_mode == "bypass" and engine.lora_stack._backups == {}
    image = np.asarray(engine.generate(PARAMS)[0].image, dtype=np.int16)
    assert adapter_state_digests(engine.pipeline) == stored
    assert np.abs(image - fused).mean() < 2.0
    engine.set_loras([])
