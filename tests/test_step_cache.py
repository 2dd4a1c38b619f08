"""Step caching (issue 41, item 4): a first-block cache as the `cache.step` hook of the registry
(`app/engine/step_cache.py`), opt-in per generation by its threshold.

What it protects: threshold 0 installs nothing and a threshold no change is under draws the uncached
latents bit for bit; a threshold skips whole denoiser passes (the later blocks really do not run, counted)
and the image stays within a stated PSNR of the uncached one, on SD1.5 and a DiT; the calls of one step
(FLUX.2 Klein base: conditional and unconditional as two calls) keep their own caches; a step-distilled
checkpoint refuses it by name; through the engine it composes with every offload mode, strict forwards
and a LoRA (fused and as a bypass) on SD1.5 and FLUX.1-dev, leaving no hook, no violation and no state;
the threshold travels through the infotext (PNG Info / send-to) and the A1111 API's `override_settings`
(`steady_step_cache`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hook_plan import actual_hooks, expected_hooks

from app.a1111.options import unsupported_overrides
from app.a1111.schema import Txt2ImgRequest
from app.a1111.txt2img import plan
from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline
from app.engine import offload
from app.engine.generate import GenerateParams, RunContext, denoise, infotext
from app.engine.step_cache import apply_step_cache, step_cached
from app.engine.worker import Engine
from app.families import family
from app.hooks import HookRegistry, ModelHook
from app.infotext import parse_infotext
from app.settings import Settings
from app.styles import StyleBook
from app.ui.send_to import fields_from_infotext
from benchmarks.cache_phase import psnr

SIDE = 64


def engine_pipeline(family_name: str, **config):
    """The family's own pipeline class (ours: `spatial_latents`) on a tiny random-weight model."""
    fam = family(family_name)
    plain = build_tiny_pipeline(family_name)
    pipe = fam.pipeline_class(**plain.components, **config)
    pipe.family = fam
    pipe.set_progress_bar_config(disable=True)
    return pipe


def latents(pipe, family_name: str, threshold: float, steps: int = 10, cfg: float | None = None, hooks=None):
    """(latents, the pass's StepCache or None) of one seeded pass at `threshold`."""
    fam = family(family_name)
    params = GenerateParams("a red cube", steps=steps, width=SIDE, height=SIDE, seed=7,
                            sampler=fam.sampling.default_sampler,
                            cfg=fam.sampling.default_guidance if cfg is None else cfg)
    with step_cached(hooks or HookRegistry(), pipe, threshold) as cache:
        out = denoise(pipe, params, 7, width=SIDE, height=SIDE)
    return out, cache


def decoded(pipe, lat: torch.Tensor) -> np.ndarray:
    from app.engine import decoding

    return np.stack([np.asarray(im) for im in decoding.decode(pipe, lat)])


@pytest.mark.parametrize("family_name", ["sd15", "flux-dev"])
def test_threshold_zero_installs_nothing_and_an_unreachable_one_changes_no_bit(family_name):
    """0 is off: no hook, no state. A threshold no step's change is under (1e-12) runs every step whole
    through the hooks, and the latents are the uncached ones bit for bit: caching the output and the
    first block's output never touches what the pipeline computes."""
    pipe, hooks = engine_pipeline(family_name), HookRegistry()
    assert apply_step_cache(hooks, pipe, 0) is None and not list(hooks.hooked())
    uncached, _ = latents(pipe, family_name, 0)
    exact, cache = latents(pipe, family_name, 1e-12, hooks=hooks)
    assert torch.equal(exact, uncached)
    assert (cache.computed, cache.skipped) == (10, 0)
    assert not list(hooks.hooked())  # taken off after the pass


class _Passes:
    """Counts forwards of a module: whether the later blocks really ran."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._seen)

    def _seen(self, *_args) -> None:
        self.count += 1


# (family, threshold, at least this many of 10 calls reused, PSNR floor of the decoded image vs uncached)
SKIPS = [("sd15", 0.2, 2, 35.0), ("flux-dev", 0.05, 5, 25.0)]


@pytest.mark.parametrize(("family_name", "threshold", "at_least", "floor"), SKIPS)
def test_a_threshold_skips_the_later_blocks_and_the_image_stays_close(family_name, threshold, at_least, floor):
    """At a threshold, at least `at_least` of 10 denoiser calls reuse the last whole step: the first block
    runs every call, the last block only on the calls that ran whole (counted), so the work is really
    skipped; and the decoded image is within `floor` dB PSNR of the uncached one (tiny random-weight
    models: the figures the bench reports on full-size ones are its own)."""
    pipe = engine_pipeline(family_name)
    denoiser = getattr(pipe, family(family_name).denoiser)
    later = next(m for n, m in denoiser.named_children() if n in ("up_blocks", "single_transformer_blocks"))
    first, last = _Passes(denoiser.get_submodule(family(family_name).first_block)), _Passes(later[-1])
    uncached, _ = latents(pipe, family_name, 0)
    first.count = last.count = 0
    cached, cache = latents(pipe, family_name, threshold)
    assert cache.skipped >= at_least and cache.computed + cache.skipped == 10, (cache.computed, cache.skipped)
    assert first.count == 10 and last.count == cache.computed
    quality = psnr(decoded(pipe, cached), decoded(pipe, uncached))
    assert floor <= quality < math.inf, quality


def test_the_calls_of_one_step_keep_their_own_caches():
    """FLUX.2 Klein base runs CFG as two calls a step (conditional, then unconditional). Each keeps its
    own reference and output: a reused output is always that of an earlier call in the same position of
    its step (never the other prompt's), and calls are reused at all (a cache shared by both calls would
    compare each with the other prompt's first block and rarely reuse)."""
    family_name = "flux2-klein-4b"
    pipe = engine_pipeline(family_name, is_distilled=False)
    outputs: list[torch.Tensor] = []
    handle = pipe.transformer.register_forward_hook(lambda _m, _a, out: outputs.append(out[0].clone()))
    _, cache = latents(pipe, family_name, 0.3, steps=8, cfg=4.0)
    handle.remove()
    assert len(outputs) == 16 and cache.skipped >= 4, cache.skipped
    for index, output in enumerate(outputs):
        earlier = [j for j in range(index) if torch.equal(outputs[j], output)]
        assert all(j % 2 == index % 2 for j in earlier), (index, earlier)
    reused = sum(any(torch.equal(outputs[j], out) for j in range(i)) for i, out in enumerate(outputs))
    assert reused == cache.skipped


@pytest.mark.parametrize(("family_name", "config"), [("zimage-turbo", {}), ("flux-schnell", {}),
                                                     ("flux2-klein-4b", {"is_distilled": True})])
def test_a_step_distilled_checkpoint_refuses_the_cache_by_name(family_name, config):
    """Step-distilled checkpoints (a few steps, each unlike the last) have nothing to reuse: the cache is
    refused with the model's name and what to do, and nothing is installed; threshold 0 is still fine."""
    pipe, hooks = engine_pipeline(family_name, **config), HookRegistry()
    with pytest.raises(ValueError, match=f"{family(family_name).label} is step-distilled.*set the step cache to 0"):
        apply_step_cache(hooks, pipe, 0.1)
    assert not list(hooks.hooked())
    assert apply_step_cache(hooks, pipe, 0) is None


def test_an_around_hook_restores_the_forward_the_module_had():
    """The registry runs `around` hooks through the module's instance `forward` and puts back what was
    there after (the compiled path sets one): nothing of the cache outlives its hooks."""
    module = torch.nn.Linear(2, 2)
    own = module.forward
    module.forward = own  # an instance forward, as the compiled path sets
    hooks = HookRegistry()
    hooks.add(module, ModelHook("cache.step", around=lambda _m, _f, _a, _k: torch.zeros(1)))
    assert torch.equal(module(torch.ones(2)), torch.zeros(1))
    hooks.remove(module, "cache.step")
    assert module.__dict__["forward"] is own
    plain = torch.nn.Linear(2, 2)
    hooks.add(plain, ModelHook("cache.step", around=lambda _m, forward, a, k: forward(*a, **k) * 0))
    assert torch.equal(plain(torch.ones(2)), torch.zeros(2))
    hooks.remove(plain, "cache.step")
    assert "forward" not in plain.__dict__ and not torch.equal(plain(torch.ones(2)), torch.zeros(2))


@pytest.fixture(scope="module")
def moving(module_engine):
    """bf16 compute, fp32 rest, strict forwards (the conformance suite's `moving` engine)."""
    eng = Engine(Settings(data_dir=module_engine.settings.data_dir, device="cpu", dtype="bf16", rest_dtype="fp32",
                          strict=True, strict_forwards=True))
    yield eng
    eng.close()


@pytest.mark.parametrize(("family_name", "threshold"), [("sd15", 0.2), ("flux-dev", 0.05)])
def test_the_cache_composes_with_every_offload_mode_strict_forwards_and_a_lora(moving, family_name, threshold):
    """Through the engine, with strict forwards on and a LoRA on the denoiser (fused with offload none, a
    bypass where weights stream): in every offload mode a cached generation differs from the uncached one
    (steps were reused) by at most a few grey levels, the verify after it finds nothing, and the hooks left
    are exactly the mode's (the cache's are gone with its pass). Skipped blocks are never streamed in, and
    a block group offload copied ahead for them goes back at the job's end."""
    fam = family(family_name)
    checkpoint = f"tiny-{family_name}.safetensors"
    moving.load_model(checkpoint)
    moving.set_loras([LoraSpec(f"demo-style-{family_name}", 1.0)])
    base = dict(prompt="a red cube", steps=6, width=SIDE, height=SIDE, seed=7, sampler=fam.sampling.default_sampler,
                cfg=fam.sampling.default_guidance)
    try:
        for mode in offload.MODES:
            moving.set_offload(mode)
            plain = np.stack([np.asarray(i.image) for i in moving.generate(GenerateParams(**base))])
            cached = moving.generate(GenerateParams(**base, step_cache=threshold))
            image = np.stack([np.asarray(i.image) for i in cached])
            assert "Step cache: " + f"{threshold:g}" in cached[0].infotext
            assert not np.array_equal(image, plain), mode
            assert psnr(image, plain) > 20.0, (mode, psnr(image, plain))
            snap = moving.snapshot()
            assert snap.violations == () and snap.violations_found_total == 0, (mode, snap.violations)
            bypassed = set(moving.lora_stack.bypassed())
            assert actual_hooks(snap) == expected_hooks(moving.pipeline, mode, bypassed, strict=True), mode
    finally:
        moving.set_offload("none")
        moving.set_loras([])


def test_the_threshold_travels_through_the_infotext_and_the_api():
    """`Step cache: 0.15` is written when on (and nothing when off), read back by PNG Info / send-to (an
    infotext without it resets the field to 0, so a sent image is remade as it was made), and the A1111
    API takes it per request in `override_settings` as `steady_step_cache` (its request schema stays A1111's),
    checked by the same range as the UI."""
    ctx = RunContext("tiny", None, family="sd15")
    text = infotext(GenerateParams("a fox", step_cache=0.15), 7, ctx)
    assert "Step cache: 0.15" in text
    assert fields_from_infotext(parse_infotext(text).settings, [])["step_cache"] == 0.15
    off = infotext(GenerateParams("a fox"), 7, ctx)
    assert "Step cache" not in off and fields_from_infotext(parse_infotext(off).settings, [])["step_cache"] == 0
    def request(**overrides) -> Txt2ImgRequest:
        return Txt2ImgRequest(prompt="a fox", override_settings=overrides)

    assert plan(request(steady_step_cache=0.15), "sd15", StyleBook({}))[0].step_cache == 0.15
    assert plan(request(), "sd15", StyleBook({}))[0].step_cache == 0
    assert not list(unsupported_overrides(Settings(), {"steady_step_cache": 0.15}))  # no "ignored" note
    with pytest.raises(ValueError, match="step_cache must be a number in 0…1"):
        plan(request(steady_step_cache=2), "sd15", StyleBook({}))
