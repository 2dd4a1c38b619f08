"""Step-scheduled LoRA strength (`<lora:name:1@0,0@0.3>`, the loractl syntax): parsing, the weights each
denoising step runs with, the image, and the model after the job.

The weights are recorded by a forward pre-hook on the denoiser, i.e. as each step really ran them, and
checked in float64 against W0 + s(step)·ΔW, where ΔW = W(strength 1) − W0 comes from the ordinary
constant-strength fuse (whose own oracle tests compare it with the file's factors).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import CHECKPOINTS
from weight_digest import weights_digest

from app.adapters.prompt import parse_prompt_loras
from app.adapters.specs import LoraSpec
from app.adapters.strength_schedule import StrengthSchedule, parse_schedule
from app.engine.generate import GenerateParams
from app.infotext import parse_infotext

STEPS = 5
SCHEDULE = "1@0,0@0.5"  # over 5 steps: fractions 0, .25, .5, .75, 1 -> strengths 1, .5, 0, 0, 0
EXPECTED = (1.0, 0.5, 0.0, 0.0, 0.0)
FAMILIES = {"sd15": "unet", "flux-dev": "transformer"}  # a UNet family and a DiT one: denoiser component


# ------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(("tag", "te", "strengths"), [
    ("<lora:a:1@0,0@0.5>", 1.0, EXPECTED),  # one field: both, the text encoder at s(0)
    ("<lora:a:0.3:0@0;1@1>", 0.3, (0.0, 0.25, 0.5, 0.75, 1.0)),  # te then unet; semicolons as loractl takes
    ("<lora:a:te=0.7:unet=0@1,1@3>", 0.7, (0.0, 0.0, 0.5, 1.0, 1.0)),  # named; positions > 1 are step numbers
    ("<lora:a:0.5@0.5,1@0>", 1.0, (1.0, 0.75, 0.5, 0.5, 0.5)),  # any order; held after the last point
])
def test_schedule_tags_parse_to_strength_by_step(tag, te, strengths):
    """The loractl syntax reads as A1111 users type it: fractions of the pass (or step numbers past 1), linear
    in between, held outside; the text encoder gets the step-0 strength; the tag is kept as typed."""
    (spec,) = parse_prompt_loras(f"a cat {tag}")[1]
    assert spec.te_strength == te
    assert spec.schedule.strengths(STEPS) == pytest.approx(strengths)
    assert spec.unet_strength == strengths[0]
    assert spec.schedule_text in tag


def test_constant_schedule_is_a_plain_strength_and_schedules_compare_by_points():
    """A schedule that never changes is the plain strength (nothing to do between steps); two spellings of one
    schedule are the same `LoraSpec` (Desired compares them), the typed text kept apart."""
    assert parse_prompt_loras("<lora:a:0.4@0,0.4@1>")[1] == (LoraSpec("a", 0.4),)
    one, two = parse_schedule("1@0,0@0.3", "a", "x"), parse_schedule(" 1@0 ; 0@0.30 ", "a", "x")
    assert one == two and hash(one) == hash(two) and one.text != two.text
    assert isinstance(one, StrengthSchedule) and one.strengths(1) == (1.0,)


@pytest.mark.parametrize(("tag", "says"), [
    ("<lora:a:1@0,0>", "'0' has no @step"),
    ("<lora:a:1@x>", "not a number@number"),
    ("<lora:a:1@0,0@0>", "same position"),
    ("<lora:a:1@-2,0@1>", "≥ 0"),
    ("<lora:a:500@0,0@1>", "beyond ±100"),
    ("<lora:a:1:hr=0@0,1@1>", "'hr'= is not a LoRA field"),
])
def test_malformed_schedules_are_refused_naming_the_tag(tag, says):
    """A malformed schedule is one ValueError naming the tag and what is wrong, never a silent strength."""
    with pytest.raises(ValueError) as caught:
        parse_prompt_loras(f"a cat {tag}")
    assert tag in str(caught.value) and says in str(caught.value)


def test_the_json_api_takes_a_schedule_field_for_the_unet_weight():
    """Scripts' `set_loras`/`generate` JSON: `"schedule"` stands for the UNet weight (a constant one is the plain
    weight), `te_weight` stays; a malformed or non-string schedule is refused naming the LoRA."""
    from app.ui.common import specs_from_json

    ramp, flat = specs_from_json([{"name": "a", "weight": 0.5, "schedule": "1@0,0@1"},
                                  {"name": "b", "te_weight": 0.2, "schedule": "0.7@0,0.7@1"}])
    assert (ramp.unet_strength, ramp.te_strength, ramp.schedule.strengths(3)) == (1.0, 0.5, (1.0, 0.5, 0.0))
    assert (flat.unet_strength, flat.te_strength, flat.schedule) == (0.7, 0.2, None)
    for bad, says in (("1@0,0", "LoRA 'a' schedule: '1@0,0'"), (3, "must be a string")):
        with pytest.raises(ValueError, match=says):
            specs_from_json([{"name": "a", "schedule": bad}])


def test_a_forced_schedule_beyond_the_strength_cap_is_refused_before_queueing(tmp_path):
    """A spec built by hand (scripts, the JSON API) with a schedule point past ±100 is refused by the library's
    check like a plain strength would be, naming the LoRA: it would overflow the fused weights mid-job."""
    from app.adapters.files import LoraLibrary

    forced = LoraSpec("a", 1.0, schedule=StrengthSchedule(((0.0, 1.0), (1.0, -1e30))))
    with pytest.raises(ValueError, match="'a': scheduled UNet strength"):
        LoraLibrary(tmp_path).validate_specs([forced])


# -------------------------------------------------------------------------------------------- engine
def _denoiser_targets(engine, component: str):
    return [(c, p) for (c, p) in engine.lora_stack.patched_modules() if c == component]


def _weights(engine, targets) -> dict:
    pipe = engine.pipeline
    return {t: getattr(pipe, t[0]).get_submodule(t[1]).weight.detach().to(torch.float64).clone() for t in targets}


def _record_steps(engine, component: str, targets, runs: list, name: str) -> torch.utils.hooks.RemovableHandle:
    """Every denoiser forward (one per step here) records the touched layers' weights as it runs them, and under
    "hook" the strength of LoRA `name` in the first layer's bypass hook (None where the LoRA is fused)."""
    def record(_module, _args):
        seen, bypassed = _weights(engine, targets), engine.lora_stack.bypassed()
        seen["hook"] = dict((c[0], c[1]) for c in bypassed[targets[0]])[name] if bypassed else None
        runs.append(seen)

    return getattr(engine.pipeline, component).register_forward_pre_hook(record)


@pytest.mark.parametrize("family_name", list(FAMILIES))
def test_scheduled_weights_are_w0_plus_s_delta_at_every_step_and_exact_after(module_engine, family_name):
    """A panel LoRA with a schedule: before each step the denoiser's layers hold W0 + s(step)·ΔW (float64, to a
    few float32 ulps), the text encoder and a constant LoRA's layers keep theirs, the re-weight runs only when s
    changes, and after the job every parameter of the pipeline is bit for bit the resting state."""
    _check_scheduled_steps(module_engine, family_name)


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["none", "model", "sequential"])
def test_scheduled_weights_on_gpu_in_fp16(gpu_data_dir, offload):
    """The same on CUDA in fp16 (fused from GPU backups, fused under model offload, bypass under sequential):
    W0 + s(step)·ΔW to a few fp16 ulps at every step, every parameter bit for bit at rest after the job."""
    from app.engine.worker import Engine
    from app.settings import Settings

    engine = Engine(Settings(data_dir=gpu_data_dir, device="cuda", offload=offload))
    try:
        _check_scheduled_steps(engine, "sd15", dtype="fp16")
    finally:
        engine.close()


def _check_scheduled_steps(engine, family_name: str, dtype: str | None = None) -> None:
    """`test_scheduled_weights_are_w0_plus_s_delta_at_every_step_and_exact_after` on `engine`; in a bypass mode
    the stored weights never change and the strength in effect is the hook's."""
    component = FAMILIES[family_name]
    style, detail = f"demo-style-{family_name}", f"demo-detail-{family_name}"
    engine.load_model(CHECKPOINTS[family_name], dtype=dtype)
    engine.set_loras([LoraSpec(detail, 0.5)])
    base = engine.lora_stack.patched_modules()
    engine.set_loras([LoraSpec(style, 1.0), LoraSpec(detail, 0.5)])
    targets = [t for t in _denoiser_targets(engine, component) if t not in base]
    w1 = _weights(engine, targets)
    engine.set_loras([LoraSpec(style, 0.0), LoraSpec(detail, 0.5)])
    w0 = _weights(engine, targets)
    (spec,) = parse_prompt_loras(f"<lora:{style}:{SCHEDULE}>")[1]
    engine.set_loras([spec, LoraSpec(detail, 0.5)])
    resting, bypassed = weights_digest(engine.pipeline), engine.lora_stack.bypassed()
    runs: list = []
    handle = _record_steps(engine, component, targets, runs, style)
    try:
        engine.generate(GenerateParams("a cat", seed=1, steps=STEPS, width=64, height=64, cfg=5.0, sampler="Euler"))
    finally:
        handle.remove()
    assert len(runs) == STEPS and targets
    eps = torch.finfo(getattr(engine.pipeline, component).get_submodule(targets[0][1]).weight.dtype).eps
    for step, (recorded, s) in enumerate(zip(runs, EXPECTED, strict=True)):
        if bypassed:  # the stored weights stay W0; the hook adds s·Δ(x)
            assert all(torch.equal(recorded[t], w0[t]) for t in targets) and recorded["hook"] == s, step
            continue
        for t in targets:
            want = w0[t] + s * (w1[t] - w0[t])
            scale = max(w0[t].abs().max().item(), w1[t].abs().max().item())
            error = (recorded[t] - want).abs().max().item()
            assert error <= 4 * eps * scale, (step, t, error)
    assert weights_digest(engine.pipeline) == resting
    engine.set_loras([])


def test_scheduled_image_differs_from_constant_and_the_model_is_exact_after(module_engine):
    """A prompt-tag schedule changes the image against the constant strength it starts at, a constant
    "schedule" does not, and after the job the model is bit for bit as before it (the tag's LoRA gone again);
    the infotext keeps the schedule as typed and reads back to the same spec."""
    engine = module_engine
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([])
    before = weights_digest(engine.pipeline)
    params = dict(seed=2, steps=STEPS, width=64, height=64, cfg=5.0, sampler="Euler")
    style = "demo-style-sd15"

    def image(tag: str):
        (out,) = engine.generate(GenerateParams(f"a cat {tag}", **params))
        assert weights_digest(engine.pipeline) == before
        return out

    constant, flat = image(f"<lora:{style}:1>"), image(f"<lora:{style}:1@0,1@1>")
    scheduled = image(f"<lora:{style}:{SCHEDULE}>")
    assert np.array_equal(np.asarray(constant.image), np.asarray(flat.image))
    assert not np.array_equal(np.asarray(constant.image), np.asarray(scheduled.image))
    assert f"<lora:{style}:{SCHEDULE}>" in scheduled.infotext.splitlines()[0]
    (spec,) = parse_infotext(scheduled.infotext).loras
    assert spec == parse_prompt_loras(f"<lora:{style}:{SCHEDULE}>")[1][0]


@pytest.mark.parametrize("offload", ["none", "sequential"])
def test_hires_pass_restarts_the_schedule_and_an_interrupt_leaves_the_model_exact(module_engine, offload):
    """Fused (offload none) and bypass (sequential streams the UNet): the hires pass runs the schedule again over
    its own steps (read back per UNet forward as the strength in effect), after the job the tag's LoRA is gone
    bit for bit, and a panel LoRA's job interrupted mid-schedule leaves every parameter at its resting state."""
    from app.engine.stage_params import HiresParams

    engine, style = module_engine, "demo-style-sd15"
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_offload(offload)
    try:
        strength_now = _strength_reader(engine, style, bypassed=offload == "sequential")
        before = weights_digest(engine.pipeline)
        seen: list[float] = []
        handle = engine.pipeline.unet.register_forward_pre_hook(lambda _m, _a: seen.append(strength_now()))
        try:
            engine.generate(GenerateParams(f"a cat <lora:{style}:{SCHEDULE}>", seed=4, steps=STEPS, width=64,
                                           height=64, cfg=5.0, sampler="Euler"),
                            hires=HiresParams(scale=1.5, steps=4, denoising_strength=0.75))
            assert weights_digest(engine.pipeline) == before
            schedule = parse_schedule(SCHEDULE, style, "test")
            assert seen == pytest.approx(schedule.strengths(STEPS) + schedule.strengths(3), abs=1e-5)
            handle.remove()
            engine.set_loras(parse_prompt_loras(f"<lora:{style}:{SCHEDULE}>")[1])  # the panel's: it stays on
            resting, seen[:] = weights_digest(engine.pipeline), []
            handle = engine.pipeline.unet.register_forward_pre_hook(
                lambda _m, _a: seen.append(len(seen) == 2 and engine.interrupt()))
            engine.generate(GenerateParams("a cat", seed=4, steps=STEPS, width=64, height=64, cfg=5.0,
                                           sampler="Euler"))
            assert len(seen) < STEPS  # the interrupt landed mid-schedule
            assert weights_digest(engine.pipeline) == resting
        finally:
            handle.remove()
    finally:
        engine.set_loras([])
        engine.set_offload("none")


def _strength_reader(engine, name: str, *, bypassed: bool):
    """A function reading the strength of LoRA `name` in effect on one UNet layer now: the bypass hook's, or the
    fused weight's projection on its ΔW (W − W0 against W(1) − W0, float64)."""
    engine.set_loras([LoraSpec(name, 1.0)])
    (target, *_rest) = _denoiser_targets(engine, "unet")
    assert bool(engine.lora_stack.bypassed()) == bypassed
    if bypassed:
        engine.set_loras([])
        return lambda: dict((c[0], c[1]) for c in engine.lora_stack.bypassed()[target])[name]
    w1 = _weights(engine, [target])[target]
    engine.set_loras([])
    w0 = _weights(engine, [target])[target]
    delta = w1 - w0
    return lambda: float(((_weights(engine, [target])[target] - w0) * delta).sum() / (delta * delta).sum())


# ----------------------------------------------------------------------------------- the stack's paths
ATTENTION = ("unet.*attn[12].to_[qkv]", "text_encoder.*self_attn.q_proj")


@pytest.fixture(scope="module")
def stack_files(tmp_path_factory):
    """A tiny fp32 SD1.5 pipeline and, on the same attention layers, a scheduled DoRA (its ΔW reads W0) and a
    constant plain LoRA."""
    from app.adapters.files import read_adapter
    from app.adapters.synthetic import write_adapter
    from app.demo import build_tiny_pipeline

    pipe, folder = build_tiny_pipeline("sd15"), tmp_path_factory.mktemp("sched")
    files = {}
    for name, algo, seed in (("ramp", "dora", 1), ("steady", "lora", 2)):
        written = write_adapter(folder / f"{name}.safetensors", pipe, "sd15", algo, "kohya", torch.float32,
                                targets=ATTENTION, seed=seed, alpha=2.0)
        files[name] = read_adapter(name, written.path)
    return pipe, files


@pytest.mark.parametrize("path", ["cached", "recomputed", "bypass"])
def test_stack_steps_every_path_to_w0_plus_s_delta_and_back_exactly(stack_files, path):
    """The three ways a step's strength reaches the layers: the cached float32 parts (B + s·ΔW), the per-step
    recompute from backups when the cache does not fit, and the bypass hook's strength (stored weights never
    written). Each step equals W0 + c·ΔW_const + s(step)·ΔW_sched (float64), text encoders stay at s(0), the
    rewrite happens only when s changes, and `close` leaves every tensor bit for bit at rest."""
    from app.adapters.patcher import LoraStack

    pipe, files = stack_files
    pristine = weights_digest(pipe)
    bypass = frozenset({"unet"}) if path == "bypass" else frozenset()
    probe = LoraStack(pipe, "sd15")  # ΔW of each LoRA alone at strength 1 (the constant-strength fuse)
    targets = [t for t in probe.prepare("ramp", files["ramp"], upload=False).layers if t[0] == "unet"]
    deltas = {}
    for name in files:
        probe.reconcile([LoraSpec(name, 1.0)], files)
        deltas[name] = _weights_of(pipe, targets)
        probe.reconcile([], files)
    w0 = _weights_of(pipe, targets)
    assert weights_digest(pipe) == pristine
    schedule = parse_schedule("0@0,2@0.5,2@0.75,-1@1", "ramp", "test")  # 0, 1, 2, 2, -1 over 5 steps
    stack = LoraStack(pipe, "sd15", bypass=bypass)
    stack.reconcile([LoraSpec("ramp", 0.3, te_weight=0.3, schedule=schedule), LoraSpec("steady", 0.5)], files)
    if path == "recomputed":
        stack._step_cache_room = lambda: 0
    resting = weights_digest(pipe)
    encoder = [t for t in stack.patched_modules() if t[0] == "text_encoder"]
    encoder_at_rest = _weights_of(pipe, encoder)
    stepper = stack.stepping(STEPS)
    for step, s in enumerate((0.0, 1.0, 2.0, 2.0, -1.0)):
        stepper.before_step(step)
        assert all(torch.equal(w, encoder_at_rest[t]) for t, w in _weights_of(pipe, encoder).items())
        if path == "bypass":
            assert {c[0]: c[1] for c in stack.bypassed()[targets[0]]} == {"ramp": s, "steady": 0.5}
            assert weights_digest(pipe) == resting
            continue
        got = _weights_of(pipe, targets)
        for t in targets:
            want = w0[t] + 0.5 * (deltas["steady"][t] - w0[t]) + s * (deltas["ramp"][t] - w0[t])
            assert (got[t] - want).abs().max() <= 8 * torch.finfo(torch.float32).eps * w0[t].abs().max(), (step, t)
    assert stepper.changes == 3 and (stepper.cached_bytes > 0) == (path == "cached")
    stepper.close()
    assert weights_digest(pipe) == resting
    stack.reconcile([], files)
    assert weights_digest(pipe) == pristine


def _weights_of(pipe, targets) -> dict:
    return {t: getattr(pipe, t[0]).get_submodule(t[1]).weight.detach().to(torch.float64).clone() for t in targets}
