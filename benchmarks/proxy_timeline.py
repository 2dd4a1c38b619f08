"""The per-image CPU proxy (issue 41): the time of one whole generation spent outside the denoiser, ours
against diffusers' pipeline call, on the full-size architecture, with our timeline of where it went.

Why: on an H100 our denoiser ran at diffusers' speed while a whole generation took up to twice as long.
What a generation does besides denoising (checks, text encoding, decoding, the image and its file, the
snapshot) runs on the host, so the CPU can measure it: each side's generation time minus the time inside
its denoiser's calls, as wall time and as the generating thread's CPU time (ours: the engine's worker, read
from its timeline). diffusers' side is its pipeline class on our modules (the same weights, no second
copy): the comparison is of the two call paths around identical modules. Ours writes the PNG with its
infotext as every generation does; diffusers' call returns PIL images and writes nothing.

Host syncs: on a GPU a read of a device tensor on the host (`.item()`, `.tolist()`, `.cpu()`, `bool()`)
waits for everything queued, and the GPU then idles until the host queues more; a CPU cannot see that
cost, so the proxy counts the calls that would be syncs, by call site (`HostSyncs`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.engine.generate import GenerateParams
from app.engine.placement import DTYPES
from benchmarks import stats
from benchmarks.config import CFG_SCALE
from benchmarks.measure import abba, fits, free_memory
from benchmarks.proxy_steps import _diffusers, _engine
from benchmarks.workload import lora_specs

TIMELINE_STEPS = 2  # the denoiser's share is taken out; two steps run the per-step callbacks once between steps
# Tensor methods that, on a device tensor, make the host wait for the device (and `torch.cuda.synchronize`).
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
OURS, FUSED, DIFFUSERS, CONTROL = "ours", "ours, 3 fused LoRAs", "diffusers", "control:ours"


class HostSyncs:
    """Counts, while entered, the calls that would make the host wait for a GPU, by call site
    ("file.py:function"; the first frame outside torch). On the CPU every tensor is a host tensor, so a
    count is an upper bound: a read of a host copy (`HostRead`) is counted as well."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: list[tuple[object, str, Callable]] = []

    def _counting(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def call(*args, **kwargs):
            frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
            self.sites[f"{Path(frame.filename).name}:{frame.name}"] += 1
            return original(*args, **kwargs)
        return call

    def __enter__(self) -> HostSyncs:
        for owner, name in [*((torch.Tensor, m) for m in SYNC_METHODS), (torch.cuda, "synchronize")]:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._counting(original))
        return self

    def __exit__(self, *_exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    @property
    def total(self) -> int:
        return sum(self.sites.values())


class DenoiserClock:
    """Wall and thread-CPU time spent inside the denoiser's calls (on whichever thread calls it)."""

    def __init__(self, denoiser: torch.nn.Module) -> None:
        self.wall = self.cpu = 0.0
        self._started = (0.0, 0.0)
        self._handles = [denoiser.register_forward_pre_hook(self._before, prepend=True),
                         denoiser.register_forward_hook(self._after)]

    def _before(self, *_args) -> None:
        self._started = (time.perf_counter(), time.thread_time())

    def _after(self, *_args) -> None:
        self.wall += time.perf_counter() - self._started[0]
        self.cpu += time.thread_time() - self._started[1]

    def reset(self) -> None:
        self.wall = self.cpu = 0.0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _ours_run(engine, params: GenerateParams, clock: DenoiserClock) -> dict[str, Any]:
    clock.reset()
    started = time.perf_counter()
    engine.generate(params)
    wall = time.perf_counter() - started
    timeline = engine.snapshot().last_generation
    return {"wall_ms": (wall - clock.wall) * 1e3, "cpu_ms": timeline.cpu_ms - clock.cpu * 1e3,
            "phases": {p.name: [p.wall_ms, p.cpu_ms] for p in timeline.phases}}


def _diffusers_run(generate: Callable[[], Any], clock: DenoiserClock) -> dict[str, Any]:
    clock.reset()
    started, cpu = time.perf_counter(), time.thread_time()
    generate()
    return {"wall_ms": (time.perf_counter() - started - clock.wall) * 1e3,
            "cpu_ms": (time.thread_time() - cpu - clock.cpu) * 1e3}


def _comparisons(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Ours and ours with 3 fused LoRAs against diffusers: non-denoiser thread CPU and wall ms (lower is
    better); the control is ours measured twice."""
    rows = []
    for mine in (OURS, FUSED):
        for field, figure in (("cpu_ms", "non-denoiser thread CPU ms"), ("wall_ms", "non-denoiser wall ms")):
            series = {key: [run[field] for run in runs[key]] for key in (mine, DIFFUSERS, OURS, CONTROL)}
            control = stats.paired_ratios(series[OURS], series[CONTROL], False)
            rows.append({"ours": mine, "baseline": "diffusers pipeline call (same modules)", "figure": figure,
                         "ours_median": stats.median_interval(series[mine]).as_dict(),
                         "baseline_median": stats.median_interval(series[DIFFUSERS]).as_dict(),
                         **stats.compare(series[mine], series[DIFFUSERS], control, higher_is_better=False)})
    return rows


def _phase_medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    names = dict.fromkeys(name for run in runs for name in run["phases"])
    return {name: {"wall_ms": stats.median_interval([r["phases"].get(name, [0, 0])[0] for r in runs]).median,
                   "cpu_ms": stats.median_interval([r["phases"].get(name, [0, 0])[1] for r in runs]).median}
            for name in names}


def timeline_section(model, config) -> dict[str, Any]:
    """Ours (no LoRA, and three fused) and diffusers, one generation each per round in ABBA order with a
    control, after a warm-up each: time outside the denoiser, our timeline's phases, host syncs."""
    ok, why = fits((model.numel + model.lora_numel) * DTYPES[config.step_dtype].itemsize)
    if not ok:
        return {"family": model.family, "skipped": why}
    config = dataclasses.replace(config, steps=TIMELINE_STEPS)
    side = config.resolution
    params = GenerateParams(config.prompt, steps=config.steps, cfg=CFG_SCALE, seed=config.seed, width=side,
                            height=side, sampler="Euler")
    engine = _engine(model, config.step_dtype)
    clock = DenoiserClock(engine.pipeline.unet)
    try:
        _pipe, generate = _diffusers(model, config, engine.pipeline)
        setups = {OURS: [], FUSED: lora_specs(model.loras, 3), DIFFUSERS: [], CONTROL: []}
        measure = {key: functools.partial(_ours_run, engine, params, clock) for key in (OURS, FUSED, CONTROL)}
        measure[DIFFUSERS] = functools.partial(_diffusers_run, generate, clock)
        syncs = {}
        for key in (OURS, FUSED, DIFFUSERS):  # warm-up, and the host syncs of one generation
            engine.set_loras(setups[key])
            with HostSyncs() as counted:
                measure[key]()
            syncs[key] = {"total": counted.total, "sites": dict(counted.sites)}
        runs: dict[str, list[dict[str, Any]]] = {key: [] for key in setups}
        for round_index in range(config.rounds):
            for key in abba(list(setups), round_index):
                engine.set_loras(setups[key])
                runs[key].append(measure[key]())
    finally:
        clock.remove()
        engine.unload()
        engine.close()
        free_memory()
    return {"family": model.family, "resolution": side, "steps": config.steps, "dtype": config.step_dtype,
            "runs": runs, "phases_ms": {key: _phase_medians(runs[key]) for key in (OURS, FUSED)},
            "host_syncs": syncs, "comparisons": _comparisons(runs)}
