"""One family's run, phase by phase, with our engine and a diffusers pipeline alive side by side
so every comparison runs in ABBA order: loads (each side alone, which also gives the isolated VRAM
figures), denoising speed, LoRA latency, the compiled path, offload modes, the VRAM budget."""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.engine.worker import Engine
from app.families import family
from benchmarks import ours
from benchmarks.config import Bench
from benchmarks.denoiser import denoiser_of
from benchmarks.measure import (
    Measurement,
    PeakMemory,
    Variant,
    abba,
    free_memory,
    measure_interleaved,
    timed_ms,
    with_control,
)
from benchmarks.theirs import OFFLOAD_LABELS, DiffusersSide, generator
from benchmarks.workload import PreparedModel

log = logging.getLogger("bench")
Key = tuple[str, int, str, int]  # (offload, LoRA count, variant, batch)


@dataclass(frozen=True)
class Pairing:
    """One comparison row: which measurement of ours against which baseline, in which pool (one
    interleaved measurement), and the control twin whose spread says what "no difference" means."""

    section: str
    pool: str
    ours_key: Key
    ours_label: str
    base_key: Key
    base_label: str
    control_of: Key
    note_key: str = ""


@dataclass
class FamilyRun:
    """What one family's phases measured."""

    model: PreparedModel
    tflop: dict[int, float]
    pools: dict[str, dict[Key, Measurement]] = field(default_factory=dict)
    pairings: list[Pairing] = field(default_factory=list)
    loads: dict[str, list[float]] = field(default_factory=dict)
    memory: dict[str, dict[str, float | None]] = field(default_factory=dict)
    latency: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    compile_info: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    row_fields: dict[Key, dict[str, Any]] = field(default_factory=dict)  # extra fields of the row of an ours key


def _measure(run: FamilyRun, bench: Bench, pool: str, variants: dict[Key, Variant]) -> None:
    log.info("[%s] %s: %d variants, %d ABBA rounds", run.model.family, pool, len(variants), bench.config.repeats)
    run.pools[pool] = measure_interleaved(variants, bench.device, bench.config.repeats, bench.config.warmup,
                                          bench.nvml)


# ------------------------------------------------------------------------------------ load and memory
def _isolated_memory(generate, bench: Bench, load_peak: PeakMemory) -> dict[str, float | None]:
    """VRAM of one side with nothing else resident: peak during its load and during a no-LoRA
    generation (after one warm-up generation)."""
    generate()
    with PeakMemory(bench.device, bench.nvml) as peak:
        generate()
    return {"load_torch_gib": load_peak.torch_gib, "load_nvml_gib": load_peak.nvml_gib,
            "generate_torch_gib": peak.torch_gib, "generate_nvml_gib": peak.nvml_gib}


def _load_once(side: str, engine: Engine, theirs: DiffusersSide, bench: Bench) -> tuple[float, PeakMemory]:
    """One timed load with the other side freed, so each load (and its VRAM peak) is alone."""
    if side == "diffusers":
        engine.unload()
        free_memory()
        with PeakMemory(bench.device, bench.nvml) as peak:
            seconds = theirs.load()
    else:
        theirs.free()
        engine.unload()
        free_memory()
        with PeakMemory(bench.device, bench.nvml) as peak:
            seconds = timed_ms(functools.partial(ours.load, engine, theirs.model.name), bench.device) / 1e3
    return seconds, peak


def load_phase(run: FamilyRun, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    """A warm-up load of each side (page cache, our hash facts; its VRAM figures kept), then timed loads
    in ABBA order with a control; leaves both sides loaded."""
    model = run.model
    for side in ("ours", "diffusers"):
        seconds, peak = _load_once(side, engine, theirs, bench)
        run.loads[f"{side} (first)"] = [seconds]
        generate = ours.generator(engine, model, bench, 1) if side == "ours" else theirs.generator(1)
        run.memory[side] = _isolated_memory(generate, bench, peak)
    keys = ["ours", "diffusers", "control:ours"]
    for round_index in range(bench.config.load_repeats if bench.wants("load") else 0):
        for key in abba(keys, round_index):
            seconds, _peak = _load_once("diffusers" if key == "diffusers" else "ours", engine, theirs, bench)
            run.loads.setdefault(key, []).append(seconds)
    if theirs.pipe is None:
        theirs.load()
    if engine.snapshot().model is None:
        ours.load(engine, model.name)


# ------------------------------------------------------------------------------------ speed and latency
def throughput_phase(run: FamilyRun, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    """Per batch, one pool: ours with 0/1/3 fused LoRAs, ours with `--channels-last` (a second engine,
    only where the denoiser is convolutional: Flux's transformer has no conv weight, and a third copy
    of its 34 GB pipeline would not fit), diffusers plain and with PEFT adapters unfused and fused, and
    the control (ours without LoRA, twice)."""
    model, counts = run.model, bench.config.lora_counts
    fam = family(model.family)
    wanted = bench.config.channels_last_rows and fam.denoiser in fam.conv_components
    nhwc = ours.loaded_engine(model, bench, channels_last=True) if wanted else None
    try:
        for batch in bench.config.batches:
            pool, mine = f"throughput-b{batch}", ours.generator(engine, model, bench, batch)
            none, denoiser = ("none", 0, "fused", batch), denoiser_of(engine.pipeline)
            variants = with_control({("none", n, "fused", batch): Variant(ours.lora_setup(engine, model, n), mine,
                                                                          denoiser, ours.last_timeline(engine))
                                     for n in counts}, none)
            if nhwc is not None:
                variants |= _channels_last_variants(run, nhwc, bench, pool, batch)
            base = theirs.generator(batch)
            variants[("none", 0, "eager", batch)] = Variant(theirs.state_setup(0, False), base, theirs.denoiser)
            run.pairings.append(Pairing("throughput", pool, none, "ours", ("none", 0, "eager", batch), "diffusers",
                                        none))
            for n in (c for c in counts if c and "lora" not in theirs.notes):
                for fused, label in ((False, "diffusers PEFT unfused"), (True, "diffusers PEFT fused")):
                    key = ("none", n, "peft-fused" if fused else "peft-unfused", batch)
                    variants[key] = Variant(theirs.state_setup(n, fused), base, theirs.denoiser)
                    run.pairings.append(Pairing("throughput", pool, ("none", n, "fused", batch), "ours fused", key,
                                                label, none, "lora"))
            if 3 in counts:
                run.pairings.append(Pairing("throughput", pool, ("none", 3, "fused", batch), "ours fused", none,
                                            "ours no LoRA", none))
            _measure(run, bench, pool, variants)
    finally:
        ours.close(nhwc)
    engine.set_loras([])
    theirs.to_state(0, False)


def _channels_last_variants(run: FamilyRun, nhwc: Engine, bench: Bench, pool: str, batch: int) -> dict[Key, Variant]:
    """Ours with UNet/VAE conv weights channels_last, with no LoRA and with 3 fused, each paired with
    ours contiguous in the same pool: the row that decides whether `--channels-last` becomes the CUDA
    default (an H100 profile spent 22.6% of CUDA time in cuDNN's NCHW->NHWC weight conversion)."""
    mine, variants = ours.generator(nhwc, run.model, bench, batch), {}
    for n in (c for c in (0, 3) if c in bench.config.lora_counts):
        key = ("none", n, "channels-last", batch)
        variants[key] = Variant(ours.lora_setup(nhwc, run.model, n), mine, denoiser_of(nhwc.pipeline),
                                ours.last_timeline(nhwc))
        run.pairings.append(Pairing("throughput", pool, key, "ours channels_last", ("none", n, "fused", batch),
                                    "ours fused" if n else "ours", ("none", 0, "fused", batch)))
    return variants


def latency_phase(run: FamilyRun, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    """LoRA add / re-weight / remove, ours and diffusers (PEFT unfused, and fused: unfuse, change,
    fuse), one round of each per repeat in ABBA order; re-weights in the first round only."""
    mine = functools.partial(ours.latency_round, engine, run.model, bench)
    sides = {"ours": mine, "control:ours": mine}
    if "lora" not in theirs.notes:
        sides["peft-unfused"] = functools.partial(theirs.latency_round, False)
        sides["peft-fused"] = functools.partial(theirs.latency_round, True)
    for round_index in range(bench.config.repeats):
        for side in abba(list(sides), round_index):
            times = sides[side](bench.config.reweights if round_index == 0 else 0)
            for op, values in times.items():
                run.latency.setdefault(side, {}).setdefault(op, []).extend(values)
    engine.set_loras([])
    theirs.to_state(0, False)


# ------------------------------------------------------------------------------------ fp8 storage
def _allocated_gib(bench: Bench) -> float | None:
    if bench.device.type != "cuda":
        return None
    torch.cuda.synchronize(bench.device)
    return torch.cuda.memory_allocated(bench.device) / 2**30


def fp8_phase(run: FamilyRun, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    """Ours with large weights resting in fp8 (`--weights fp8`, computed in the run's dtype), with no
    LoRA and with 3 LoRAs as bypass forwards (an 8-bit weight is never fused into), against diffusers
    eager in one pool. Our full-precision engine is unloaded first, since a third copy of a full-size
    Flux pipeline does not fit beside diffusers'; what each of our engines holds at rest is the drop
    in allocated VRAM when it unloads (None on the CPU). The last phase of a run: the main engine
    stays unloaded."""
    model = run.model
    before = _allocated_gib(bench)
    engine.unload()
    free_memory()
    after = _allocated_gib(bench)
    fp8 = ours.loaded_engine(model, bench, weights="fp8")
    try:
        loaded = _allocated_gib(bench)
        rest = {"ours full weights": None if before is None else before - after,
                "ours fp8 weights": None if loaded is None else loaded - after}
        run.memory["resting"] = {k: None if v is None else round(v, 3) for k, v in rest.items()}
        if theirs.pipe is None:  # the offload phase freed it; loaded after the resting figures are read
            theirs.load()
        key0, key3, base = ("none", 0, "fp8", 1), ("none", 3, "fp8-bypass", 1), ("none", 0, "eager", 1)
        _measure(run, bench, "fp8", _stored_weights_pool(fp8, theirs, bench, model, (key0, key3, base)))
        run.pairings += [Pairing("fp8", "fp8", key0, "ours fp8", base, "diffusers", key0),
                         Pairing("fp8", "fp8", key3, "ours fp8 + 3 LoRAs bypass", key0, "ours fp8", key0)]
    finally:
        ours.close(fp8)
    _fp8_compute_pool(run, theirs, bench)


def _stored_weights_pool(engine, theirs: DiffusersSide, bench: Bench, model, keys: tuple) -> dict:
    """One pool over an engine with stored (8-bit) weights: ours with no LoRA and with 3 as bypasses, and
    diffusers eager, keyed by `keys` (none, three, diffusers); our rows carry the timeline."""
    key0, key3, base = keys
    mine, denoiser = ours.generator(engine, model, bench, 1), denoiser_of(engine.pipeline)
    read = ours.last_timeline(engine)
    return with_control({key0: Variant(ours.lora_setup(engine, model, 0), mine, denoiser, read),
                         key3: Variant(ours.lora_setup(engine, model, 3), mine, denoiser, read),
                         base: Variant(theirs.state_setup(0, False), theirs.generator(1), theirs.denoiser)}, key0)


def _fp8_compute_pool(run: FamilyRun, theirs: DiffusersSide, bench: Bench) -> None:
    """Ours with `--weights fp8-compute` (qualifying Linear layers as fp8 matmuls, which write bf16: the
    engine computes in bf16 whatever the run's dtype) against diffusers eager, with no LoRA and with 3
    as bf16 bypasses, in a pool of its own after the fp8 engine is closed (three full-size Flux copies
    do not fit). The issue's target is 1.2× diffusers in bf16 at 1024² on a GPU with fp8 tensor cores."""
    model = run.model
    engine = ours.loaded_engine(model, bench, weights="fp8-compute", dtype="bf16")
    try:
        snap = engine.snapshot()
        run.notes["fp8 compute"] = f"{snap.matmul_layers} of {snap.stored_layers} stored layers as fp8 matmuls"
        log.info("[%s] fp8 compute: %s", model.family, run.notes["fp8 compute"])
        key0, key3 = ("none", 0, "fp8-compute", 1), ("none", 3, "fp8-compute-bypass", 1)
        base = ("none", 0, "eager", 1)
        _measure(run, bench, "fp8 compute", _stored_weights_pool(engine, theirs, bench, model, (key0, key3, base)))
        run.pairings += [Pairing("fp8", "fp8 compute", key0, "ours fp8 compute", base,
                                 f"diffusers {bench.config.dtype}", key0),
                         Pairing("fp8", "fp8 compute", key3, "ours fp8 compute + 3 LoRAs bypass", key0,
                                 "ours fp8 compute", key0)]
    finally:
        ours.close(engine)


# ------------------------------------------------------------------------------------ compiled path
def _wait_compiled(engine: Engine, timeout_s: float = 900) -> None:
    """`default` mode compiles on a helper thread: wait until the engine's snapshot says it is done."""
    deadline = time.monotonic() + timeout_s
    while engine.snapshot().compile.phase in ("compiling", "waiting") and time.monotonic() < deadline:
        time.sleep(0.5)


def compile_phase(run: FamilyRun, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    """Per mode, a second engine built with the compile settings, against our eager engine and
    diffusers eager (no LoRA), and with three LoRAs against diffusers PEFT fused. A family that compiles
    by regions (its repeated blocks, without CUDA graphs whatever the mode) is measured once, as `regional`."""
    model = run.model
    for mode in bench.config.compile_modes:
        log.info("[%s] ours: compiled engine (%s, %s)", model.family, mode, bench.config.compile_backend)
        compiled = ours.loaded_engine(model, bench, **ours.compile_settings(bench, mode))
        regional = bool(compiled.snapshot().compile.regions)
        scope = "regional" if regional else mode
        try:
            fast = ours.generator(compiled, model, bench, 1)
            first_s = timed_ms(fast, bench.device) / 1e3
            _wait_compiled(compiled)
            run.compile_info.append(_compile_info(run, compiled, bench, scope, first_s))
            _compiled_pools(run, compiled, engine, theirs, bench, scope)
        finally:
            ours.close(compiled)
        if regional:
            break


def _compile_info(run: FamilyRun, compiled: Engine, bench: Bench, scope: str, first_s: float) -> dict[str, Any]:
    status = compiled.snapshot().compile
    info = {"family": run.model.family, "mode": scope, "backend": status.backend, "phase": status.phase,
            "regions": list(status.regions),
            "first_generation_s": first_s, "first_compile_s": next((s for _l, s in status.compile_seconds), None),
            "compiles_after_warm": status.compiles, "note": status.note}
    info.update(ours.lora_ops_check(compiled, run.model, bench))
    compiled.set_loras([])
    return info


def _compiled_pools(run: FamilyRun, compiled: Engine, engine: Engine, theirs: DiffusersSide, bench: Bench,
                    mode: str) -> None:
    """`mode`: the compile mode, or `regional`; the pools and rows are named by it."""
    model, label, variant = run.model, f"ours compiled ({mode})", f"compiled-{mode}"
    fast, key0, key3 = ours.generator(compiled, model, bench, 1), ("none", 0, variant, 1), ("none", 3, variant, 1)
    variants = with_control({
        key0: Variant(ours.lora_setup(compiled, model, 0), fast, denoiser_of(compiled.pipeline),
                      ours.last_timeline(compiled)),
        ("none", 0, "fused", 1): Variant(ours.lora_setup(engine, model, 0), ours.generator(engine, model, bench, 1),
                                         denoiser_of(engine.pipeline)),
        ("none", 0, "eager", 1): Variant(theirs.state_setup(0, False), theirs.generator(1), theirs.denoiser)}, key0)
    _measure(run, bench, f"compile-{mode}", variants)
    run.pairings += [Pairing("compile", f"compile-{mode}", key0, label, ("none", 0, "eager", 1), "diffusers", key0),
                     Pairing("compile", f"compile-{mode}", key0, label, ("none", 0, "fused", 1), "ours eager", key0)]
    if "lora" not in theirs.notes:
        base = ("none", 3, "peft-fused", 1)
        _measure(run, bench, f"compile-{mode}-lora", with_control({
            key3: Variant(ours.lora_setup(compiled, model, 3), fast, denoiser_of(compiled.pipeline),
                          ours.last_timeline(compiled)),
            base: Variant(theirs.state_setup(3, True), theirs.generator(1), theirs.denoiser)}, key3))
        run.pairings.append(Pairing("compile", f"compile-{mode}-lora", key3, label, base, "diffusers PEFT fused",
                                    key3, "lora"))
    if bench.config.restart_probe:
        its = statistics.median(run.pools[f"compile-{mode}"][key0].its_runs)
        run.compile_info[-1].update(ours.restart_probe(model, compiled.snapshot().compile.mode, its, bench))
    theirs.to_state(0, False)


# ------------------------------------------------------------------------------------ offload
def offload_phase(run: FamilyRun, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    """Each offload mode against its diffusers counterpart (a fresh diffusers pipeline per mode), and
    balanced against our own `none`. The main diffusers pipeline is freed first: balanced offload
    sizes itself by the VRAM it finds free."""
    theirs.free()
    model = run.model
    generate, warm = ours.generator(engine, model, bench, 1), ours.generator(engine, model, bench, 1, steps=2)
    for case in bench.config.offload_cases:
        pool, mine = f"offload-{case}", (case, 0, "fused", 1)
        if case == "balanced":
            none = ("none", 0, "beside-balanced", 1)
            _measure(run, bench, pool, with_control({
                mine: Variant(ours.offload_setup(engine, case, warm), generate, denoiser_of(engine.pipeline)),
                none: Variant(ours.offload_setup(engine, "none", warm), generate, denoiser_of(engine.pipeline))}, none))
            run.pairings.append(Pairing("offload", pool, mine, "ours", none, "ours offload none", none))
        elif case != "balanced-3gib":  # a start-up setting: measured on its own engine by budget_phase
            variants = {mine: Variant(ours.offload_setup(engine, case, warm), generate, denoiser_of(engine.pipeline))}
            _offload_pool(run, bench, pool, theirs, case, variants, mine)
    engine.set_offload("none")


def _offload_pool(run: FamilyRun, bench: Bench, pool: str, theirs: DiffusersSide, case: str,
                  variants: dict[Key, Variant], mine: Key) -> None:
    """Ours (`variants`) against diffusers' offload `case` on a fresh pipeline, or ours alone with the
    reason diffusers' counterpart could not run."""
    pipe = theirs.offload_pipeline(case)
    base, failed = (case, 0, "diffusers", 1), None
    try:
        if pipe is not None:
            variants[base] = Variant(lambda: None, _baseline(generator(pipe, run.model, bench, 1)), denoiser_of(pipe))
        _measure(run, bench, pool, with_control(variants, mine))
    except BaselineFailed as exc:  # a message, not the exception: its traceback holds the pipeline
        failed = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
    finally:
        del pipe
        free_memory()
    if failed is not None:  # the row says why; ours is measured alone, the VRAM diffusers held freed
        theirs.notes[f"offload:{case}"] = f"diffusers {OFFLOAD_LABELS[case]} failed while generating: {failed}"[:300]
        log.warning("[%s] %s", run.model.family, theirs.notes[f"offload:{case}"])
        del variants[base]
        _measure(run, bench, pool, with_control(variants, mine))
    label = f"diffusers {case} offload"
    run.pairings.append(Pairing("offload", pool, mine, "ours", base, label, mine, f"offload:{case}"))


class BaselineFailed(Exception):
    """diffusers' side raised while generating (its cause): a finding about diffusers for the row's note."""


def _baseline(generate: Callable[[], Any]) -> Callable[[], Any]:
    def call():
        try:
            return generate()
        except Exception as exc:
            raise BaselineFailed from exc
    return call


def budget_phase(run: FamilyRun, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    """Balanced offload under a VRAM budget (a start-up setting, so its own engine) against diffusers'
    model offload, with our main engine unloaded so the budget engine runs alone."""
    model = run.model
    engine.unload()
    budget = ours.loaded_engine(model, bench, offload="balanced", vram_budget_gib=bench.config.budget_gib)
    try:
        mine = ("balanced-3gib", 0, "fused", 1)
        variants = {mine: Variant(lambda: None, ours.generator(budget, model, bench, 1), denoiser_of(budget.pipeline))}
        _offload_pool(run, bench, "offload-balanced-3gib", theirs, "model", variants, mine)
    finally:
        ours.close(budget)
