"""Our side: everything through the public Engine API, the compiled path included (an engine built
with the compile settings; the bench never reaches into the worker to compile)."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.settings import Settings
from benchmarks.config import PROMPT, SEED, Bench, guidance
from benchmarks.denoiser import denoiser_of
from benchmarks.measure import StepTimer, free_memory, timed_ms
from benchmarks.workload import PreparedModel, lora_specs

log = logging.getLogger("bench")


def new_engine(model: PreparedModel, bench: Bench, **overrides) -> Engine:
    return Engine(Settings(**{"data_dir": model.data_dir, "device": str(bench.device), "dtype": bench.config.dtype,
                              **overrides}))


def compile_settings(bench: Bench, mode: str) -> dict[str, Any]:
    """What the engine needs to run its compiled path the way the bench measures it."""
    return {"compile": True, "compile_mode": mode, "compile_backend": bench.config.compile_backend}


def load(engine: Engine, name: str) -> None:
    """`Engine.load_model`, then the pipeline's per-step tqdm bar off, as on the diffusers side (the
    engine reports progress in its snapshot; a bar on stderr would only add noise to both timings)."""
    engine.load_model(name)
    engine.pipeline.set_progress_bar_config(disable=True)


def loaded_engine(model: PreparedModel, bench: Bench, **overrides) -> Engine:
    engine = new_engine(model, bench, **overrides)
    load(engine, model.name)
    return engine


def close(engine: Engine | None) -> None:
    if engine is not None:
        engine.unload()
        engine.close()
    free_memory()


def generator(engine: Engine, model: PreparedModel, bench: Bench, batch: int,
              steps: int | None = None, step_cache: float = 0.0) -> Callable[[], Any]:
    side = bench.config.resolution[model.family]
    params = GenerateParams(PROMPT, steps=steps or bench.config.steps, cfg=guidance(model.family), seed=SEED,
                            width=side, height=side, batch=batch, sampler="Euler", step_cache=step_cache)
    return functools.partial(engine.generate, params)


def last_timeline(engine: Engine) -> Callable[[], dict | None]:
    """Reads where the engine's last generation spent its time (`Snapshot.last_generation`), for the rows."""
    def read() -> dict | None:
        last = engine.snapshot().last_generation
        return None if last is None else last.as_dict()
    return read


def lora_setup(engine: Engine, model: PreparedModel, count: int) -> Callable[[], Any]:
    return functools.partial(engine.set_loras, lora_specs(model.loras, count))


def offload_setup(engine: Engine, mode: str, warm_up: Callable[[], Any]) -> Callable[[], None]:
    """Switch offload mode, then one short generation so the timed one starts with the mode's
    steady-state placement (balanced uploads its components on first use)."""

    def setup() -> None:
        if engine.snapshot().offload != mode:
            engine.set_offload(mode)
            warm_up()

    return setup


def latency_round(engine: Engine, model: PreparedModel, bench: Bench, reweights: int) -> dict[str, list[float]]:
    """Add a third LoRA on top of two, re-weight it, remove it (ms). Each is one full engine transition:
    queue, placement verify before and after, the patch itself, a new snapshot; "<op>-patch" is the
    engine's own timer around the LoRA math."""
    engine.set_loras(lora_specs(model.loras, 2))
    ops = [("add", lora_specs(model.loras, 3))]
    ops += [("reweight", lora_specs(model.loras, 3, 1.1 - i % 2 / 10)) for i in range(reweights)]
    ops.append(("remove", lora_specs(model.loras, 2)))
    times: dict[str, list[float]] = {}
    for op, specs in ops:
        times.setdefault(op, []).append(timed_ms(functools.partial(engine.set_loras, specs), bench.device))
        times.setdefault(f"{op}-patch", []).append(engine.snapshot().timers["patch"].last_s * 1e3)
    return times


def lora_ops_check(engine: Engine, model: PreparedModel, bench: Bench) -> dict[str, Any]:
    """An add, `reweights` re-weights, a remove and a re-add under the compiled UNet with a (short)
    generation after each: compiles and CUDA-graph recordings must stay put, and each change must
    reach the UNet's output. Leaves the three LoRAs applied."""
    sequence = [lora_specs(model.loras, 3)]
    sequence += [lora_specs(model.loras, 3, 1.1 - i % 2 / 10) for i in range(bench.config.reweights)]
    sequence += [lora_specs(model.loras, 2), lora_specs(model.loras, 3)]
    generate = generator(engine, model, bench, 1, steps=2)
    timer = StepTimer(denoiser_of(engine.pipeline), bench.device, capture=True)
    before = engine.snapshot().compile
    changed = []
    try:
        generate()
        for specs in sequence:
            previous = timer.last_output
            engine.set_loras(specs)
            generate()
            changed.append(not torch.equal(timer.last_output, previous))
    finally:
        timer.remove()
    after = engine.snapshot().compile
    recorded, was = after.cudagraph_recordings, before.cudagraph_recordings
    return {"lora_ops": len(sequence), "recompiles_during_lora_ops": after.compiles - before.compiles,
            "cudagraph_rerecords_during_lora_ops": None if was is None else recorded - was,
            "lora_changes_reached_output": all(changed)}


# ------------------------------------------------------------------------------------ warm restart
def restart_probe(model: PreparedModel, mode: str, compiled_its: float, bench: Bench) -> dict[str, Any]:
    """Time a fresh process from its first generation to compiled speed, from this run's caches (the
    engine keeps them under the data dir, which the child shares)."""
    spec = {"data_dir": str(model.data_dir), "model": model.name, "mode": mode,
            "backend": bench.config.compile_backend, "resolution": bench.config.resolution[model.family],
            "steps": bench.config.steps, "dtype": bench.config.dtype, "device": str(bench.device),
            "guidance": guidance(model.family),
            "target_its": compiled_its}
    log.info("[%s] ours: warm-restart probe (%s)", model.family, mode)
    command = [sys.executable, "-m", "app.bench", "--restart-probe", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False,
                          cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        return {"warm_restart_note": f"probe failed: {done.stderr.strip()[-800:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_restart_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """The child side: load the model with the compiled path on (not timed), then generate until a
    generation reaches 90% of the parent's compiled speed (at most 5); report the elapsed time."""
    device = torch.device(spec["device"])
    settings = Settings(data_dir=Path(spec["data_dir"]), device=spec["device"], dtype=spec["dtype"], compile=True,
                        compile_mode=spec["mode"], compile_backend=spec["backend"])
    engine = Engine(settings)
    try:
        load(engine, spec["model"])
        side = spec["resolution"]
        params = GenerateParams(PROMPT, steps=spec["steps"], cfg=spec["guidance"], seed=SEED, width=side, height=side,
                                sampler="Euler")
        timer = StepTimer(denoiser_of(engine.pipeline), device)
        started, its = time.perf_counter(), 0.0
        for _ in range(5):
            timer.reset()
            engine.generate(params)
            its = timer.its()
            if its >= 0.9 * spec["target_its"]:
                break
        return {"warm_restart_s": time.perf_counter() - started, "warm_restart_its": its,
                "warm_restart_compiles": engine.snapshot().compile.compiles,
                "warm_restart_fx_cache_hits": int(torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"])}
    finally:
        close(engine)
