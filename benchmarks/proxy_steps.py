"""The in-process CPU proxies: UNet ops and CPU time per step without and with fused LoRAs, and the
LoRA add / re-weight / remove time and costs, on the full-size architectures (see `proxies.py` for the
run around them)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from diffusers import EulerDiscreteScheduler

from app.engine.generate import GenerateParams
from app.engine.placement import DTYPES
from app.engine.worker import Engine
from app.families import family
from app.settings import Settings
from benchmarks import stats
from benchmarks.config import CFG_SCALE
from benchmarks.measure import (
    OpCounter,
    Variant,
    control_key,
    fits,
    free_memory,
    measure_interleaved,
    timed_ms,
    with_control,
)
from benchmarks.mutation_costs import counting
from benchmarks.workload import lora_specs

CPU = torch.device("cpu")
NONE, FUSED, DIFFUSERS = ("none", 0, "ours", 1), ("none", 3, "ours fused", 1), ("none", 0, "diffusers", 1)


def _engine(model, dtype: str) -> Engine:
    engine = Engine(Settings(data_dir=model.data_dir, device="cpu", dtype=dtype))
    engine.load_model(model.name)
    engine.pipeline.set_progress_bar_config(disable=True)
    return engine


def _diffusers(model, config, shared=None):
    """diffusers' own pipeline from the same file, with the sampler ours uses; or, where two copies
    do not fit in RAM, its pipeline class on `shared` (our pipeline's modules: the same weights, no
    copy), so the comparison is of the call paths around identical modules."""
    fam = family(model.family)
    if shared is None:
        pipe = fam.plain_pipeline_class.from_single_file(
            str(model.path), config=str(fam.files.config_dir), dtype=DTYPES[config.step_dtype], local_files_only=True,
            **fam.tokenizers(), **fam.pipeline_kwargs)
    else:
        expected, _optional = fam.plain_pipeline_class._get_signature_keys(fam.plain_pipeline_class)
        pipe = fam.plain_pipeline_class(**{k: v for k, v in shared.components.items() if k in expected})
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    side = config.resolution

    def generate():
        return pipe(prompt=config.prompt, num_inference_steps=config.steps, guidance_scale=CFG_SCALE, width=side,
                    height=side, generator=torch.Generator("cpu").manual_seed(config.seed), output_type="pil")

    return pipe, generate


def count_ops(variant: Variant) -> dict[str, float]:
    """aten ops per UNet call over one (untimed) generation in the variant's configuration."""
    variant.setup()
    counter = OpCounter(variant.unet)
    try:
        variant.generate()
    finally:
        counter.remove()
    return counter.per_call()


def _step_variants(engine: Engine, model, config, fused: bool) -> dict[tuple, Variant]:
    side = config.resolution
    params = GenerateParams(config.prompt, steps=config.steps, cfg=CFG_SCALE, seed=config.seed, width=side,
                            height=side, sampler="Euler")
    generate, unet = functools.partial(engine.generate, params), engine.pipeline.unet
    variants = {NONE: Variant(functools.partial(engine.set_loras, []), generate, unet)}
    if fused:
        variants[FUSED] = Variant(functools.partial(engine.set_loras, lora_specs(model.loras, 3)), generate, unet)
    return with_control(variants, NONE)


def step_section(model, config) -> dict[str, Any]:
    """Ours without and with three fused LoRAs (the fused variant where RAM holds their backups too)
    and diffusers (its own copy where RAM holds both pipelines, else on our modules): ops per UNet
    call, thread CPU ms and wall it/s per step, ABBA rounds with a control."""
    itemsize = DTYPES[config.step_dtype].itemsize
    ok, why = fits(model.numel * itemsize)
    if not ok:
        return {"family": model.family, "skipped": why}
    fused, fused_note = fits((model.numel + model.lora_numel) * itemsize)
    own_copy, _ = fits((2 * model.numel + model.lora_numel * fused) * itemsize)
    baseline_note = "" if own_copy else "diffusers' pipeline class on our modules (two copies do not fit in RAM)"
    engine = _engine(model, config.step_dtype)
    pipe = None
    try:
        variants = _step_variants(engine, model, config, fused)
        pipe, generate = _diffusers(model, config, None if own_copy else engine.pipeline)
        # On shared modules, diffusers' turn starts from the checkpoint's weights too.
        variants[DIFFUSERS] = Variant(lambda: None if own_copy else engine.set_loras([]), generate, pipe.unet)
        ops = {key: count_ops(v) for key, v in variants.items() if key != control_key(NONE)}
        runs = measure_interleaved(variants, CPU, config.rounds, warmup=1)
    finally:
        engine.unload()
        engine.close()
        del pipe
        free_memory()
    return {"family": model.family, "resolution": config.resolution, "steps": config.steps, "dtype": config.step_dtype,
            "baseline_note": baseline_note, "fused_note": "" if fused else f"3 fused LoRAs skipped: {fused_note}",
            "ops": ops_summary(ops),
            "runs": {" / ".join(map(str, k)): {"its": r.its_runs, "cpu_ms": r.cpu_ms_runs, "user_ms": r.user_ms_runs,
                                                "faults": r.faults_runs} for k, r in runs.items()},
            "comparisons": _step_comparisons(runs)}


def ops_summary(ops: dict[tuple, dict[str, float]]) -> dict[str, Any]:
    reference = ops[NONE]
    return {" / ".join(map(str, key)): {"total_per_call": sum(counts.values()), "distinct": len(counts),
                                         "same_as_ours_no_lora": counts == reference,
                                         "differences": {op: [reference.get(op, 0), n] for op, n in counts.items()
                                                         if reference.get(op, 0) != n}}
            for key, counts in ops.items()}


def _step_comparisons(runs) -> list[dict[str, Any]]:
    control_runs = runs[control_key(NONE)]
    rows = []
    for mine_key, base_key in ((FUSED, NONE), (NONE, DIFFUSERS)):
        if mine_key not in runs or base_key not in runs:
            continue
        mine, base = runs[mine_key], runs[base_key]
        for figure, series, higher in (("it/s (wall)", "its_runs", True), ("CPU ms per step", "cpu_ms_runs", False),
                                       ("user CPU ms per step", "user_ms_runs", False),
                                       ("page faults per step", "faults_runs", False)):
            control = stats.paired_ratios(getattr(runs[NONE], series), getattr(control_runs, series), higher)
            rows.append({"ours": " / ".join(map(str, mine_key)), "baseline": " / ".join(map(str, base_key)),
                         "figure": figure, "ours_median": stats.median_interval(getattr(mine, series)).as_dict(),
                         "baseline_median": stats.median_interval(getattr(base, series)).as_dict(),
                         **stats.compare(getattr(mine, series), getattr(base, series), control, higher)})
    return rows


def _mutations(model, reweights: int) -> list[tuple[str, list]]:
    """A third LoRA (the LoCon, which also covers the convs) added on top of two, its strength moved
    `reweights` times, removed: what a user's slider does, as `ours.latency_round` runs it on a GPU."""
    ops = [("add", lora_specs(model.loras, 3))]
    ops += [("reweight", lora_specs(model.loras, 3, 1.1 - i % 2 / 10)) for i in range(reweights)]
    return ops + [("remove", lora_specs(model.loras, 2))]


def reweight_section(model, config) -> dict[str, Any]:
    """LoRA add / re-weight / remove of the third of three rank-64 LoRAs, in storage dtype: the engine's
    whole transition (wall ms) and the patching alone (the engine's `patch` timer), over two rounds; then,
    from one counted (untimed) round, what each change costs besides its math and an accelerator pays
    where a CPU hides it (`benchmarks/mutation_costs.py`): host syncs, walks over every tensor, aten ops
    (about one kernel launch each), layers written, originals read from backups (what crosses PCIe per
    change when backups rest in host memory, `--lora-backups cpu`) and bytes that did cross here."""
    ok, why = fits((model.numel + model.lora_numel) * DTYPES[config.storage_dtype].itemsize)
    if not ok:
        return {"family": model.family, "skipped": why}
    engine = _engine(model, config.storage_dtype)
    wall: dict[str, list[float]] = {}
    patch: dict[str, list[float]] = {}
    counts: dict[str, dict[str, int]] = {}
    try:
        engine.set_loras(lora_specs(model.loras, 2))
        for _round in range(2):
            for op, specs in _mutations(model, max(1, config.reweights // 2)):
                wall.setdefault(op, []).append(timed_ms(functools.partial(engine.set_loras, specs), CPU))
                patch.setdefault(op, []).append(engine.snapshot().timers["patch"].last_s * 1e3)
        for op, specs in _mutations(model, 1):
            with counting() as costs:
                engine.set_loras(specs)
            counts[op] = dataclasses.asdict(costs)
    finally:
        engine.unload()
        engine.close()
        free_memory()
    return {"family": model.family, "dtype": config.storage_dtype, "loras": 3, "rank": config.lora_rank,
            "ms": {op: stats.median_interval(runs).as_dict() for op, runs in wall.items()}, "ms_runs": wall,
            "patch_ms": {op: stats.median_interval(runs).as_dict() for op, runs in patch.items()},
            "patch_ms_runs": patch, "costs": counts}
