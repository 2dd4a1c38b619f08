"""Interrupt and Skip: a long generation stops between two steps and the engine is READY again.

What it protects (issue: a 150-step job on a slow box could not be stopped): `interrupt()` lands
within two steps of the request, returns the partial images (or none, when dropped) and leaves
the engine READY with a clean history row; `skip()` ends one run of a batch count and the next
one runs in full; a stop request from another owner (a different browser tab or API client)
does not touch the job.
"""

from __future__ import annotations

import time

import pytest
import torch
from peak_rss import peak_rss_while
from running_job import Running
from tiny import CHECKPOINTS

from app.engine.generate import GenerateParams

LONG = dict(steps=150, width=64, height=64, cfg=5.0, sampler="Euler", seed=5)


@pytest.fixture
def loaded(engine):
    engine.load_model(CHECKPOINTS["sd15"])
    return engine


def test_interrupt_stops_within_two_steps_and_keeps_the_partial_image(loaded):
    job = Running(loaded, GenerateParams("a cat", **LONG))
    asked_at = job.wait_for_step(3)
    assert loaded.interrupt(owner="tab-1")
    job.join()
    (image,) = job.result
    assert not image.complete and asked_at <= image.stopped_at <= asked_at + 2
    assert image.path.is_file()
    snap = loaded.snapshot()
    assert snap.state == "READY" and snap.history[-1].outcome == "interrupted" and snap.progress is None


def test_interrupt_can_drop_what_was_reached(loaded):
    outputs = loaded.settings.outputs_dir
    before = sorted(outputs.rglob("*.png")) if outputs.exists() else []
    job = Running(loaded, GenerateParams("a cat", **LONG))
    job.wait_for_step(2)
    assert loaded.interrupt(keep_partial=False, owner="tab-1")
    job.join()
    assert job.result == [] and sorted(outputs.rglob("*.png")) == before
    assert loaded.snapshot().state == "READY"


def test_skip_ends_one_run_of_a_batch_count_and_the_next_runs_in_full(loaded):
    job = Running(loaded, GenerateParams("a cat", n_iter=2, **dict(LONG, steps=40)))
    job.wait_for_step(2, run=1)
    assert loaded.skip(owner="tab-1")
    job.join()
    first, second = job.result
    assert (first.complete, second.complete) == (False, True)
    assert (first.seed, second.seed) == (5, 6)


def test_a_stop_from_another_owner_leaves_the_job_alone(loaded):
    job = Running(loaded, GenerateParams("a cat", **dict(LONG, steps=30)))
    job.wait_for_step(1)
    assert not loaded.interrupt(owner="tab-2") and not loaded.skip(owner="tab-2")
    job.join()
    assert job.result[0].complete
    assert not loaded.interrupt(owner="tab-1")  # nothing running any more


def test_a_queued_generation_can_be_cancelled_by_its_owner_before_it_starts(loaded):
    """A closed tab's generation that still waits behind another job is taken off the queue
    (its caller gets GenerationCancelled) and never runs; another owner's cannot be cancelled."""
    from app.engine.generating import GenerationCancelled

    first = Running(loaded, GenerateParams("a cat", **dict(LONG, steps=60)), owner="tab-1")
    first.wait_for_step(1)
    queued = Running(loaded, GenerateParams("a dog", **dict(LONG, steps=5)), owner="tab-2")
    while loaded.snapshot().queued < 1:
        time.sleep(0.01)
    assert loaded.cancel_queued("tab-1") == 0
    assert loaded.cancel_queued("tab-2") == 1
    queued.thread.join(30)
    assert isinstance(queued.error, GenerationCancelled) and queued.result is None
    first.join()
    assert [h.command for h in loaded.snapshot().history].count("generate") == 1


def _stop_at(engine, module, call: int, before: bool):
    """A torch hook on `module` that asks the engine to stop on its `call`-th forward (before or after it):
    a stop at an exact point of a step, whatever the machine's speed."""
    calls = [0]

    def stop(*_args) -> None:
        calls[0] += 1
        if calls[0] == call:
            engine.interrupt()

    return module.register_forward_pre_hook(stop) if before else module.register_forward_hook(stop)


def test_a_stop_inside_a_step_keeps_the_last_complete_steps_image(loaded):
    """Interrupt reaches inside a step (issue 28, finding 8): asked in the middle of step 2 (before
    the UNet's up blocks), it lands at the next block and the image is the one of step 1 — bit for
    bit the image of a stop asked between steps 1 and 2. The engine is READY, the weights unchanged,
    and the per-pass `control.interrupt` hooks are gone."""
    unet = loaded._lifecycle.pipeline.unet
    weights = {k: v.clone() for k, v in unet.state_dict().items()}
    params = GenerateParams("a cat", **dict(LONG, steps=6))
    handle = _stop_at(loaded, unet, 1, before=False)  # after step 1's UNet call: lands between steps
    try:
        (between,) = loaded.generate(params)
    finally:
        handle.remove()
    handle = _stop_at(loaded, unet.up_blocks[0], 2, before=True)  # inside step 2
    try:
        (inside,) = loaded.generate(params)
    finally:
        handle.remove()
    assert between.stopped_at == inside.stopped_at == 1
    assert between.image.tobytes() == inside.image.tobytes()
    assert loaded.snapshot().state == "READY"
    assert all(torch.equal(weights[k], v) for k, v in unet.state_dict().items())
    assert loaded._lifecycle._loaded.hooks.counts()["control.interrupt"] == 0


def test_a_stop_before_the_first_step_ends_keeps_nothing(loaded):
    """Stopped inside step 1 no step completed: no image is kept, the engine is READY and the next
    generation runs in full."""
    unet = loaded._lifecycle.pipeline.unet
    handle = _stop_at(loaded, unet.down_blocks[1], 1, before=True)
    try:
        assert loaded.generate(GenerateParams("a cat", **LONG)) == []
    finally:
        handle.remove()
    assert loaded.snapshot().state == "READY"
    assert loaded.generate(GenerateParams("a cat", **dict(LONG, steps=2)))[0].complete


def test_interrupt_at_2048_lands_within_seconds_inside_one_attention_call(loaded):
    """Issue 43 finding 4: at 2048² the tiny SD1.5's first self-attention is one call over 65,536 tokens
    (~5 minutes on two CPU cores), which no block check reached: READY came minutes after Interrupt. Now
    the call runs in slices with the stop checked between them: a batch of 4 at 2048², interrupted a
    second into its first step, is READY within 5 s (measured 0.4 s), keeps nothing (no step completed),
    held at most +2 GiB of RSS, and the next generation runs."""
    job = Running(loaded, GenerateParams("a cat", **dict(LONG, steps=2, width=2048, height=2048, batch=4)))

    def interrupted() -> float:
        job.wait_for_step(0)  # denoising
        time.sleep(1.0)
        assert loaded.snapshot().progress.step == 0  # inside the first step
        asked = time.monotonic()
        assert loaded.interrupt(owner="tab-1")
        while loaded.snapshot().state != "READY" and time.monotonic() - asked < 30:
            time.sleep(0.02)
        return time.monotonic() - asked

    landed, grown = peak_rss_while(interrupted)
    print(f"READY {landed:.2f} s after the interrupt, RSS +{grown / 2**30:.2f} GiB")
    assert landed < 5.0, f"READY {landed:.1f} s after the interrupt"
    assert grown < 2 * 2**30, f"RSS grew {grown / 2**30:.2f} GiB"
    job.join()
    assert job.result == []
    assert loaded.generate(GenerateParams("a cat", **dict(LONG, steps=2)))[0].complete


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_attention_gives_the_whole_calls_rows_bit_for_bit(dtype):
    """Issue 43 finding 4: the slices a stop is checked between (`interrupt.sliced_attention`) give every
    query row exactly what the whole call gives (each row's softmax reads only its scores), with a per-row
    mask too, so slicing changes when a stop can land and nothing else; a stop raised by `check` ends it."""
    from app.engine.interrupt import SLICE_MACS, StepInterrupted, sliced_attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 2048, 16, generator=generator).to(dtype) for _ in range(3))
    mask = torch.randn(2, 1, 2048, 2048, generator=generator).to(dtype)
    assert query.numel() * key.shape[-2] >= 4 * SLICE_MACS  # sliced
    checks = []
    for attn_mask in (None, mask):
        whole = sdpa(query, key, value, attn_mask=attn_mask)
        sliced = sliced_attention(sdpa, lambda: checks.append(1), query, key, value, attn_mask=attn_mask)
        assert torch.equal(sliced, whole)
    assert len(checks) >= 8

    def stop() -> None:
        if len(checks) > 10:
            raise StepInterrupted("stop")
        checks.append(1)
    with pytest.raises(StepInterrupted):
        sliced_attention(sdpa, stop, query, key, value)


class _CountedMode:
    """Stands in for the slicing function mode: counts how often an attention forward entered it."""

    def __init__(self) -> None:
        self.entered = self.left = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc) -> None:
        self.left += 1


def test_the_slicing_mode_is_entered_only_around_attention_large_enough_to_slice(loaded, monkeypatch):
    """CPU proxy for the per-step cost of sliced attention: entered around a whole pass, the function mode
    costs Python time on every op (16% more CPU per 20-step 64² generation of the tiny SD1.5, one thread).
    It is entered only for an attention forward over `SLICE_MACS` of self-attention work: never in a 64²
    generation; for a 2048² image's 65,536 tokens (as a transformer's or the VAE's 4-D hidden states),
    and left again after the forward, a raised one included."""
    from app.engine import interrupt

    counted = _CountedMode()
    monkeypatch.setattr(interrupt, "_SlicedAttention", lambda check: counted)
    loaded.generate(GenerateParams("a cat", steps=2, width=64, height=64, seed=1))
    assert counted.entered == 0
    hook = interrupt._sliced_attention_hook(counted)
    for large in (torch.empty(1, 256 * 256, 32), torch.empty(1, 32, 256, 256)):
        hook.pre(None, (large,), {})
        hook.after(None)
    hook.pre(None, (), {"hidden_states": torch.empty(2, 32 * 32, 32)})  # 2^25 MACs: runs whole
    hook.after(None)
    assert (counted.entered, counted.left) == (2, 2)
