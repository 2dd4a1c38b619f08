"""Serving a team on the engine: each job carries its own `Desired`, waiting jobs are grouped by it
fairly, and `--devices cpu,cpu` runs one engine per device behind a dispatcher.

What users see: the image a job makes depends only on the state it carried (never on what another
user's job left on the engine), jobs asking for the same model and LoRAs run back to back without
starving anyone, two jobs on a two-device pool run at the same time, a job for the model an engine
holds goes to that engine, and Interrupt stops the job of the one who asked, on whichever engine.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from app.adapters.specs import LoraSpec
from app.engine.desired import Desired
from app.engine.generate import GenerateParams
from app.engine.pool import EnginePool, make_engine, resolve_devices
from app.engine.queue import MAX_PASSES, Command, pick
from app.engine.snapshot import EngineState
from app.engine.worker import Engine
from app.report import collect_report
from app.settings import Settings
from app.ui import views

SD15, SDXL = "tiny-sd15.safetensors", "tiny-sdxl.safetensors"
STYLE = (LoraSpec("demo-style-sd15", 0.8),)
DETAIL = (LoraSpec("demo-detail-sd15", 1.2, te_weight=0.4),)


def _params(seed: int = 1, steps: int = 2, size: int = 64) -> GenerateParams:
    return GenerateParams("a fox", steps=steps, width=size, height=size, seed=seed)


def _pixels(images) -> list[np.ndarray]:
    return [np.asarray(im.image) for im in images]


def private_data(demo_dir: Path, root: Path) -> Path:
    """A data folder whose models and LoRAs are hard links to the session's demo files."""
    for sub in ("models/Stable-diffusion", "models/Lora", "embeddings"):
        shutil.copytree(demo_dir / sub, root / sub, copy_function=os.link)
    return root


def _job(desired: Desired, owner: str | None = None) -> Command:
    return Command("generate", "", EngineState.GENERATING, lambda: None, Future(), owner=owner, desired=desired)


# ------------------------------------------------------------------------------ the queue's choice
def test_pick_groups_waiting_jobs_by_state_and_passes_none_more_than_max_passes():
    """The next job is one whose state the engine holds, else one on the same checkpoint, else the
    oldest; an owner's jobs keep their order; a job overtaken MAX_PASSES times runs next."""
    a, a2, b = Desired(model="a"), Desired(model="a", loras=STYLE), Desired(model="b")
    waiting = [_job(b, "bob"), _job(a2, "ann"), _job(a, "cid"), _job(a, "bob")]
    assert pick(waiting, held=a) == 2  # same state first; bob's second job waits behind his first
    waiting.pop(2)
    assert pick(waiting, held=a) == 1  # then the same checkpoint (a re-patch, no reload)
    assert waiting[0].passed == 2
    order, queue = [], [_job(b, "b0"), *(_job(a, f"a{i}") for i in range(MAX_PASSES + 2))]
    held = a
    while queue:
        chosen = queue.pop(pick(queue, held))
        order.append(chosen.owner)
        held = chosen.desired
    assert order == [f"a{i}" for i in range(MAX_PASSES)] + ["b0", f"a{MAX_PASSES}", f"a{MAX_PASSES + 1}"]
    mutation = Command("set_loras", "", EngineState.PATCHING, lambda: None, Future())
    assert pick([_job(b), mutation, _job(a)], held=a) == 0  # nothing overtakes a mutation


# ------------------------------------------------------------------------------ one engine, many states
@pytest.fixture(scope="module")
def engine(tmp_path_factory, demo_dir):
    """One CPU engine over the demo models and LoRAs, outputs in a private folder."""
    eng = Engine(Settings(data_dir=private_data(demo_dir, tmp_path_factory.mktemp("team")), device="cpu"))
    eng.load_model(SD15)
    yield eng
    eng.close()


def test_a_job_runs_with_the_state_it_carries_whatever_the_engine_held(engine):
    """A job carrying (SD1.5, style LoRA) makes the same bytes whether the engine held SDXL with another
    LoRA or exactly that state; the history shows the reconcile and whose job asked for it."""
    want = Desired(model=SD15, loras=STYLE)
    engine.set_loras(STYLE)
    alone = _pixels(engine.generate(_params()))
    engine.load_model(SDXL)
    engine.set_loras((LoraSpec("demo-style-sdxl", 1.5),))
    carried = _pixels(engine.generate(_params(), owner="alice", desired=want))
    assert all(np.array_equal(x, y) for x, y in zip(alone, carried, strict=True))
    snap = engine.snapshot()
    assert snap.model == SD15 and snap.held_for == "alice" and snap.desired.same_as(want)
    assert "for session alice" in views.status_html(snap)  # the header says for whom
    reconcile = [h for h in snap.history if h.command == "reconcile"][-1]
    assert reconcile.outcome == "ok" and "for alice" in reconcile.detail and "demo-style-sd15" in reconcile.detail
    plain = _pixels(engine.generate(_params(), owner="bob", desired=Desired(model=SD15)))
    assert not np.array_equal(plain[0], alone[0])  # the LoRA changes the image, so a leak would show
    assert engine.snapshot().loras == ()


def test_a_job_whose_state_cannot_be_reached_fails_alone(engine):
    """A job asking for a checkpoint that does not exist fails with the loader's message and runs
    nothing; the engine keeps the state it held and the next job runs."""
    before = engine.snapshot().desired
    with pytest.raises(Exception, match="no-such"):
        engine.generate(_params(), owner="eve", desired=Desired(model="no-such.safetensors"))
    assert engine.snapshot().desired == before and engine.snapshot().state == "READY"
    assert len(engine.generate(_params(), owner="bob", desired=before)) == 1


def test_a_refiner_job_carries_its_state_and_is_checked_against_it(engine):
    """A txt2img with a refiner carrying SDXL runs while the engine holds SD1.5 (a family without a refiner
    stage: a check against the held model would refuse it) and makes the bytes it makes with SDXL loaded
    directly; the engine then holds SDXL for its owner."""
    refined = dataclasses.replace(_params(), refiner_checkpoint=SDXL, refiner_switch_at=0.5)
    engine.load_model(SDXL)
    engine.set_loras(())
    alone = engine.generate(refined)
    engine.load_model(SD15)
    carried = engine.generate(refined, owner="rita", desired=Desired(model=SDXL))
    assert all(np.array_equal(x, y) for x, y in zip(_pixels(alone), _pixels(carried), strict=True))
    assert f"Refiner: {SDXL}" in carried[0].infotext
    assert engine.snapshot().model == SDXL and engine.snapshot().held_for == "rita"


def test_waiting_jobs_run_grouped_by_state_and_fairly(engine):
    """Six jobs wait while the engine is busy: two SDXL jobs among four SD1.5 ones. They run with at
    most two reconciles instead of five, the first SDXL job overtaken at most MAX_PASSES times, and every
    job's image is the one its state gives."""
    engine.load_model(SD15)
    release = threading.Event()
    engine.submit("hold", "", EngineState.READY, release.wait, record=False)
    plan = [(SDXL, "x0"), (SD15, "s0"), (SDXL, "x1"), (SD15, "s1"), (SD15, "s2"), (SD15, "s3")]
    results: dict[str, list] = {}
    threads = [threading.Thread(target=lambda m=model, o=owner, i=i: results.__setitem__(
        o, engine.generate(_params(steps=2 + i), owner=o, desired=Desired(model=m)))) for i, (model, owner)
        in enumerate(plan)]
    for count, thread in enumerate(threads, 1):
        thread.start()
        deadline = time.monotonic() + 30
        while engine.snapshot().queued < count and time.monotonic() < deadline:  # queued in this order
            time.sleep(0.01)
    history_before = len(engine.snapshot().history)
    release.set()
    for thread in threads:
        thread.join(120)
    rows = engine.snapshot().history[history_before:]
    ran = [int(h.detail.split()[0]) - 2 for h in rows if h.command == "generate"]
    assert sorted(ran) == list(range(len(plan)))
    assert sum(h.command == "reconcile" for h in rows) == 2
    assert ran == [1, 3, 4, 0, 2, 5]  # x0 lets MAX_PASSES (3) SD1.5 jobs go first, then the SDXL pair
    assert all(len(results[owner]) == 1 for _, owner in plan)


# ------------------------------------------------------------------------------ one engine per device
@pytest.fixture(scope="module")
def pool(tmp_path_factory, demo_dir):
    """`--devices cpu,cpu`: two engines, one torch thread each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = Settings(data_dir=private_data(demo_dir, tmp_path_factory.mktemp("pool")), devices=("cpu", "cpu"))
    made = make_engine(settings)
    assert isinstance(made, EnginePool) and len(made.snapshots()) == 2
    yield made
    made.close()
    torch.set_num_threads(threads)


def _sched(engine: Engine) -> tuple[float, float]:
    """(on-CPU, waiting-for-a-CPU) seconds of the engine's worker thread so far (Linux schedstat)."""
    run, queued, _ = open(f"/proc/self/task/{engine._worker.native_id}/schedstat").read().split()
    return int(run) / 1e9, int(queued) / 1e9


def _jobs(engine: Engine) -> int:
    return sum(h.command == "generate" for h in engine.snapshot().history)


def _last_job(engine: Engine):
    return [h for h in engine.snapshot().history if h.command == "generate"][-1]


@pytest.mark.skipif(not hasattr(threading.Thread, "native_id") or not __import__("os").path.exists(
    "/proc/self/task"), reason="needs Linux schedstat")
def test_two_devices_run_two_jobs_at_once(pool):
    """Two jobs for the state both engines hold run at the same time, one per engine, and nothing in the
    process holds either back. Measured here, where other processes share the two cores: each job's own
    run time and time spent waiting for a core (schedstat) are read around the pair; the time a job
    *slept* inside its transition (duration - run - wait) is what our own code (a lock, the GIL) cost it.
    Throughput on two free cores is then the sum of run times over the longest run + sleep; the wall-time
    ratio against the same two jobs run one after the other on one engine is printed for reference."""
    for engine in pool.engines:
        engine.load_model(SD15)
    params = _params(steps=3, size=256)
    pool.engines[0].generate(params)  # warm
    t0 = time.perf_counter()
    pool.engines[0].generate(params)
    pool.engines[0].generate(params)
    serial_wall = time.perf_counter() - t0
    before = [_sched(e) for e in pool.engines]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=pool.generate, args=(params,), kwargs={"owner": f"p{i}"}) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    pair_wall = time.perf_counter() - t0
    after = [_sched(e) for e in pool.engines]
    jobs = [_last_job(e) for e in pool.engines]
    overlap = min(j.started + j.duration_s for j in jobs) - max(j.started for j in jobs)
    assert overlap >= 0.8 * min(j.duration_s for j in jobs), jobs  # one job per engine, at once
    runs = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    slept = [job.duration_s - run - (a[1] - b[1]) for job, run, a, b in zip(jobs, runs, after, before, strict=True)]
    throughput = sum(runs) / max(run + max(s, 0.0) for run, s in zip(runs, slept, strict=True))
    print(f"pair: run {runs} s, slept {slept} s -> {throughput:.2f}x one engine on free cores; "
          f"wall {pair_wall:.2f} s vs {serial_wall:.2f} s serial ({serial_wall / pair_wall:.2f}x here)")
    assert throughput >= 1.6


def test_a_job_goes_to_the_engine_holding_its_model(pool):
    """Engine 1 holds SDXL, engine 0 SD1.5: an SDXL job runs on engine 1 without a reconcile, an SD1.5
    job with the style LoRA on engine 0 (a re-patch there, no reload anywhere)."""
    pool.engines[0].load_model(SD15)
    pool.engines[1].load_model(SDXL)
    loads = [e.snapshot().timers["load"].count for e in pool.engines]
    jobs = [_jobs(e) for e in pool.engines]
    pool.generate(_params(), owner="x", desired=Desired(model=SDXL))
    assert [_jobs(e) for e in pool.engines] == [jobs[0], jobs[1] + 1]
    pool.generate(_params(), owner="s", desired=Desired(model=SD15, loras=STYLE))
    assert [_jobs(e) for e in pool.engines] == [jobs[0] + 1, jobs[1] + 1]
    assert pool.engines[0].snapshot().held_for == "s" and pool.engines[0].snapshot().loras == STYLE
    assert [e.snapshot().timers["load"].count for e in pool.engines] == loads
    assert pool.engines[1].snapshot().model == SDXL
    header = views.engines_html(pool.snapshots())  # one status line per engine, each saying for whom
    assert "engine 1 " in header and "id='sd-status-1'" in header and "for session x" in header
    report = collect_report(pool, pool.settings)  # the bug report has every engine
    assert report["snapshot"]["model"] == SD15 and [s["model"] for s in report["other_engines"]] == [SDXL]


def test_devices_flag_makes_one_engine_per_device():
    """`--devices cpu,cpu` reaches the settings; `all` stands alone; one device is a plain engine."""
    from launch import build_parser, settings_from_args

    assert settings_from_args(build_parser().parse_args(["--devices", "cpu, cpu"])).devices == ("cpu", "cpu")
    with pytest.raises(ValueError, match="just all"):
        Settings(devices=("all", "cpu"))
    assert resolve_devices(("cuda:1", "cpu")) == ("cuda:1", "cpu")
    every_gpu = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0))
    assert resolve_devices(("all",)) == (every_gpu or ("cpu",))


def test_interrupt_reaches_the_engine_running_that_owners_job(pool):
    """Two long jobs run on the two engines; Interrupt for one owner stops that job at once (its image
    cut short) while the other runs all its steps."""
    for engine in pool.engines:
        engine.load_model(SD15)
    long = _params(steps=60, size=64)
    out: dict[str, list] = {}
    threads = [threading.Thread(target=lambda o=o: out.__setitem__(o, pool.generate(long, owner=o)))
               for o in ("keep", "stop")]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not all(s.progress and s.progress.step >= 2 for s in pool.snapshots()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.interrupt(owner="stop") and not pool.interrupt(owner="nobody")
    for thread in threads:
        thread.join(300)
    assert out["stop"][0].stopped_at is not None and out["stop"][0].stopped_at < long.steps
    assert out["keep"][0].complete
