"""Per-image time (issue 41, part 1): the timeline of one generation, and the costs outside the denoiser
that must not come back: a full walk over the model's tensors beyond the two checks around the job, and
host syncs beyond diffusers' own. Tiny SD1.5 on the CPU; the full-size figures are the bench's
`--cpu-proxies --sections timeline`."""

from __future__ import annotations

import collections
import dataclasses
import json
import time

import pytest
import torch

from app import diagnostics, report
from app.adapters.specs import LoraSpec
from app.engine import placement, timeline
from app.engine.generate import GenerateParams
from app.families import family
from app.ui import views
from benchmarks.proxy_timeline import HostSyncs

MODEL = "tiny-sd15.safetensors"
PARAMS = GenerateParams("a red cube", steps=2, cfg=7.0, seed=3, width=64, height=64, sampler="Euler")
# Our host reads per generation that diffusers' call does not make, each with why it is not a GPU stall:
# the NaN check reads step k's flag at step k+1 from a pinned copy (`HostRead`: it waits for step k's work
# alone), and the prompt parser's weights are a host tensor.
OUR_OWN_READS = {"generate.py:settle", "attention.py:weighted"}


@pytest.fixture
def sd15(module_engine):
    module_engine.load_model(MODEL)
    module_engine.set_loras([])
    module_engine.generate(PARAMS)  # warm: the first image waits for the model's hash
    return module_engine


def test_phases_nest_without_counting_twice():
    """The clock's promise: an inner phase's time is taken out of the phase around it, so the phases and
    "other" add up to the job's total (Diagnostics' lines can be read as a breakdown)."""
    clock = timeline.JobClock("generate", "test", queued_s=0.004)
    with timeline.clocked(clock):
        with timeline.phase("outer"):
            time.sleep(0.02)
            with timeline.phase("inner"):
                time.sleep(0.05)
        time.sleep(0.01)
    assert timeline.current() is None
    done = clock.finish()
    outer, inner, other = done.phase("outer"), done.phase("inner"), done.phase(timeline.OTHER)
    assert 45 <= inner.wall_ms < 45 + 40 and 18 <= outer.wall_ms < 18 + 40
    assert 8 <= other.wall_ms < 8 + 40
    assert done.phase(timeline.QUEUE_WAIT).wall_ms == pytest.approx(4.0)
    assert sum(p.wall_ms for p in done.phases if p.name != timeline.QUEUE_WAIT) == pytest.approx(done.wall_ms)


def test_a_generation_shows_where_its_time_went(sd15):
    """Issue 41 part 1: every generation leaves its timeline in the snapshot (and so in the bug report),
    one phase per step of the job, adding up to its total."""
    sd15.generate(PARAMS)
    last = sd15.snapshot().last_generation
    assert last is not None and last.command == "generate"
    names = [p.name for p in last.phases]
    for wanted in ("queue wait", "verify before", "text encode", "denoise", "decode", "image conversion",
                   "png save", "verify after", "publish", "other"):
        assert wanted in names
    assert last.phase("denoise").cpu_ms > 0 and last.phase("finite check").count == PARAMS.steps
    spent = sum(p.wall_ms for p in last.phases if p.name != "queue wait")
    assert spent == pytest.approx(last.wall_ms, abs=0.01)
    assert len(last.lines()) == len(last.phases) + 1
    shown = [row[0] for row in views.timer_rows(sd15.snapshot()) if row[0].startswith("last image › ")]
    assert [name.removeprefix("last image › ").split(" (CPU")[0] for name in shown] == names
    carried = json.loads(json.dumps(report.jsonable(report.collect_report(sd15, sd15.settings))))
    assert [p["name"] for p in carried["snapshot"]["last_generation"]["phases"]] == names


def _count_walks(monkeypatch) -> collections.Counter:
    """Count full walks over the model's tensors (`iter_tensors`), wherever they are made from."""
    walks: collections.Counter = collections.Counter()
    original = placement.iter_tensors

    def counted(pipe):
        walks["walks"] += 1
        return original(pipe)
    monkeypatch.setattr(placement, "iter_tensors", counted)
    monkeypatch.setattr(diagnostics, "iter_tensors", counted)
    return walks


@pytest.mark.parametrize("loras", [0, 1])
def test_a_generation_with_nothing_pending_walks_the_model_only_to_verify_it(sd15, monkeypatch, loras):
    """Issue 41 part 1: a generation that changes no placement walks every tensor twice, for the verify
    before and after it (the checks stay), and not a third time to rebuild Diagnostics' rows, which
    nothing changed; the rows it shows are still exactly what a fresh walk builds."""
    if loras:
        sd15.set_loras([_lora_spec(sd15)])
    sd15.generate(PARAMS)
    walks = _count_walks(monkeypatch)
    sd15.generate(PARAMS)
    assert walks["walks"] == 2
    monkeypatch.undo()
    lifecycle = sd15._lifecycle
    fresh = diagnostics.placement_rows(sd15.pipeline, lifecycle.plan, sd15.lora_stack.patched_modules(), [],
                                       lifecycle._loaded.hooks)
    assert sd15.snapshot().placement == fresh
    sd15.set_loras([])


def _lora_spec(engine) -> LoraSpec:
    return LoraSpec(next(name for name in engine.library.names() if name.endswith("-sd15")))


def test_a_stray_tensor_is_still_found_before_the_next_generation(sd15):
    """The rows reused between generations never hide a violation: a tensor moved behind the engine's back
    is found (and repaired) by the verify before the next generation, and the row shows it."""
    weight = sd15.pipeline.unet.conv_in.weight
    weight.data = weight.data.to(torch.float64)
    sd15.generate(PARAMS)
    row = sd15.snapshot().history[-1]
    assert row.violations_found >= 1 and row.violations_repaired >= 1
    assert any(r.violation and r.module == "conv_in" for r in sd15.snapshot().placement)
    assert sd15.pipeline.unet.conv_in.weight.dtype == torch.float32
    sd15.generate(PARAMS)
    assert not any(r.violation for r in sd15.snapshot().placement)


def _diffusers_call(engine, steps: int):
    fam = family(engine.snapshot().family)
    cls = fam.plain_pipeline_class
    expected, _optional = cls._get_signature_keys(cls)
    pipe = cls(**{k: v for k, v in engine.pipeline.components.items() if k in expected})
    pipe.set_progress_bar_config(disable=True)
    return lambda: pipe(prompt=PARAMS.prompt, num_inference_steps=steps, width=PARAMS.width, height=PARAMS.height,
                        generator=torch.Generator("cpu").manual_seed(PARAMS.seed), output_type="pil",
                        **fam.call_arguments(PARAMS.cfg))


def _syncs(run) -> collections.Counter:
    with HostSyncs() as counted:
        run()
    return counted.sites


def test_host_syncs_per_generation_are_diffusers_own_plus_the_one_step_behind_nan_check(sd15):
    """Issue 41 part 1: a read of a device tensor on the host stalls a GPU's queue, a cost no CPU timing
    shows; so the count is the proxy. Per generation ours makes diffusers' reads plus `OUR_OWN_READS`, and
    per extra step one more (the NaN check's flag, read a step behind) than diffusers' call does."""
    ours = {steps: _syncs(lambda s=steps: sd15.generate(dataclasses.replace(PARAMS, steps=s))) for steps in (2, 4)}
    with torch.no_grad():
        theirs = {steps: _syncs(_diffusers_call(sd15, steps)) for steps in (2, 4)}
    assert set(ours[2]) - set(theirs[2]) <= OUR_OWN_READS, ours[2]
    grows = sum(ours[4].values()) - sum(ours[2].values())
    theirs_grows = sum(theirs[4].values()) - sum(theirs[2].values())
    assert grows - theirs_grows <= 2, (ours, theirs)


def test_an_image_names_its_loras_hashes_without_reading_their_files_again(data_dir, monkeypatch):
    """Issue 41 part 1: every image's infotext names the hashes of its LoRAs. With LoRAs larger than the
    LoRA cache (three FLUX.1 LoRAs over its 1 GiB; here a cache of 0) the hash was read by reading the whole
    file again, per image (1.6 s per FLUX.1 image on the H100 with three). The hash of an unchanged file is
    remembered: no LoRA file is read during a generation, and the hash written is the file's."""
    from app.adapters import files
    from app.engine.worker import Engine
    from app.safetensors_files import lora_short_hash
    from app.settings import Settings

    engine = Engine(Settings(data_dir=data_dir, device="cpu", lora_cache_mib=0))
    try:
        engine.load_model(MODEL)
        spec = _lora_spec(engine)
        engine.set_loras([spec])
        reads = collections.Counter()
        original = files.read_adapter

        def counted(name, path):
            reads[name] += 1
            return original(name, path)
        monkeypatch.setattr(files, "read_adapter", counted)
        image = engine.generate(PARAMS)[0]
        assert reads == {}
        assert f"{spec.name}: {lora_short_hash(engine.library.path_for(spec.name))}" in image.infotext
    finally:
        engine.close()
