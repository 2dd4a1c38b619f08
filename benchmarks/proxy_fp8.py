"""The fp8-storage CPU proxy (issue 17): resting bytes and CPU time per step of the full-size
architecture stored in fp8 against the same model with every weight in the compute dtype, and the
cost of three LoRAs applied as bypasses on fp8 layers against none — in the same run, ABBA rounds
with a control (see `measure.py`).

Why these stand in for the GPU rows: the bytes a model rests in are what VRAM holds (the GPU row's
peak adds activations); the per-step CPU time shows the work the fp8 path adds (one widening cast
per stored weight per step, and the LoRA factors), without the GPU's bandwidth gain.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from app.engine.generate import GenerateParams
from app.engine.placement import iter_tensors
from app.engine.worker import Engine
from app.settings import Settings
from benchmarks import stats
from benchmarks.config import CFG_SCALE
from benchmarks.measure import Variant, control_key, fits, free_memory, measure_interleaved, with_control
from benchmarks.workload import lora_specs

CPU = torch.device("cpu")
FULL, FP8, FP8_LORAS = ("none", 0, "full weights", 1), ("none", 0, "fp8", 1), ("none", 3, "fp8 + LoRAs", 1)


def _engine(model, weights: str, dtype: str) -> Engine:
    engine = Engine(Settings(data_dir=model.data_dir, device="cpu", dtype=dtype, weights=weights))
    engine.load_model(model.name)
    return engine


def _resting_bytes(engine: Engine) -> int:
    return sum(t.numel() * t.element_size() for *_rest, t, _is_param in iter_tensors(engine.pipeline))


def fp8_section(model, config) -> dict[str, Any]:
    """Both engines loaded together (a full one and an fp8 one), generations interleaved."""
    dtype = config.step_dtype
    ok, why = fits(model.numel * 3 + model.lora_numel * 4)  # bf16 model + fp8 model + LoRAs
    if not ok:
        return {"arch": model.arch, "skipped": why}
    full, fp8 = _engine(model, "full", dtype), _engine(model, "fp8", dtype)
    try:
        side = config.resolution
        params = GenerateParams(config.prompt, steps=config.steps, cfg=CFG_SCALE, seed=config.seed, width=side,
                                height=side, sampler="Euler")
        unet = fp8.pipeline.unet
        variants = with_control({
            FULL: Variant(lambda: None, functools.partial(full.generate, params), full.pipeline.unet),
            FP8: Variant(functools.partial(fp8.set_loras, []), functools.partial(fp8.generate, params), unet),
            FP8_LORAS: Variant(functools.partial(fp8.set_loras, lora_specs(model.loras, 3)),
                               functools.partial(fp8.generate, params), unet),
        }, FP8)
        bytes_full, bytes_fp8 = _resting_bytes(full), _resting_bytes(fp8)
        snap = fp8.snapshot()
        runs = measure_interleaved(variants, CPU, config.rounds, warmup=1)
    finally:
        for engine in (full, fp8):
            engine.unload()
            engine.close()
        free_memory()
    return {"arch": model.arch, "dtype": dtype, "resolution": config.resolution, "steps": config.steps,
            "resting_gib": {"full": bytes_full / 2**30, "fp8": bytes_fp8 / 2**30},
            "resting_ratio": bytes_fp8 / bytes_full, "stored_layers": snap.stored_layers,
            "comparisons": _comparisons(runs)}


def _comparisons(runs) -> list[dict[str, Any]]:
    control = runs[control_key(FP8)]
    rows = []
    for mine_key, base_key in ((FP8, FULL), (FP8_LORAS, FP8)):
        for figure, series in (("CPU ms per step", "cpu_ms_runs"), ("it/s (wall)", "its_runs")):
            higher = series == "its_runs"
            band = stats.paired_ratios(getattr(runs[FP8], series), getattr(control, series), higher)
            mine, base = getattr(runs[mine_key], series), getattr(runs[base_key], series)
            rows.append({"ours": " / ".join(map(str, mine_key)), "baseline": " / ".join(map(str, base_key)),
                         "figure": figure, "ours_median": stats.median_interval(mine).as_dict(),
                         "baseline_median": stats.median_interval(base).as_dict(),
                         **stats.compare(mine, base, band, higher)})
    return rows
