"""Interrupt and Skip: a long generation stops between two steps and the engine is READY again.

What it protects (issue: a 150-step job on a slow box could not be stopped): `interrupt()` lands
within two steps of the request, returns the partial images (or none, when dropped) and leaves
the engine READY with a clean history row; `skip()` ends one run of a batch count and the next
one runs in full; a stop request from another owner (a different browser tab or API client)
does not touch the job.
"""

from __future__ import annotations

import threading
import time

import pytest
from tiny import CHECKPOINTS

from app.engine.generate import GenerateParams

LONG = dict(steps=150, width=64, height=64, cfg=5.0, sampler="Euler", seed=5)


class Running:
    """A generation on a thread of its own, watched through the engine's progress."""

    def __init__(self, engine, params: GenerateParams, owner: str | None = "tab-1") -> None:
        self.engine, self.result, self.error = engine, None, None
        self.thread = threading.Thread(target=self._run, args=(params, owner), daemon=True)
        self.thread.start()

    def _run(self, params, owner) -> None:
        try:
            self.result = self.engine.generate(params, owner=owner)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc

    def wait_for_step(self, step: int, run: int = 1, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            progress = self.engine.snapshot().progress
            if progress is not None and f"run {run}/" in progress.phase and progress.step >= step:
                return progress.step
            time.sleep(0.01)
        raise AssertionError(f"never reached step {step} of run {run}")

    def join(self) -> None:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive() and self.error is None, self.error


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
