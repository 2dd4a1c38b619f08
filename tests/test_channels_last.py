"""channels_last (`--channels-last`): UNet and VAE convolution weights rest and compute in NHWC.

What it protects (issue 19, item 5: 22.6% of an H100's CUDA time went to cuDNN converting
contiguous conv weights on every call): with the setting on, every 4-D weight of the UNet and the
VAE is channels_last after a load and stays so through every path that moves or rewrites weights
(LoRA fuse, re-weight and restore, every offload mode's moves and streamed copies, 8-bit storage, a
dtype change, the compiled path); text encoders are not touched; the fused bits, the restored bits
and the image are those of the contiguous layout; a weight made contiguous behind the engine's back
is a violation that the next transition repairs in place. All on the CPU, whose oneDNN
convolutions take channels_last too.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from tiny import CHECKPOINTS, FAST
from weight_digest import weights_digest

from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline
from app.engine import placement
from app.engine.generate import GenerateParams
from app.engine.offload import plan_for
from app.engine.worker import Engine
from app.settings import OFFLOAD_CHOICES, Settings
from launch import build_parser, settings_from_args

CL = torch.channels_last
PARAMS = GenerateParams("a cat", seed=7, **FAST)
LORAS = [LoraSpec("demo-detail-sd15", 0.7), LoraSpec("demo-style-sd15", 0.8)]  # resnet convs; attention + TE
CONV_COMPONENTS = ("unet", "vae")


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("channels-last")
    shutil.copytree(demo_dir / "models", folder / "models")
    return folder


def _engine(data, **overrides) -> Engine:
    return Engine(Settings(data_dir=data, device="cpu", **overrides))


@pytest.fixture
def cl(data):
    """A CPU engine with channels_last on, closed after the test."""
    eng = _engine(data, channels_last=True)
    yield eng
    eng.close()


def _four_d(pipe, components=CONV_COMPONENTS) -> dict[str, torch.Tensor]:
    """Every 4-D floating parameter or buffer of `components`, by dotted name."""
    return {f"{c}.{p}.{n}": t for c, p, _m, n, t, _is_param in placement.iter_tensors(pipe)
            if c in components and t.dim() == 4 and t.is_floating_point()}


def _not_channels_last(pipe) -> list[str]:
    return [name for name, t in _four_d(pipe).items() if not t.is_contiguous(memory_format=CL)]


def _strides(pipe, component: str) -> dict[str, tuple[int, ...]]:
    return {f"{p}.{n}": t.stride() for c, p, _m, n, t, _is_param in placement.iter_tensors(pipe) if c == component}


def _pixels(engine: Engine) -> np.ndarray:
    return np.asarray(engine.generate(PARAMS)[0].image).astype(np.int16)


def _clean(engine: Engine) -> bool:
    return all(h.outcome == "ok" and h.violations_found == 0 for h in engine.snapshot().history)


def test_the_flag_reaches_settings_and_is_off_by_default():
    parser = build_parser()
    assert settings_from_args(parser.parse_args([])).channels_last is False
    assert settings_from_args(parser.parse_args(["--channels-last"])).channels_last is True


@pytest.mark.parametrize(("family_name", "planned"), [("sd15", {"unet", "vae"}), ("flux-dev", {"vae"})])
def test_the_plan_gives_a_layout_to_conv_components_only(family_name, planned):
    """From the family's `conv_components`: UNet and VAE for SD, only the VAE for Flux (its
    transformer has no convolutions); never a text encoder. Without the setting no layout is planned."""
    pipe = build_tiny_pipeline(family_name)
    cpu = torch.device("cpu")
    for mode in OFFLOAD_CHOICES:
        plan = plan_for(pipe, torch.float32, cpu, mode, conv_format=CL)
        for name, comp in plan.components.items():
            want = CL if name in planned else None
            assert (comp.rest.memory_format, comp.compute.memory_format) == (want, want), (family_name, mode, name)
        off = plan_for(pipe, torch.float32, cpu, mode)
        assert {c.rest.memory_format for c in off.components.values()} == {None}


def test_load_puts_conv_weights_channels_last_and_leaves_text_encoders_alone(data, cl):
    """After a load every 4-D UNet/VAE weight is channels_last (3×3 kernels really restrided), the
    values are the checkpoint's, and the text encoders' strides equal a default engine's."""
    plain = _engine(data)
    try:
        plain.load_model(CHECKPOINTS["sd15"])
        cl.load_model(CHECKPOINTS["sd15"])
        assert _four_d(cl.pipeline) and _not_channels_last(cl.pipeline) == []
        assert any(not t.is_contiguous() for t in _four_d(cl.pipeline).values())
        assert all(t.is_contiguous() for t in _four_d(plain.pipeline).values())  # off: nothing changes
        assert _strides(cl.pipeline, "text_encoder") == _strides(plain.pipeline, "text_encoder")
        assert weights_digest(cl.pipeline) == weights_digest(plain.pipeline)
        assert placement.verify(cl.pipeline, cl.placement_plan) == [] and _clean(cl)
    finally:
        plain.close()


def test_image_fused_bits_and_restore_equal_the_contiguous_layout(data, cl):
    """Same seed, same image within 1 grey level (oneDNN's NHWC kernels may sum in another order;
    on this CPU they agree exactly or nearly). Fused LoRA weights are bit-identical to the contiguous
    engine's (the patcher's float32 accumulator is contiguous whatever the weight's layout), and
    removing the LoRAs restores the checkpoint bit for bit."""
    plain = _engine(data)
    try:
        for eng in (plain, cl):
            eng.load_model(CHECKPOINTS["sd15"])
        fresh = weights_digest(plain.pipeline)
        assert np.abs(_pixels(cl) - _pixels(plain)).max() <= 1
        for eng in (plain, cl):
            eng.set_loras(LORAS)
        assert weights_digest(cl.pipeline) == weights_digest(plain.pipeline) != fresh
        assert np.abs(_pixels(cl) - _pixels(plain)).max() <= 1
        cl.set_loras([])
        assert weights_digest(cl.pipeline) == fresh and _not_channels_last(cl.pipeline) == []
        assert _clean(cl)
    finally:
        plain.close()


def _watch_conv(engine: Engine) -> list[tuple]:
    """Record (layout ok, device, dtype) of a 3×3 UNet conv's weight as its forward sees it: after
    any offload streaming or 8-bit widening, which run as pre-hooks before `_conv_forward`."""
    conv = engine.pipeline.unet.down_blocks[0].resnets[0].conv1
    seen: list[tuple] = []
    original = conv._conv_forward

    def recording(x, weight, bias):
        seen.append((weight.is_contiguous(memory_format=CL), weight.device.type, weight.dtype))
        return original(x, weight, bias)

    conv._conv_forward = recording
    return seen


@pytest.mark.parametrize("rest_dtype", [None, "fp32"])
def test_layout_survives_loras_every_offload_mode_and_a_dtype_change(data, rest_dtype):
    """Add, re-weight, remove LoRAs and switch through every offload mode with a generation in each;
    with fp32 rest and bf16 compute every mode really moves and casts (streamed copies included).
    The conv weight the forward sees is channels_last in every mode, every weight at rest is after
    every command, no transition finds a violation, and a dtype change (a reload) keeps the layout."""
    eng = _engine(data, channels_last=True, dtype="bf16", rest_dtype=rest_dtype)
    try:
        eng.load_model(CHECKPOINTS["sd15"])
        fresh = weights_digest(eng.pipeline)
        seen = _watch_conv(eng)
        for specs in (LORAS[:1], LORAS, [LoraSpec("demo-detail-sd15", 1.3), LORAS[1]]):
            eng.set_loras(specs)
            assert _not_channels_last(eng.pipeline) == []
        for mode in (*OFFLOAD_CHOICES, "none"):
            assert eng.set_offload(mode).offload == mode
            eng.generate(PARAMS)
            assert _not_channels_last(eng.pipeline) == [], mode
            assert seen and all(ok for ok, _dev, _dt in seen), mode
            assert {dt for _ok, _dev, dt in seen} == {torch.bfloat16}, mode
            seen.clear()
        eng.set_loras([])
        assert weights_digest(eng.pipeline) == fresh
        eng.set_dtype("fp32")
        assert {t.dtype for t in _four_d(eng.pipeline).values()} == {torch.float32}
        assert _not_channels_last(eng.pipeline) == [] and _clean(eng)
    finally:
        eng.close()


def test_fp8_stored_conv_weights_rest_and_widen_channels_last(data):
    """8-bit stored conv weights are channels_last too (the plan's layout covers them), so the
    widened copy each forward gets is channels_last; verify agrees and a LoRA bypass leaves them."""
    eng = _engine(data, channels_last=True, dtype="bf16", weights="fp8")
    try:
        eng.load_model(CHECKPOINTS["sd15"])
        conv = eng.pipeline.unet.down_blocks[0].resnets[0].conv1
        assert conv.weight.dtype == placement.STORAGE_DTYPES["fp8"]
        seen = _watch_conv(eng)
        eng.set_loras(LORAS)
        eng.generate(PARAMS)
        assert seen == [(True, "cpu", torch.bfloat16)] * len(seen) and seen
        assert _not_channels_last(eng.pipeline) == [] and _clean(eng)
    finally:
        eng.close()


def test_compiled_path_keeps_the_layout(data):
    """Enabling the compiled UNet (dynamo's eager backend on the CPU) moves nothing: weights stay
    channels_last through a compiled generation and a LoRA change under it."""
    eng = _engine(data, channels_last=True, compile=True, compile_backend="eager")
    try:
        eng.load_model(CHECKPOINTS["sd15"])
        eng.generate(PARAMS)
        eng.set_loras(LORAS[:1])
        eng.generate(PARAMS)
        assert eng.snapshot().compile.phase == "compiled"
        assert _not_channels_last(eng.pipeline) == [] and _clean(eng)
    finally:
        eng.close()


def test_a_weight_made_contiguous_behind_the_engines_back_is_repaired_in_place(cl):
    cl.load_model(CHECKPOINTS["sd15"])
    weight = cl.pipeline.unet.down_blocks[0].resnets[0].conv1.weight
    before = weight.detach().clone()
    weight.data = weight.data.contiguous()  # what a careless write-back (`.data = new tensor`) does
    snap = cl.set_offload("none")
    row = snap.history[-1]
    assert (row.violations_found, row.violations_repaired) == (1, 1)
    assert "channels_last" in str(snap.violations[0]) and "contiguous" in str(snap.violations[0])
    assert cl.pipeline.unet.down_blocks[0].resnets[0].conv1.weight is weight  # same Parameter object
    assert weight.is_contiguous(memory_format=CL) and torch.equal(weight, before)
