"""Benchmark: Steady Diffusion's engine against plain diffusers, side by side in one process.

What it measures per family (SD1.5 at 512², SDXL and FLUX.1-dev at 1024²; random weights,
because speed does not depend on weight values; Flux in bf16, since it overflows fp16):

* denoising speed (it/s and thread CPU time per step) at batch 1 and 4 with no LoRA and with 1 and 3
  rank-64 LoRAs (attention + feed-forward; on a UNet the third is a LoCon that also covers the resnet convs):
  ours, fused in place, against diffusers' PEFT adapters unfused and fused;
* each offload mode against its diffusers counterpart (model, sequential and group offload; our
  balanced mode against our `none` with ample VRAM, and against model offload under a 3 GiB budget);
* LoRA add / re-weight / remove latency, model load time, isolated peak VRAM (torch and NVML);
* the compiled UNet (an engine built with `Settings.compile`): first-compile time, speed against
  diffusers eager, compiles and CUDA-graph recordings across LoRA changes, time for a restarted
  process to reach compiled speed from the caches;
* the physical limit: UNet TFLOP per denoising step and the fraction of the GPU's dense bf16 peak.

How it is measured (`measure.py`, `stats.py`): our engine and a diffusers pipeline stay loaded side by
side and every comparison runs in rounds, each round running every variant once, in ABBA order
(forward, then reversed), so drift hits all variants alike. Each pool of variants carries a control:
one configuration measured twice per round. Ratios are medians of the per-round pairs with a 95%
order-statistic interval; a ratio inside the control's spread is reported as "no difference". it/s
comes from hooks on the UNet (CUDA events on a GPU): prompt encoding and VAE decode stay outside, an
offload mode's transfers inside; thread CPU time per step comes from the same hooks.

Modes: full (CUDA), --quick (CUDA: SD1.5, batch 1, 0 and 3 LoRAs, balanced offload, the compiled
path), --smoke (CPU, tiny models, the eager dynamo backend; same code and schema, the numbers mean
nothing; used by a test), --cpu-proxies (CPU, full-size architectures: load time and RSS, ops and CPU
time per step, re-weight time, fp8 storage, ops per denoiser call on the meta device for models that do
not fit, as Flux; see `proxies.py`). A full run takes well over half an hour, so split it
with --families, --sections and --batches; each part writes its own files. Output: <stem>.json, <stem>.md
(and .png) under benchmarks/results/<gpu>/ or cpu-<cpu>/ (or --out), the stem naming mode and restrictions.

    python -m app.bench --quick
    python -m app.bench --families sd15 --sections compile
    python -m app.bench --families flux-dev --sections throughput --batches 1 --repeats 4
    python -m app.bench --cpu-proxies --families sd15
    python -m app.bench --cpu-proxies --families flux-dev --sections ops
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.engine.compile_cache import configure_cache
from benchmarks import ours, phases, probe, proxies, proxy_report, report, stats
from benchmarks.cache_phase import cache_phase
from benchmarks.config import (
    FAMILY_NAMES,
    PRESETS,
    RESULTS_DIR,
    SCHEMA,
    SECTIONS,
    Bench,
    BenchConfig,
    environment,
    gpu_slug,
    run_dtype,
)
from benchmarks.config import base_environment as base_env
from benchmarks.controlnet_phase import controlnet_phase
from benchmarks.denoiser import tflop_per_step
from benchmarks.gguf_phase import gguf_phase
from benchmarks.measure import open_nvml
from benchmarks.theirs import DiffusersSide
from benchmarks.workload import prepare_model

log = logging.getLogger("bench")
STOPPED_EXIT = 3  # the exit status of a run stopped by SIGTERM after saving what it measured
PROXY_SECTIONS = proxies.SECTIONS
DEFAULT_PROXY_CACHE = Path.home() / ".cache" / "steady-diffusion-bench"


def _run_phases(run: phases.FamilyRun, bench: Bench) -> dict[str, str]:
    """Every wanted phase with our engine and a diffusers pipeline side by side; returns diffusers' notes."""
    engine, theirs = ours.new_engine(run.model, bench), DiffusersSide(run.model, bench)
    budget = "balanced-3gib" in bench.config.offload_cases and run.model.family in bench.config.budget_families
    wanted = [phase for section, phase in (
        ("throughput", phases.throughput_phase), ("latency", phases.latency_phase), ("compile", phases.compile_phase),
        ("offload", phases.offload_phase), *([("offload", phases.budget_phase)] if budget else []),
        ("cache", cache_phase), ("controlnet", controlnet_phase),
        ("fp8", phases.fp8_phase), ("gguf", gguf_phase))  # fp8 and gguf last: they unload our full-precision engine
        if bench.wants(section)]
    try:
        phases.load_phase(run, engine, theirs, bench)
        for phase in wanted:
            try:
                phase(run, engine, theirs, bench)
            except Exception as exc:  # a failed phase must not cost the rows of the others; the run exits 1
                name = phase.__name__.removesuffix("_phase")
                log.exception("[%s] %s phase failed", run.model.family, name)
                run.memory.setdefault("phase errors", {})[name] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        ours.close(engine)
        theirs.free()
    return theirs.notes


def bench_family(family_name: str, bench: Bench, results: dict[str, Any], measuring: dict[str, Any]) -> None:
    """Prepare one family, run its phases and add the paired results; `measuring` holds the
    family while its phases run, for a stop to save (`_stopped`)."""
    log.info("[%s] building a random-weight model and its LoRAs", family_name)
    cfg = bench.config
    model = prepare_model(family_name, bench.tmp, bench.device, bench.dtype, cfg.tiny, cfg.lora_rank)
    latent_side = cfg.resolution[family_name] // model.latent_scale
    tflop = {b: tflop_per_step(family_name, model.denoiser_config, b, latent_side) for b in cfg.batches}
    results["models"][family_name] = {"resolution": cfg.resolution[family_name], "latent_side": latent_side,
                                      "denoiser_params_m": model.denoiser_params_m, "loras": list(model.loras),
                                      "lora_rank": cfg.lora_rank,
                                      "tflop_per_step": {str(b): t for b, t in tflop.items()}}
    run = phases.FamilyRun(model, tflop)
    measuring.update(family=family_name, run=run, bench=bench)
    run.notes = _run_phases(run, bench)
    measuring.clear()
    _add_measured(results, family_name, run, bench)
    if bench.wants("load"):
        results["load"].append(report.load_row(run))
    results["compile"] += run.compile_info
    shutil.rmtree(model.data_dir)  # an SDXL folder and its LoRAs take ~8 GB


def _add_measured(results: dict[str, Any], family_name: str, run: phases.FamilyRun, bench: Bench) -> None:
    """The rows of every pool `run` has measured, its LoRA latencies and its memory records."""
    cfg = bench.config
    rows = (report.pair_row(run, p, bench.env, cfg.steps, cfg.resolution[family_name], run.notes) for p in run.pairings)
    results["rows"] += [row for row in rows if row is not None]
    results["latency"] += report.latency_rows(run)
    if "resting" in run.memory:
        results["models"][family_name]["resting_vram_gib"] = run.memory["resting"]
    if "phase errors" in run.memory:
        results["models"][family_name]["phase_errors"] = run.memory["phase errors"]


def _stopped(results: dict[str, Any], measuring: dict[str, Any], save: Callable[[dict[str, Any]], Any]) -> None:
    """SIGTERM (the device check stops a section at its cap): save the rows of every pool measured so
    far, then exit at once, since the clean-up of a stop mid-generation could outlast the grace the
    device check gives before SIGKILL. A run that wrote nothing spent its device time for nothing."""
    if measuring:
        _add_measured(results, measuring["family"], measuring["run"], measuring["bench"])
    results["stopped"] = (f"stopped by SIGTERM during {measuring.get('family', 'the set-up')}: the rows of the "
                          "pools measured until then")
    results["acceptance"] = report.acceptance(results)
    for path in save(results).values():
        print(path, flush=True)
    os._exit(STOPPED_EXIT)




def run(config: BenchConfig, compile_cache: Path | None = None, peak_override: float | None = None,
        save_on_stop: Callable[[dict[str, Any]], dict[str, Path]] | None = None) -> dict[str, Any]:
    """Run every configured section for every family; returns the results document. With
    `save_on_stop`, a SIGTERM saves what was measured so far through it and exits (`_stopped`)."""
    device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
    nvml, nvml_note = open_nvml(device)
    env = environment(config, device, nvml.driver if nvml else None, nvml_note, peak_override)
    env["compile_cache"] = str(compile_cache) if compile_cache else "fresh (the first compile is cold)"
    results = {"schema": SCHEMA, "mode": config.mode, "config": dataclasses.asdict(config), "env": env,
               "method": stats.METHOD, "models": {}, "rows": [], "latency": [], "load": [], "compile": [],
               "acceptance": []}
    measuring: dict[str, Any] = {}
    if save_on_stop is not None:
        signal.signal(signal.SIGTERM, lambda _signum, _frame: _stopped(results, measuring, save_on_stop))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # One CPU thread for both sides: OpenMP threads spin-wait, so on a shared or small machine the
        # main thread (diffusers) and the engine's worker thread (ours) would otherwise not compare,
        # and thread CPU time would miss the work of the other intra-op threads.
        torch.set_num_threads(1)
    env["cpu_threads"] = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(prefix="sd-bench-") as tmp:
            cache = compile_cache or Path(tmp) / "compile-cache"
            if "compile" in config.sections and config.compile_backend == "inductor":
                configure_cache(cache, override=True)  # before anything compiles
            bench = Bench(config, device, Path(tmp), cache, nvml, env)
            for family_name in config.families:
                bench_family(family_name, bench, results, measuring)
    finally:
        torch.set_num_threads(threads)
    results["acceptance"] = report.acceptance(results)
    return results


def _csv(text: str | None, allowed: tuple[str, ...], what: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = sorted(set(items) - set(allowed))
    if unknown or not items:
        raise SystemExit(f"--{what}: choose from {', '.join(allowed)} (got {text!r})")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.bench", description=__doc__.split("\n\n")[0],
                                     epilog="Without a mode flag: the full run (needs CUDA).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="SD1.5, batch 1, 0 and 3 LoRAs, balanced offload only (minutes on an H100)")
    mode.add_argument("--smoke", action="store_true", help="CPU, tiny models, seconds: checks the pipeline runs")
    mode.add_argument("--cpu-proxies", action="store_true",
                      help=f"CPU, full-size models: sections {','.join(PROXY_SECTIONS)} (minutes per family)")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<gpu or cpu>/)")
    parser.add_argument("--families", help=f"comma list of {','.join(FAMILY_NAMES)} (default sd15,sdxl)")
    parser.add_argument("--dtype", choices=("fp16", "bf16", "fp32"),
                        help="compute dtype (default: the mode's, fp16 on a GPU; bf16 when Flux runs)")
    parser.add_argument("--sections", help=f"comma list of {','.join(SECTIONS)} (proxies: {','.join(PROXY_SECTIONS)})")
    parser.add_argument("--batches", help="comma list of batch sizes (default 1,4; quick and smoke 1)")
    parser.add_argument("--loras", help="comma list of LoRA counts in the speed rows (default 0,1,3; quick 0,3)")
    parser.add_argument("--no-channels-last", action="store_true",
                        help="leave the channels_last engine out of the speed pools (its own device-check section)")
    parser.add_argument("--repeats", type=int, help="ABBA rounds per comparison")
    parser.add_argument("--steps", type=int, help="denoising steps per generation")
    parser.add_argument("--step-cache", type=float, default=0.1,
                        help="the cache section's step cache threshold (default 0.1)")
    parser.add_argument("--compile-cache", type=Path, help="reuse this compile cache (default: a fresh one)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU when not in the table")
    parser.add_argument("--proxy-cache", type=Path, default=DEFAULT_PROXY_CACHE,
                        help="where --cpu-proxies keeps its random-weight checkpoints (written once)")
    parser.add_argument("--restart-probe", help=argparse.SUPPRESS)
    parser.add_argument("--load-probe", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _stem(mode: str, family_names: tuple[str, ...], default_families: tuple[str, ...], sections: tuple[str, ...],
          default_sections: tuple[str, ...]) -> str:
    stem = mode
    if family_names != default_families:
        stem += "-" + "_".join(family_names)
    if sections != default_sections:
        stem += "-" + "_".join(sections)
    return stem


def config_from_args(args: argparse.Namespace) -> tuple[BenchConfig, str]:
    """The preset with the command line's overrides, and the output file stem naming them."""
    preset = PRESETS["quick" if args.quick else "smoke" if args.smoke else "full"]
    family_names = _csv(args.families, FAMILY_NAMES, "families") or preset.families
    sections = _csv(args.sections, SECTIONS, "sections") or preset.sections
    batches = tuple(int(b) for b in _csv(args.batches, ("1", "2", "3", "4", "8"), "batches") or preset.batches)
    loras = tuple(int(n) for n in _csv(args.loras, ("0", "1", "3"), "loras") or preset.lora_counts)
    config = dataclasses.replace(preset, families=family_names, sections=sections, batches=batches, lora_counts=loras,
                                 channels_last_rows=not args.no_channels_last,
                                 repeats=args.repeats or preset.repeats, steps=args.steps or preset.steps,
                                 step_cache=args.step_cache,
                                 dtype=run_dtype(preset.dtype, family_names, args.dtype))
    stem = _stem(preset.mode, family_names, preset.families, sections, preset.sections)
    return config, stem + ("-b" + "+".join(map(str, batches)) if batches != preset.batches else "")


def proxy_config_from_args(args: argparse.Namespace) -> tuple[proxies.ProxyConfig, str]:
    default = proxies.ProxyConfig(cache_dir=args.proxy_cache)
    family_names = _csv(args.families, FAMILY_NAMES, "families") or default.families
    sections = _csv(args.sections, PROXY_SECTIONS, "sections") or default.sections
    config = dataclasses.replace(default, families=family_names, sections=sections,
                                 rounds=args.repeats or default.rounds, steps=args.steps or default.steps)
    return config, _stem("proxies", family_names, default.families, sections, default.sections)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    if args.restart_probe or args.load_probe:
        child = ours.run_restart_probe if args.restart_probe else probe.run_load_probe
        print(json.dumps(child(json.loads(args.restart_probe or args.load_probe))))
        return 0
    failed = False  # a phase of the run raised (its rows are saved all the same)
    if args.cpu_proxies:
        config, stem = proxy_config_from_args(args)
        env = base_env()
        results = proxies.run_proxies(config, env)
        paths = proxy_report.write(results, args.out or RESULTS_DIR / f"cpu-{gpu_slug(env['cpu'])}", stem)
    else:
        config, stem = config_from_args(args)
        if config.device == "cuda" and not torch.cuda.is_available():
            print(f"error: the {config.mode} benchmark needs a CUDA GPU; on this machine run --smoke or "
                  "--cpu-proxies", file=sys.stderr)
            return 2
        def save(results: dict[str, Any]) -> dict[str, Path]:
            return report.write_outputs(results, args.out or RESULTS_DIR / results["env"]["gpu_slug"], stem)

        results = run(config, args.compile_cache, args.peak_tflops, save_on_stop=save)
        paths = save(results)
        failed = any("phase_errors" in model for model in results["models"].values())
    for path in paths.values():
        print(path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
