"""The fp8-storage CPU proxy (issue 17): resting bytes and CPU time per step of the full-size
architecture stored in fp8 against the same model with every weight in the compute dtype, and three
LoRAs on fp8 layers two ways against none — in the same run, ABBA rounds with a control (see
`measure.py`):

* bypass (what the engine does): each touched layer widens its fp8 weight per forward and adds
  Σ mᵢ·Δᵢ(x) from the LoRA factors (app/adapters/bypass.py);
* fused copies (the alternative, built here by the bench on its own fp8 engine, `FusedCopies`):
  each touched layer keeps a compute-dtype copy W = widen(W_fp8) + Σ mᵢ·ΔWᵢ that its forward uses
  instead of widening; the fp8 bytes stay as they are, so removal would be exact too.

Why these stand in for the GPU rows: the bytes a model rests in are what VRAM holds (the GPU row's
peak adds activations); the per-step CPU time shows the work each path adds (one widening cast per
stored weight per step, the LoRA factors, or neither on a fused copy), without the GPU's bandwidth
gain. The two LoRA paths must draw the same picture within the compute dtype's rounding: the
section records their pixel difference.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch

from app.adapters.specs import LoraSpec
from app.engine.generate import GenerateParams
from app.engine.placement import DTYPES, iter_tensors
from app.engine.worker import Engine
from app.settings import Settings
from benchmarks import stats
from benchmarks.config import CFG_SCALE
from benchmarks.measure import Variant, control_key, fits, free_memory, measure_interleaved, with_control
from benchmarks.workload import lora_specs

CPU = torch.device("cpu")
FULL, FP8 = ("none", 0, "full weights", 1), ("none", 0, "fp8", 1)
FP8_BYPASS, FP8_FUSED = ("none", 3, "fp8 + LoRAs bypass", 1), ("none", 3, "fp8 + LoRAs fused copies", 1)
COMPARED = ((FP8, FULL), (FP8_BYPASS, FP8), (FP8_FUSED, FP8), (FP8_FUSED, FP8_BYPASS))


class FusedCopies:
    """Three LoRAs on an fp8 engine as compute-dtype copies of only the touched layers.

    Built from the engine's own bypass contributions (the same adapters, strengths and order), in
    float32 from the widened weight and cast once; then the LoRAs are taken off the engine and plain
    torch hooks put each copy in place for the layer's forward: the pre-hook runs before the engine's
    `quant.dequant` (prepended), which then finds the weight already in the compute dtype (its cast is
    a no-op), and the after-hook runs last and points the weight back at its fp8 bytes.
    """

    def __init__(self, engine: Engine, specs: list[LoraSpec]) -> None:
        started = time.perf_counter()
        engine.set_loras(specs)
        compute = engine.pipeline.compute_dtypes
        self.copies: dict[torch.nn.Module, torch.Tensor] = {}
        for (component, path), contributions in engine.lora_stack.bypassed().items():
            module = getattr(engine.pipeline, component).get_submodule(path)
            base = module.weight.detach().float()
            acc = base.clone(memory_format=torch.contiguous_format)
            for name, strength, adapter in contributions:
                if adapter.accumulate(acc, base, None, strength) is not None:
                    raise ValueError(f"{name} changes the bias of {component}.{path}; the proxy fuses weights only")
            self.copies[module] = acc.to(compute[component])
        engine.set_loras([])
        self._handles = [handle for module, copy in self.copies.items() for handle in _use_copy(module, copy)]
        self.build_ms = (time.perf_counter() - started) * 1e3

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies.values())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _use_copy(module: torch.nn.Module, copy: torch.Tensor) -> tuple:
    stash: list[torch.Tensor] = []

    def pre(mod, _args) -> None:
        stash.append(mod.weight.data)
        mod.weight.data = copy

    def after(mod, _args, _output) -> None:
        mod.weight.data = stash.pop()

    return (module.register_forward_pre_hook(pre, prepend=True),
            module.register_forward_hook(after, always_call=True))


def _engine(model, weights: str, dtype: str) -> Engine:
    engine = Engine(Settings(data_dir=model.data_dir, device="cpu", dtype=dtype, weights=weights))
    engine.load_model(model.name)
    return engine


def _resting_bytes(engine: Engine) -> int:
    return sum(t.numel() * t.element_size() for *_rest, t, _is_param in iter_tensors(engine.pipeline))


def _pixels(engine: Engine, params: GenerateParams) -> np.ndarray:
    return np.asarray(engine.generate(params)[0].image).astype(np.int16)


def fp8_section(model, config) -> dict[str, Any]:
    """Three engines loaded together (full weights, fp8, fp8 with fused copies), generations interleaved."""
    dtype = config.step_dtype
    wide = torch.empty((), dtype=DTYPES[dtype]).element_size()
    ok, why = fits(model.numel * (2 * wide + 2) + model.lora_numel * 4)  # full + 2 fp8 + copies (≤ full) + LoRAs
    if not ok:
        return {"family": model.family, "skipped": why}
    full, fp8, fused = _engine(model, "full", dtype), _engine(model, "fp8", dtype), _engine(model, "fp8", dtype)
    specs = lora_specs(model.loras, 3)
    copies = FusedCopies(fused, specs)
    try:
        side = config.resolution
        params = GenerateParams(config.prompt, steps=config.steps, cfg=CFG_SCALE, seed=config.seed, width=side,
                                height=side, sampler="Euler")
        unet = fp8.pipeline.unet
        variants = with_control({
            FULL: Variant(lambda: None, functools.partial(full.generate, params), full.pipeline.unet),
            FP8: Variant(functools.partial(fp8.set_loras, []), functools.partial(fp8.generate, params), unet),
            FP8_BYPASS: Variant(functools.partial(fp8.set_loras, specs), functools.partial(fp8.generate, params),
                                unet),
            FP8_FUSED: Variant(lambda: None, functools.partial(fused.generate, params), fused.pipeline.unet),
        }, FP8)
        bytes_full, bytes_fp8 = _resting_bytes(full), _resting_bytes(fp8)
        snap = fp8.snapshot()
        runs = measure_interleaved(variants, CPU, config.rounds, warmup=1)
        fp8.set_loras(specs)
        difference = np.abs(_pixels(fp8, params) - _pixels(fused, params))
    finally:
        copies.remove()
        for engine in (full, fp8, fused):
            engine.unload()
            engine.close()
        free_memory()
    return {"family": model.family, "dtype": dtype, "resolution": config.resolution, "steps": config.steps,
            "resting_gib": {"full": bytes_full / 2**30, "fp8": bytes_fp8 / 2**30,
                            "fp8 + fused copies": (bytes_fp8 + copies.nbytes) / 2**30},
            "resting_ratio": bytes_fp8 / bytes_full, "stored_layers": snap.stored_layers,
            "fused_copies": {"layers": len(copies.copies), "gib": copies.nbytes / 2**30, "build_ms": copies.build_ms},
            "bypass_vs_fused_pixels": {"max": int(difference.max()), "mean": float(difference.mean())},
            "comparisons": _comparisons(runs)}


def _comparisons(runs) -> list[dict[str, Any]]:
    control = runs[control_key(FP8)]
    rows = []
    for mine_key, base_key in COMPARED:
        for figure, series in (("CPU ms per step", "cpu_ms_runs"), ("it/s (wall)", "its_runs")):
            higher = series == "its_runs"
            band = stats.paired_ratios(getattr(runs[FP8], series), getattr(control, series), higher)
            mine, base = getattr(runs[mine_key], series), getattr(runs[base_key], series)
            rows.append({"ours": " / ".join(map(str, mine_key)), "baseline": " / ".join(map(str, base_key)),
                         "figure": figure, "ours_median": stats.median_interval(mine).as_dict(),
                         "baseline_median": stats.median_interval(base).as_dict(),
                         **stats.compare(mine, base, band, higher)})
    return rows
