"""What a benchmark run varies (`BenchConfig` and its presets) and the run's shared context."""

from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import psutil
import torch

from app.engine import compiled
from app.engine.placement import DTYPES
from app.families import FAMILIES, family

SCHEMA = "steady-diffusion-bench/2"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SECTIONS = ("load", "throughput", "latency", "fp8", "offload", "compile", "cache", "controlnet", "gguf")
# what --families takes: every family that states how it is benched (`TestKit.bench`); a full run without it does
# SD1.5 and SDXL
FAMILY_NAMES = tuple(name for name, fam in FAMILIES.items() if fam.test_kit.bench)
OFFLOAD_CASES = ("model", "balanced", "balanced-3gib", "sequential", "group")
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED = 1234
CFG_SCALE = 7.0  # SD's classifier-free guidance; other families run their own default (`guidance`)
# Dense bf16 tensor-core peaks (TFLOP/s, FP32 accumulate, no sparsity), by device-name substring;
# the first match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 NVL", 835.5), ("H100 PCIe", 756.5), ("H100", 989.4), ("H200 NVL", 835.5), ("H200", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.1), ("RTX 4090", 165.2), ("A10G", 70.0),
)


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run varies; the presets below are the three modes.

    `repeats` is the number of timed rounds; each round runs every variant once, in forward order on
    even rounds and reversed on odd ones (ABBA), so an even count gives every variant the same mean
    position in time.
    """

    mode: str
    families: tuple[str, ...]
    sections: tuple[str, ...]
    batches: tuple[int, ...]
    steps: int
    repeats: int
    warmup: int
    lora_rank: int
    lora_counts: tuple[int, ...]
    offload_cases: tuple[str, ...]
    compile_modes: tuple[str, ...]
    compile_backend: str
    reweights: int
    load_repeats: int
    restart_probe: bool
    dtype: str
    device: str
    tiny: bool
    resolution: dict[str, int] = field(default_factory=lambda: {a: family(a).test_kit.bench.side for a in FAMILY_NAMES})
    budget_gib: float = 3.0
    budget_families: tuple[str, ...] = ("sd15",)
    channels_last_rows: bool = True  # the throughput pools' `--channels-last` engine, where the denoiser has convs
    step_cache: float = 0.1  # the cache section's threshold (`--step-cache`)


PRESETS = {
    "full": BenchConfig("full", ("sd15", "sdxl"), SECTIONS, (1, 4), 20, 6, 1, 64, (0, 1, 3), OFFLOAD_CASES,
                        compiled.COMPILE_MODES, "inductor", 10, 4, True, "fp16", "cuda", False),
    "quick": BenchConfig("quick", ("sd15",), SECTIONS, (1,), 20, 6, 1, 64, (0, 3), ("balanced",),
                         ("reduce-overhead",), "inductor", 10, 2, False, "fp16", "cuda", False),
    # CPU smoke: tiny models, 2 steps, the eager dynamo backend; the numbers mean nothing, the schema
    # and every code path are the same.
    "smoke": BenchConfig("smoke", ("sd15", "sdxl"), SECTIONS, (1,), 2, 2, 0, 4, (0, 1, 3), OFFLOAD_CASES,
                         ("reduce-overhead",), "eager", 3, 2, False, "fp32", "cpu", True,
                         dict.fromkeys(FAMILY_NAMES, 64)),
}


@dataclass
class Bench:
    """One run's shared context (`nvml` is a `measure.Nvml` or None)."""

    config: BenchConfig
    device: torch.device
    tmp: Path
    compile_cache: Path
    nvml: Any
    env: dict[str, Any]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.config.dtype]

    def wants(self, section: str) -> bool:
        return section in self.config.sections


def run_dtype(preset_dtype: str, family_names: tuple[str, ...], asked: str | None) -> str:
    """The compute dtype of a run: the one asked for, else the preset's, except that a preset's fp16
    becomes bf16 when a family computes in bf16 only (Flux overflows fp16), so
    `--families flux-dev` runs as its users run it. Asking for fp16 with such a family is refused."""
    refuses = [family_name for family_name in family_names if not family(family_name).precision.fp16_ok]
    if asked == "fp16" and refuses:
        raise SystemExit(f"--dtype fp16: {', '.join(refuses)} overflows in fp16; use bf16 (the default for it)")
    if asked:
        return asked
    return "bf16" if preset_dtype == "fp16" and refuses else preset_dtype


def guidance(family_name: str) -> float:
    """The guidance value both sides pass, in the CFG field's meaning (`Family.call_arguments` maps it
    to each pipeline's call): the family's own default, as its model card runs it: SD's CFG 7
    (`CFG_SCALE`), Flux dev's distilled 3.5, a distilled model's 1 (no CFG)."""
    return family(family_name).sampling.default_guidance


def runs_cfg(family_name: str) -> bool:
    """Does a generation at `guidance(family)` run the unconditional pass too (a CFG-doubled batch)?"""
    return family(family_name).sampling.negative_prompt and guidance(family_name) > 1


def has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def peak_tflops(gpu_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key.lower() in gpu_name.lower()), None)


def cpu_name() -> str:
    """The CPU's model name and core count, e.g. "AMD EPYC, 2 cores" (what CPU-proxy results are named by)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores"


def base_environment() -> dict[str, Any]:
    """Versions and the host, written into every result so a figure can be traced to its setup."""
    return {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
            "python": platform.python_version(), "cpu": cpu_name(),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1)}


def environment(config: BenchConfig, device: torch.device, driver: str | None, nvml_note: str,
                peak_override: float | None) -> dict[str, Any]:
    """The base environment plus the device, its peak and what this run's baseline rows depend on."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {**base_environment(), "device": str(device), "gpu": gpu, "gpu_slug": gpu_slug(gpu),
            "peak_bf16_tflops": peak_override or (peak_tflops(gpu) if device.type == "cuda" else None),
            "driver": driver, "nvml_note": nvml_note, "accelerate": has_package("accelerate"),
            "peft": has_package("peft"), "dtype": config.dtype, "compile_backend": config.compile_backend}
