"""Benchmark: Steady Diffusion's engine against plain diffusers, side by side in one process.

What it measures per architecture (SD1.5 at 512², SDXL at 1024²; random weights, because speed does
not depend on weight values), as medians over repeats after warm-up:

* denoising speed (it/s) at batch 1 and 4 with no LoRA and with 1 and 3 rank-64 LoRAs (attention +
  feed-forward; the third is a LoCon that also covers the resnet convs): ours, fused in place,
  against diffusers' PEFT adapters unfused and fused;
* each offload mode against its diffusers counterpart (model, sequential and group offload; our
  balanced mode against our `none` with ample VRAM, and against model offload under a 3 GiB budget);
* LoRA add / re-weight / remove latency, model load time, peak VRAM (torch allocator and NVML);
* the compiled UNet (`app.engine.compiled`): first-compile time, speed against diffusers eager,
  compiles and CUDA-graph recordings across LoRA changes, time for a restarted process to reach
  compiled speed from the caches;
* the physical limit: UNet TFLOP per denoising step (torch's FlopCounterMode on a meta-device copy,
  classifier-free guidance included) and the fraction of the GPU's dense bf16 peak each row reaches.

How it is timed: it/s comes from hooks on the UNet (CUDA events on a GPU), from the start of the first
UNet call to the end of the last, so prompt encoding and VAE decode stay outside the figure and an
offload mode's UNet transfers inside it; whole-generation wall time is reported beside it. A ratio
is always "ours relative to the baseline, > 1 means ours is better": speed ours/baseline, time
baseline/ours. Ours runs through the public Engine API, diffusers the way its users call it. The two
never share the GPU: each side is measured alone and freed before the other starts.

Modes: full (CUDA), --quick (CUDA: SD1.5, batch 1, 0 and 3 LoRAs, balanced offload, the compiled
path; about 3 min on an H100), --smoke (CPU, tiny models, the eager dynamo backend; same code and
schema, the numbers mean nothing; used by a test). A full run takes well over half an hour (SDXL
sequential offload alone runs at well under 1 it/s), so split it with --archs, --sections and
--batches; each part writes its own files. Output: <stem>.json, <stem>.md and <stem>.png under
benchmarks/results/<gpu>/ (or --out), the stem naming the mode and any restriction.

    python -m app.bench --quick
    python -m app.bench --archs sd15 --sections compile
    python benchmarks/bench.py --archs sdxl --sections throughput,latency --batches 1
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the `app` package importable
    sys.path.insert(0, str(ROOT))
os.environ["HF_HUB_OFFLINE"] = "1"  # before any Hugging Face import, as in app/engine/models.py

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import diffusers  # noqa: E402
import torch  # noqa: E402
from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # noqa: E402

from app.adapters.specs import LoraSpec  # noqa: E402
from app.demo import DIFFUSERS_CLASSES, build_tiny_pipeline  # noqa: E402
from app.engine import compiled  # noqa: E402
from app.engine.compile_cache import configure_cache  # noqa: E402
from app.engine.generate import GenerateParams  # noqa: E402
from app.engine.placement import DTYPES  # noqa: E402
from app.engine.worker import Engine  # noqa: E402
from app.families import family  # noqa: E402
from app.settings import Settings  # noqa: E402

log = logging.getLogger("bench")

SCHEMA = "steady-diffusion-bench/1"
RESULTS_DIR = ROOT / "benchmarks" / "results"
SECTIONS = ("load", "throughput", "latency", "offload", "compile")
OFFLOAD_CASES = ("model", "balanced", "balanced-3gib", "sequential", "group")
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED = 1234
CFG_SCALE = 7.0
# Dense bf16 tensor-core peaks (TFLOP/s, FP32 accumulate, no sparsity), by device-name substring;
# the first match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 NVL", 835.5), ("H100 PCIe", 756.5), ("H100", 989.4), ("H200 NVL", 835.5), ("H200", 989.4),
    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.1), ("RTX 4090", 165.2), ("A10G", 70.0),
)


# ------------------------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class BenchConfig:
    """Everything a run varies; the presets below are the three modes."""

    mode: str
    archs: tuple[str, ...]
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
    resolution: dict[str, int] = field(default_factory=lambda: {"sd15": 512, "sdxl": 1024})
    budget_gib: float = 3.0
    budget_archs: tuple[str, ...] = ("sd15",)


PRESETS = {
    "full": BenchConfig("full", ("sd15", "sdxl"), SECTIONS, (1, 4), 20, 5, 1, 64, (0, 1, 3), OFFLOAD_CASES,
                        compiled.COMPILE_MODES, "inductor", 10, 3, True, "fp16", "cuda", False),
    "quick": BenchConfig("quick", ("sd15",), SECTIONS, (1,), 20, 5, 1, 64, (0, 3), ("balanced",),
                         ("reduce-overhead",), "inductor", 10, 1, False, "fp16", "cuda", False),
    # CPU smoke: tiny models, 2 steps, the eager dynamo backend; the numbers mean nothing, the schema
    # and every code path are the same.
    "smoke": BenchConfig("smoke", ("sd15", "sdxl"), SECTIONS, (1,), 2, 2, 0, 4, (0, 1, 3), OFFLOAD_CASES,
                         ("reduce-overhead",), "eager", 3, 1, False, "fp32", "cpu", True, {"sd15": 64, "sdxl": 64}),
}


@dataclass
class Bench:
    """One run's shared context."""

    config: BenchConfig
    device: torch.device
    tmp: Path
    compile_cache: Path
    nvml: Nvml | None
    env: dict[str, Any]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.config.dtype]

    def wants(self, section: str) -> bool:
        return section in self.config.sections


def has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall time of `fn` with the GPU drained before and after, in milliseconds."""
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - started) * 1e3


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------ environment
class Nvml:
    """NVML's view of one GPU: device-wide used memory (CUDA context and other processes included)."""

    def __init__(self, device: torch.device) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._pynvml = pynvml
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        try:
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:  # older torch without a uuid, or a MIG slice: fall back to the index
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        driver = pynvml.nvmlSystemGetDriverVersion()
        self.driver = driver.decode() if isinstance(driver, bytes) else driver

    def used_bytes(self) -> int:
        return int(self._pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)


def open_nvml(device: torch.device) -> tuple[Nvml | None, str]:
    """NVML where it works; its absence only costs the NVML peak column, so it is reported, not fatal."""
    if device.type != "cuda":
        return None, "no CUDA device"
    try:
        return Nvml(device), ""
    except Exception as exc:  # noqa: BLE001 - pynvml raises its own error types, or the import fails
        return None, f"NVML unavailable: {exc}"


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def peak_tflops(gpu_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key.lower() in gpu_name.lower()), None)


def environment(config: BenchConfig, device: torch.device, nvml: Nvml | None, nvml_note: str,
                peak_override: float | None) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device), "gpu": gpu, "gpu_slug": gpu_slug(gpu),
        "peak_bf16_tflops": peak_override or (peak_tflops(gpu) if device.type == "cuda" else None),
        "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
        "python": platform.python_version(), "driver": nvml.driver if nvml else None, "nvml_note": nvml_note,
        "accelerate": has_package("accelerate"), "peft": has_package("peft"),
        "dtype": config.dtype, "compile_backend": config.compile_backend,
    }


# ------------------------------------------------------------------------------------ measuring
class StepTimer:
    """Times the denoising loop from hooks on the UNet: start of its first call to end of its last.

    The pre-hook is prepended so it runs before any offload hook that moves the UNet in. On a GPU the
    marks are CUDA events (no synchronisation inside the loop); on the CPU, perf_counter. With
    `capture`, the first image's output of the last call is kept (a device copy, no sync) so a caller
    can tell whether a LoRA change reached the output.
    """

    def __init__(self, unet: torch.nn.Module, device: torch.device, capture: bool = False) -> None:
        self._cuda = device.type == "cuda"
        self._capture = capture
        self._marks: list = []
        self.last_output: torch.Tensor | None = None
        self._handles = [unet.register_forward_pre_hook(self._before, prepend=True),
                         unet.register_forward_hook(self._after)]

    def _stamp(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _before(self, _module, _args) -> None:
        self._marks.append(self._stamp())

    def _after(self, _module, _args, output) -> None:
        self._marks.append(self._stamp())
        if self._capture:
            sample = output[0] if isinstance(output, (tuple, list)) else output.sample
            self.last_output = sample[:1].detach().clone()

    def reset(self) -> None:
        self._marks.clear()

    def its(self) -> float:
        """UNet calls per second over the marked span (one call per step: CFG runs batched)."""
        calls = len(self._marks) // 2
        if calls == 0:
            raise RuntimeError("the UNet was not called during the measured generation")
        if self._cuda:
            self._marks[-1].synchronize()
            seconds = self._marks[0].elapsed_time(self._marks[-1]) / 1e3
        else:
            seconds = self._marks[-1] - self._marks[0]
        return calls / seconds

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class PeakMemory:
    """Peak VRAM over a block: the torch allocator's peak and NVML's device-wide used memory, the
    latter sampled every 10 ms on a helper thread (NVML has no peak counter). None on the CPU."""

    def __init__(self, device: torch.device, nvml: Nvml | None) -> None:
        self._device, self._nvml = device, nvml
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml_peak = 0
        self.torch_gib: float | None = None
        self.nvml_gib: float | None = None

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._nvml_peak = max(self._nvml_peak, self._nvml.used_bytes())

    def __enter__(self) -> PeakMemory:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        if self._nvml is not None:
            self._nvml_peak = self._nvml.used_bytes()
            self._thread = threading.Thread(target=self._sample, name="nvml-peak", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            self.torch_gib = torch.cuda.max_memory_allocated(self._device) / 2**30
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvml_peak = max(self._nvml_peak, self._nvml.used_bytes())
            self.nvml_gib = self._nvml_peak / 2**30


@dataclass
class Measurement:
    """Repeated generations of one configuration."""

    its_runs: list[float]
    gen_s_runs: list[float]
    peak_torch_gib: float | None
    peak_nvml_gib: float | None

    @property
    def its(self) -> float | None:
        return median(self.its_runs)

    @property
    def gen_s(self) -> float | None:
        return median(self.gen_s_runs)


def measure(generate: Callable[[], Any], unet: torch.nn.Module, bench: Bench) -> Measurement:
    """Warm up, then time `repeats` generations; peak memory covers the timed ones only."""
    return measure_interleaved({None: (lambda: None, generate)}, unet, bench)[None]


def measure_interleaved(variants: dict[Any, tuple[Callable[[], Any], Callable[[], Any]]], unet: torch.nn.Module,
                        bench: Bench) -> dict[Any, Measurement]:
    """Measure configurations of one engine against each other, round-robin: each repeat runs every
    variant's setup (untimed: a LoRA change, an offload switch and its warm-up), then its timed
    generation. Clock and thermal drift over minutes then hit every variant alike, where measuring
    one after the other turned it into a ratio (two identical runs differed by 10% on an H100)."""
    runs: dict[Any, tuple[list[float], list[float], list[float | None], list[float | None]]] = {}
    for key, (setup, generate) in variants.items():
        setup()
        for _ in range(bench.config.warmup):
            generate()
        runs[key] = ([], [], [], [])
    timer = StepTimer(unet, bench.device)
    try:
        for _ in range(bench.config.repeats):
            for key, (setup, generate) in variants.items():
                setup()
                timer.reset()
                with PeakMemory(bench.device, bench.nvml) as peak:
                    runs[key][1].append(timed_ms(generate, bench.device) / 1e3)
                runs[key][0].append(timer.its())
                runs[key][2].append(peak.torch_gib)
                runs[key][3].append(peak.nvml_gib)
    finally:
        timer.remove()
    return {key: Measurement(its, walls, _peak(torch_peaks), _peak(nvml_peaks))
            for key, (its, walls, torch_peaks, nvml_peaks) in runs.items()}


def _peak(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def unet_tflop_per_step(unet_config: dict, batch: int, latent_side: int) -> float:
    """TFLOP of one denoising step, i.e. one UNet call on the CFG-doubled batch, counted by torch's
    FlopCounterMode on a meta-device UNet: exact for the shapes, costs no memory and needs no GPU."""
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config)
    rows = 2 * batch
    sample = torch.empty(rows, unet.config.in_channels, latent_side, latent_side, device="meta")
    hidden = torch.empty(rows, 77, unet.config.cross_attention_dim, device="meta")
    kwargs = {}
    if unet.config.addition_embed_type == "text_time":
        text_dim = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.empty(rows, text_dim, device="meta"),
                                       "time_ids": torch.empty(rows, 6, device="meta")}
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        unet(sample, torch.tensor(500.0, device="meta"), hidden, return_dict=False, **kwargs)
    return counter.get_total_flops() / 1e12


# ------------------------------------------------------------------------------------ models and LoRAs
@dataclass(frozen=True)
class PreparedModel:
    """A random-weight pipeline saved as a diffusers folder in an A1111-layout data dir, with LoRAs."""

    arch: str
    data_dir: Path
    name: str  # the folder's name under models/Stable-diffusion (what Engine.load_model takes)
    folder: Path
    loras: tuple[str, ...]  # LoRA library names, in the order the 1- and 3-LoRA rows use them
    lora_paths: tuple[Path, ...]
    unet_config: dict
    latent_scale: int  # pixels per latent pixel (the VAE's scale factor)
    unet_params_m: float


_LORA_LINEAR = re.compile(r"\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$")
_LORA_CONV = re.compile(r"resnets\.\d+\.conv[12]$")


def random_pipeline(arch: str, device: torch.device, dtype: torch.dtype):
    """The full-size pipeline from the bundled configs with random weights, initialised on `device`
    (seconds on a GPU, where the CPU would take minutes for SDXL)."""
    config_dir = family(arch).config_dir
    index = json.loads((config_dir / "model_index.json").read_text())
    text_classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parts = {
            "unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(config_dir / "unet")),
            "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(config_dir / "vae")),
        }
        for name, cls in text_classes.items():
            if name in index:
                parts[name] = cls(CLIPTextConfig.from_pretrained(config_dir / name))
    parts = {name: module.to(dtype).eval() for name, module in parts.items()}
    parts["scheduler"] = getattr(diffusers, index["scheduler"][1]).from_pretrained(config_dir, subfolder="scheduler")
    return DIFFUSERS_CLASSES[arch](**parts, **family(arch).tokenizers(), **family(arch).pipeline_kwargs)


def lora_targets(unet: torch.nn.Module, convs: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(module path, weight shape) of the layers a LoRA covers: attention projections and
    feed-forward linears, plus the resnet 3×3 convs for a LoCon."""
    found = []
    for name, module in unet.named_modules():
        linear = isinstance(module, torch.nn.Linear) and _LORA_LINEAR.search(name)
        conv = convs and isinstance(module, torch.nn.Conv2d) and _LORA_CONV.search(name)
        if linear or conv:
            found.append((name, tuple(module.weight.shape)))
    return found


def write_lora(path: Path, targets: list[tuple[str, tuple[int, ...]]], rank: int, seed: int) -> Path:
    """A random LoRA in the PEFT layout (`unet.<module>.lora_A/B.weight`, fp16, no alpha): both our
    loader and diffusers read it, and both scale it by 1, so the two sides apply the same deltas."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in targets:
        out_dim, in_dim, *kernel = shape
        fan_in = in_dim * math.prod(kernel)
        down = torch.randn(rank, in_dim, *kernel, generator=generator) / math.sqrt(fan_in)
        up = torch.randn(out_dim, rank, *([1] * len(kernel)), generator=generator) * 0.02
        tensors[f"unet.{name}.lora_A.weight"] = down.half()
        tensors[f"unet.{name}.lora_B.weight"] = up.half()
    save_file(tensors, str(path))
    return path


def prepare_model(arch: str, bench: Bench) -> PreparedModel:
    """Build, save and free the random pipeline; write its three LoRAs (two attention+FF, one LoCon)."""
    settings = Settings(data_dir=bench.tmp / arch)
    folder = settings.checkpoints_dir / f"bench-{arch}"
    if bench.config.tiny:
        pipe = build_tiny_pipeline(arch)
    else:
        pipe = random_pipeline(arch, bench.device, bench.dtype)
    pipe.save_pretrained(folder, safe_serialization=True)
    settings.lora_dir.mkdir(parents=True, exist_ok=True)
    names, paths = [], []
    for i, kind in enumerate(("lora", "lora", "locon")):
        names.append(f"bench-{arch}-{kind}{i}")
        targets = lora_targets(pipe.unet, convs=kind == "locon")
        paths.append(write_lora(settings.lora_dir / f"{names[-1]}.safetensors", targets, bench.config.lora_rank, i))
    model = PreparedModel(arch, settings.data_dir, folder.name, folder, tuple(names), tuple(paths),
                          dict(pipe.unet.config), pipe.vae_scale_factor,
                          sum(p.numel() for p in pipe.unet.parameters()) / 1e6)
    del pipe
    free_memory()
    return model


def lora_specs(model: PreparedModel, count: int, last_weight: float = 1.0) -> list[LoraSpec]:
    specs = [LoraSpec(name) for name in model.loras[:count]]
    if specs:
        specs[-1] = LoraSpec(specs[-1].name, last_weight)
    return specs


# ------------------------------------------------------------------------------------ diffusers side
Key = tuple[str, int, str, int]  # (offload, LoRA count, variant, batch)


@dataclass
class SideResults:
    """One side's measurements for one architecture."""

    runs: dict[Key, Measurement] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # "lora" / "offload:<case>" -> why it was not measured
    latency_ms: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (op, variant) -> runs
    load_s: list[float] = field(default_factory=list)
    compile_info: list[dict[str, Any]] = field(default_factory=list)


def load_diffusers(model: PreparedModel, bench: Bench, to_device: bool = True):
    """The saved folder loaded the way a diffusers user loads it, with the sampler ours uses."""
    kwargs = {"safety_checker": None, "requires_safety_checker": False} if model.arch == "sd15" else {}
    pipe = DIFFUSERS_CLASSES[model.arch].from_pretrained(model.folder, dtype=bench.dtype, local_files_only=True,
                                                         **kwargs)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    if to_device:
        pipe.to(bench.device)
    return pipe


def diffusers_generator(pipe, model: PreparedModel, bench: Bench, batch: int) -> Callable[[], Any]:
    side = bench.config.resolution[model.arch]

    def generate():
        generators = [torch.Generator("cpu").manual_seed(SEED + i) for i in range(batch)]
        return pipe(prompt=PROMPT, num_inference_steps=bench.config.steps, guidance_scale=CFG_SCALE, width=side,
                    height=side, num_images_per_prompt=batch, generator=generators, output_type="pil").images

    return generate


def _timed_diffusers_load(model: PreparedModel, bench: Bench):
    synchronize(bench.device)
    started = time.perf_counter()
    pipe = load_diffusers(model, bench)
    synchronize(bench.device)
    return pipe, time.perf_counter() - started


def diffusers_side(model: PreparedModel, bench: Bench) -> SideResults:
    """Every baseline for one architecture: load, plain, PEFT LoRAs, LoRA latency, offload modes."""
    out = SideResults()
    pipe = None
    for _ in range(bench.config.load_repeats if bench.wants("load") else 1):
        pipe = None  # drop the previous copy before timing the next load
        free_memory()
        pipe, seconds = _timed_diffusers_load(model, bench)
        out.load_s.append(seconds)
    for batch in bench.config.batches:
        log.info("[%s] diffusers: batch %d, no LoRA", model.arch, batch)
        generate = diffusers_generator(pipe, model, bench, batch)
        out.runs[("none", 0, "eager", batch)] = measure(generate, pipe.unet, bench)
    if not has_package("peft"):
        out.notes["lora"] = "diffusers loads LoRAs through peft, which is not installed"
    elif bench.wants("throughput") or bench.wants("compile"):
        _diffusers_lora_runs(pipe, model, bench, out)
    if bench.wants("latency") and "lora" not in out.notes:
        out.latency_ms.update(_diffusers_latency(pipe, model, bench))
    del pipe
    free_memory()
    if bench.wants("offload"):
        _diffusers_offload(model, bench, out)
    return out


def _load_adapter(pipe, path: Path, name: str) -> None:
    """Read the file and give diffusers the tensors (a fresh dict: it may rewrite the one it gets)."""
    pipe.load_lora_weights(load_file(str(path)), adapter_name=name)


def _diffusers_lora_runs(pipe, model: PreparedModel, bench: Bench, out: SideResults) -> None:
    """PEFT adapters the way diffusers users run them: active but unfused, then fused into the weights.
    Without the throughput section only what the compile rows compare against is measured."""
    throughput = bench.wants("throughput")
    counts = sorted(c for c in bench.config.lora_counts if c and (throughput or c == 3))
    batches = bench.config.batches if throughput else (1,)
    names: list[str] = []
    for count in counts:
        while len(names) < count:
            names.append(f"l{len(names)}")
            _load_adapter(pipe, model.lora_paths[len(names) - 1], names[-1])
        pipe.set_adapters(names[:count], [1.0] * count)
        for batch in batches:
            log.info("[%s] diffusers: batch %d, %d PEFT LoRAs unfused", model.arch, batch, count)
            generate = diffusers_generator(pipe, model, bench, batch)
            out.runs[("none", count, "peft-unfused", batch)] = measure(generate, pipe.unet, bench)
        pipe.fuse_lora(components=["unet"], adapter_names=names[:count])
        for batch in batches:
            log.info("[%s] diffusers: batch %d, %d PEFT LoRAs fused", model.arch, batch, count)
            generate = diffusers_generator(pipe, model, bench, batch)
            out.runs[("none", count, "peft-fused", batch)] = measure(generate, pipe.unet, bench)
        pipe.unfuse_lora(components=["unet"])
    pipe.unload_lora_weights()


def _diffusers_change(pipe, fused: bool, names: list[str], weights: list[float],
                      change: Callable[[], Any] | None = None) -> None:
    """One LoRA change the diffusers way; a fused stack is unfused first and fused again after, since
    PEFT cannot re-weight or remove an adapter that is merged into the weights."""
    if fused:
        pipe.unfuse_lora(components=["unet"])
    if change is not None:
        change()
    pipe.set_adapters(names, weights)
    if fused:
        pipe.fuse_lora(components=["unet"], adapter_names=names)


def _diffusers_latency(pipe, model: PreparedModel, bench: Bench) -> dict[tuple[str, str], list[float]]:
    """Add, re-weight and remove a third LoRA on top of two, unfused and fused (times in ms)."""
    names = ["l0", "l1", "l2"]
    for i in (0, 1):
        _load_adapter(pipe, model.lora_paths[i], names[i])
    times: dict[tuple[str, str], list[float]] = {}
    add = functools.partial(_load_adapter, pipe, model.lora_paths[2], "l2")
    remove = functools.partial(pipe.delete_adapters, "l2")
    for variant in ("peft-unfused", "peft-fused"):
        fused = variant == "peft-fused"
        log.info("[%s] diffusers: LoRA latency, %s", model.arch, variant)
        pipe.set_adapters(names[:2], [1.0, 1.0])
        if fused:
            pipe.fuse_lora(components=["unet"], adapter_names=names[:2])
        for rep in range(bench.config.repeats):
            ops = [("add", functools.partial(_diffusers_change, pipe, fused, names, [1.0] * 3, add))]
            ops += [("reweight", functools.partial(_diffusers_change, pipe, fused, names, [1.0, 1.0, 1.1 - i % 2 / 10]))
                    for i in range(bench.config.reweights if rep == 0 else 0)]
            ops.append(("remove", functools.partial(_diffusers_change, pipe, fused, names[:2], [1.0, 1.0], remove)))
            for op, fn in ops:
                times.setdefault((op, variant), []).append(timed_ms(fn, bench.device))
        if fused:
            pipe.unfuse_lora(components=["unet"])
    pipe.unload_lora_weights()
    return times


_DIFFUSERS_OFFLOAD: dict[str, tuple[str, Callable[[Any, torch.device], None]]] = {
    "model": ("enable_model_cpu_offload", lambda pipe, device: pipe.enable_model_cpu_offload(device=device)),
    "sequential": ("enable_sequential_cpu_offload",
                   lambda pipe, device: pipe.enable_sequential_cpu_offload(device=device)),
    "group": ("enable_group_offload (blocks, stream)",
              lambda pipe, device: pipe.enable_group_offload(onload_device=device, offload_type="block_level",
                                                             num_blocks_per_group=1, use_stream=True)),
}
_NEEDS_ACCELERATE = ("model", "sequential")


def _diffusers_offload_cases(bench: Bench) -> list[str]:
    wanted = set(bench.config.offload_cases)
    if "balanced-3gib" in wanted:
        wanted.add("model")  # the budget row's baseline
    return [case for case in _DIFFUSERS_OFFLOAD if case in wanted]


def _diffusers_offload(model: PreparedModel, bench: Bench, out: SideResults) -> None:
    """Each diffusers offload mode on a freshly loaded pipeline: sequential offload leaves weights on
    `meta` and group offload has no public undo, so no pipeline is reused. A baseline that fails is
    reported in its row and the run goes on."""
    for case in _diffusers_offload_cases(bench):
        label = _DIFFUSERS_OFFLOAD[case][0]
        if bench.device.type != "cuda":
            out.notes[f"offload:{case}"] = f"diffusers {label} needs a CUDA device"
            continue
        if case in _NEEDS_ACCELERATE and not has_package("accelerate"):
            out.notes[f"offload:{case}"] = f"diffusers {label} needs accelerate, which is not installed"
            continue
        log.info("[%s] diffusers: %s", model.arch, label)
        pipe = load_diffusers(model, bench, to_device=False)
        try:
            _DIFFUSERS_OFFLOAD[case][1](pipe, bench.device)
            out.runs[(case, 0, "diffusers", 1)] = measure(diffusers_generator(pipe, model, bench, 1), pipe.unet, bench)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            out.notes[f"offload:{case}"] = f"diffusers {label} failed: {type(exc).__name__}: {exc}"
            log.warning("[%s] %s", model.arch, out.notes[f"offload:{case}"])
        finally:
            del pipe
            free_memory()


# ------------------------------------------------------------------------------------ our side
def new_engine(model: PreparedModel, bench: Bench, **overrides) -> Engine:
    return Engine(Settings(data_dir=model.data_dir, device=str(bench.device), dtype=bench.config.dtype, **overrides))


def load_ours(engine: Engine, name: str) -> None:
    """`Engine.load_model`, then the pipeline's per-step tqdm bar off, as on the diffusers side (the
    engine reports progress in its snapshot; a bar on stderr would only add noise to both timings)."""
    engine.load_model(name)
    engine.pipeline.set_progress_bar_config(disable=True)


def ours_generator(engine: Engine, model: PreparedModel, bench: Bench, batch: int,
                   steps: int | None = None) -> Callable[[], Any]:
    side = bench.config.resolution[model.arch]
    params = GenerateParams(PROMPT, steps=steps or bench.config.steps, cfg=CFG_SCALE, seed=SEED, width=side,
                            height=side, batch=batch, sampler="Euler")
    return functools.partial(engine.generate, params)


def ours_side(model: PreparedModel, bench: Bench) -> SideResults:
    """Every measurement of ours for one architecture, through the public Engine API."""
    out = SideResults()
    engine = new_engine(model, bench)
    try:
        for i in range(bench.config.load_repeats if bench.wants("load") else 1):
            if i:
                engine.unload()
            out.load_s.append(timed_ms(functools.partial(load_ours, engine, model.name), bench.device) / 1e3)
        counts = bench.config.lora_counts if bench.wants("throughput") else (0,)
        for batch in bench.config.batches:
            log.info("[%s] ours: batch %d, %s LoRAs, interleaved", model.arch, batch, "/".join(map(str, counts)))
            generate = ours_generator(engine, model, bench, batch)
            variants = {("none", count, "fused", batch): (functools.partial(engine.set_loras, lora_specs(model, count)),
                                                          generate) for count in counts}
            out.runs.update(measure_interleaved(variants, engine.pipeline.unet, bench))
        engine.set_loras([])
        if bench.wants("latency"):
            out.latency_ms.update(_ours_latency(engine, model, bench))
        if bench.wants("offload"):
            _ours_offload(engine, model, bench, out)
        if bench.wants("compile"):  # last: CUDA-graph pools must not inflate the offload rows' peak VRAM
            _ours_compiled(engine, model, bench, out)
    finally:
        engine.unload()
        engine.close()
        free_memory()
    budget = "balanced-3gib" in bench.config.offload_cases and model.arch in bench.config.budget_archs
    if bench.wants("offload") and budget:
        _ours_budget(model, bench, out)
    return out


def _ours_latency(engine: Engine, model: PreparedModel, bench: Bench) -> dict[tuple[str, str], list[float]]:
    """Add, re-weight and remove a third LoRA on top of two (ms). Each is one full engine transition:
    queue, placement verify before and after, the patch itself, a new snapshot."""
    base = lora_specs(model, 2)
    engine.set_loras(base)
    times: dict[tuple[str, str], list[float]] = {}
    log.info("[%s] ours: LoRA latency", model.arch)
    for rep in range(bench.config.repeats):
        ops = [("add", functools.partial(engine.set_loras, lora_specs(model, 3)))]
        ops += [("reweight", functools.partial(engine.set_loras, lora_specs(model, 3, 1.1 - i % 2 / 10)))
                for i in range(bench.config.reweights if rep == 0 else 0)]
        ops.append(("remove", functools.partial(engine.set_loras, base)))
        for op, fn in ops:
            times.setdefault((op, "ours"), []).append(timed_ms(fn, bench.device))
            # The engine's own timer around the LoRA math; the rest is queue, verify and snapshot.
            times.setdefault((op, "ours-patch"), []).append(engine.snapshot().timers["patch"].last_s * 1e3)
    engine.set_loras([])
    return times


def _ours_compiled(engine: Engine, model: PreparedModel, bench: Bench, out: SideResults) -> None:
    """The compiled UNet per mode: first (compiling) generation, steady speed without and with three
    LoRAs, the LoRA-change check, and optionally the warm-restart probe."""
    for mode in bench.config.compile_modes:
        engine.set_loras([])
        log.info("[%s] ours: compiling the UNet (%s, %s)", model.arch, mode, bench.config.compile_backend)
        state = compiled.enable(engine.pipeline, mode=mode, backend=bench.config.compile_backend, background=False,
                                cache_dir=bench.compile_cache, device=bench.device)
        variant = f"compiled-{mode}"
        generate = ours_generator(engine, model, bench, 1)
        try:
            first_s = timed_ms(generate, bench.device) / 1e3
            out.runs[("none", 0, variant, 1)] = measure(generate, engine.pipeline.unet, bench)
            info = {"arch": model.arch, "mode": mode, "backend": bench.config.compile_backend,
                    "first_generation_s": first_s,
                    "first_compile_s": next(iter(dict(state.status().compile_seconds).values()), None),
                    "compiles_after_warm": state.compiles, "note": state.note}
            info.update(_lora_ops_check(engine, state, model, bench))
            out.runs[("none", 3, variant, 1)] = measure(generate, engine.pipeline.unet, bench)
            info["warm_restart_s"] = info["warm_restart_its"] = None
            if bench.config.restart_probe:
                info.update(_restart_probe(model, mode, out.runs[("none", 0, variant, 1)].its, bench))
            out.compile_info.append(info)
        finally:
            compiled.disable(engine.pipeline)
    engine.set_loras([])


def _lora_ops_check(engine: Engine, state: compiled.CompileState, model: PreparedModel,
                    bench: Bench) -> dict[str, Any]:
    """An add, `reweights` re-weights, a remove and a re-add under the compiled UNet with a (short)
    generation after each: compiles and CUDA-graph recordings must stay put, and each change must
    reach the UNet's output. Leaves the three LoRAs applied."""
    sequence = [lora_specs(model, 3)]
    sequence += [lora_specs(model, 3, 1.1 - i % 2 / 10) for i in range(bench.config.reweights)]
    sequence += [lora_specs(model, 2), lora_specs(model, 3)]
    generate = ours_generator(engine, model, bench, 1, steps=2)
    timer = StepTimer(engine.pipeline.unet, bench.device, capture=True)
    compiles, recordings = state.compiles, state.cudagraph_recordings
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
    return {
        "lora_ops": len(sequence),
        "recompiles_during_lora_ops": state.compiles - compiles,
        "cudagraph_rerecords_during_lora_ops": None if recordings is None else state.cudagraph_recordings - recordings,
        "lora_changes_reached_output": all(changed),
    }


def _ours_offload(engine: Engine, model: PreparedModel, bench: Bench, out: SideResults) -> None:
    for case in bench.config.offload_cases:
        if case == "balanced-3gib":
            continue  # a start-up setting: measured on its own engine by _ours_budget
        log.info("[%s] ours: offload %s", model.arch, case)
        generate = ours_generator(engine, model, bench, 1)
        if case == "balanced":  # its target is a ratio to `none`: measured interleaved with it
            warm = ours_generator(engine, model, bench, 1, steps=2)
            variants = {key: (functools.partial(_switch_offload, engine, mode, warm), generate)
                        for key, mode in ((("none", 0, "beside-balanced", 1), "none"), ((case, 0, "fused", 1), case))}
            out.runs.update(measure_interleaved(variants, engine.pipeline.unet, bench))
            continue
        engine.set_offload(case)
        out.runs[(case, 0, "fused", 1)] = measure(generate, engine.pipeline.unet, bench)
    engine.set_offload("none")


def _switch_offload(engine: Engine, mode: str, warm_up: Callable[[], Any]) -> None:
    """Switch offload mode, then one short generation so the timed one starts with the mode's
    steady-state placement (balanced uploads its components on first use)."""
    engine.set_offload(mode)
    warm_up()


def _ours_budget(model: PreparedModel, bench: Bench, out: SideResults) -> None:
    """Balanced offload under a VRAM budget, on a second engine: the budget is a start-up setting."""
    log.info("[%s] ours: balanced offload under %g GiB", model.arch, bench.config.budget_gib)
    engine = new_engine(model, bench, offload="balanced", vram_budget_gib=bench.config.budget_gib)
    try:
        load_ours(engine, model.name)
        generate = ours_generator(engine, model, bench, 1)
        out.runs[("balanced-3gib", 0, "fused", 1)] = measure(generate, engine.pipeline.unet, bench)
    finally:
        engine.unload()
        engine.close()
        free_memory()


# ------------------------------------------------------------------------------------ warm restart
def _restart_probe(model: PreparedModel, mode: str, compiled_its: float, bench: Bench) -> dict[str, Any]:
    """Time a fresh process from enabling the compiled path to compiled speed, from this run's caches."""
    spec = {"data_dir": str(model.data_dir), "model": model.name, "arch": model.arch, "mode": mode,
            "backend": bench.config.compile_backend, "cache_dir": str(bench.compile_cache),
            "resolution": bench.config.resolution[model.arch], "steps": bench.config.steps,
            "dtype": bench.config.dtype, "device": str(bench.device), "target_its": compiled_its}
    log.info("[%s] ours: warm-restart probe (%s)", model.arch, mode)
    command = [sys.executable, str(Path(__file__).resolve()), "--restart-probe", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        return {"warm_restart_note": f"probe failed: {done.stderr.strip()[-800:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_restart_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """The child side: load the model (not timed), then enable compilation and generate until a
    generation reaches 90% of the parent's compiled speed (at most 5); report the elapsed time."""
    device = torch.device(spec["device"])
    engine = Engine(Settings(data_dir=Path(spec["data_dir"]), device=spec["device"], dtype=spec["dtype"]))
    try:
        load_ours(engine, spec["model"])
        side = spec["resolution"]
        params = GenerateParams(PROMPT, steps=spec["steps"], cfg=CFG_SCALE, seed=SEED, width=side, height=side,
                                sampler="Euler")
        started = time.perf_counter()
        state = compiled.enable(engine.pipeline, mode=spec["mode"], backend=spec["backend"], background=False,
                                cache_dir=Path(spec["cache_dir"]), device=device)
        timer = StepTimer(engine.pipeline.unet, device)
        its = 0.0
        for _ in range(5):
            timer.reset()
            engine.generate(params)
            its = timer.its()
            if its >= 0.9 * spec["target_its"]:
                break
        return {"warm_restart_s": time.perf_counter() - started, "warm_restart_its": its,
                "warm_restart_compiles": state.compiles,
                "warm_restart_fx_cache_hits": int(torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"])}
    finally:
        engine.unload()
        engine.close()


# ------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class Pairing:
    """One comparison row: which measurement of ours against which baseline."""

    section: str
    ours_key: Key
    ours_label: str
    base_key: Key
    base_label: str
    base_side: str  # "diffusers" | "ours"
    note_key: str = ""


def _pairings(bench: Bench) -> list[Pairing]:
    pairs = []
    counts = [c for c in bench.config.lora_counts if c]
    for b in bench.config.batches:
        pairs.append(Pairing("throughput", ("none", 0, "fused", b), "ours", ("none", 0, "eager", b), "diffusers",
                             "diffusers"))
        for n in counts:
            for variant, label in (("peft-unfused", "diffusers PEFT unfused"), ("peft-fused", "diffusers PEFT fused")):
                pairs.append(Pairing("throughput", ("none", n, "fused", b), "ours fused", ("none", n, variant, b),
                                     label, "diffusers", "lora"))
        if 3 in counts:
            pairs.append(Pairing("throughput", ("none", 3, "fused", b), "ours fused", ("none", 0, "fused", b),
                                 "ours no LoRA", "ours"))
    for case in bench.config.offload_cases:
        if case == "balanced":
            pairs.append(Pairing("offload", (case, 0, "fused", 1), "ours", ("none", 0, "beside-balanced", 1),
                                 "ours offload none", "ours"))
            continue
        base = "model" if case == "balanced-3gib" else case
        pairs.append(Pairing("offload", (case, 0, "fused", 1), "ours", (base, 0, "diffusers", 1),
                             f"diffusers {_DIFFUSERS_OFFLOAD[base][0]}", "diffusers", f"offload:{base}"))
    for mode in bench.config.compile_modes:
        key0, key3 = ("none", 0, f"compiled-{mode}", 1), ("none", 3, f"compiled-{mode}", 1)
        label = f"ours compiled ({mode})"
        pairs += [Pairing("compile", key0, label, ("none", 0, "eager", 1), "diffusers", "diffusers"),
                  Pairing("compile", key0, label, ("none", 0, "fused", 1), "ours eager", "ours"),
                  Pairing("compile", key3, label, ("none", 3, "peft-fused", 1), "diffusers PEFT fused", "diffusers",
                          "lora")]
    return pairs


def _side_fields(prefix: str, m: Measurement | None, tflop: float, peak: float | None) -> dict[str, Any]:
    its = None if m is None else m.its
    return {
        f"{prefix}_its": its,
        f"{prefix}_its_runs": [] if m is None else m.its_runs,
        f"{prefix}_gen_s": None if m is None else m.gen_s,
        f"{prefix}_peak_vram_torch_gib": None if m is None else m.peak_torch_gib,
        f"{prefix}_peak_vram_nvml_gib": None if m is None else m.peak_nvml_gib,
        f"{prefix}_peak_fraction": None if its is None or peak is None else its * tflop / peak,
    }


def pair_rows(model: PreparedModel, bench: Bench, ours: SideResults, theirs: SideResults,
              tflop: dict[int, float]) -> list[dict[str, Any]]:
    """Rows of ours against a baseline; a missing baseline keeps its row, with the reason."""
    rows = []
    peak = bench.env["peak_bf16_tflops"]
    side = bench.config.resolution[model.arch]
    for p in _pairings(bench):
        mine = ours.runs.get(p.ours_key)
        if mine is None:
            continue  # a section this run did not measure
        base = (ours if p.base_side == "ours" else theirs).runs.get(p.base_key)
        offload, loras, _variant, batch = p.ours_key
        row = {"id": f"{model.arch}/{side}px/b{batch}/{offload}/{loras}lora/{p.ours_label} vs {p.base_label}",
               "section": p.section, "arch": model.arch, "resolution": side, "batch": batch,
               "steps": bench.config.steps, "offload": offload, "loras": loras, "ours": p.ours_label,
               "baseline": p.base_label, "tflop_per_step": tflop[batch]}
        row |= _side_fields("ours", mine, tflop[batch], peak) | _side_fields("baseline", base, tflop[batch], peak)
        row["ratio"] = None if base is None else row["ours_its"] / row["baseline_its"]
        row["note"] = "" if base is not None else theirs.notes.get(p.note_key, "not measured in this run")
        rows.append(row)
    return rows


def latency_rows(model: PreparedModel, ours: SideResults, theirs: SideResults) -> list[dict[str, Any]]:
    """LoRA change latency; ratio = baseline time / ours."""
    rows = []
    for op, after in (("add", 3), ("reweight", 3), ("remove", 2)):
        mine = ours.latency_ms.get((op, "ours"))
        if not mine:
            continue
        for variant, label in (("peft-unfused", "diffusers PEFT unfused"),
                               ("peft-fused", "diffusers PEFT fused (unfuse, change, fuse)")):
            base = theirs.latency_ms.get((op, variant))
            rows.append({"arch": model.arch, "op": op, "loras_after": after, "ours_ms": median(mine),
                         "ours_ms_runs": mine, "ours_patch_ms": median(ours.latency_ms.get((op, "ours-patch"), [])),
                         "baseline": label, "baseline_ms": median(base or []),
                         "baseline_ms_runs": base or [],
                         "ratio": median(base) / median(mine) if base else None,
                         "note": "" if base else theirs.notes.get("lora", "not measured in this run")})
    return rows


def load_row(model: PreparedModel, ours: SideResults, theirs: SideResults) -> dict[str, Any]:
    """Model load from the same diffusers folder (warm page cache); ours includes hashing the UNet
    file, placement and verification. Ratio = baseline time / ours."""
    return {"arch": model.arch, "ours_s": median(ours.load_s), "ours_s_runs": ours.load_s,
            "baseline": "diffusers from_pretrained + .to(device)", "baseline_s": median(theirs.load_s),
            "baseline_s_runs": theirs.load_s, "ratio": median(theirs.load_s) / median(ours.load_s)}


# ------------------------------------------------------------------------------------ acceptance
def _check(name: str, where: str, value, target: str, passed: Callable[[Any], bool]) -> dict[str, Any]:
    return {"check": name, "where": where, "value": value, "target": target,
            "passed": None if value is None else bool(passed(value))}


def _row_checks(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's acceptance targets that read one comparison row."""
    section, ratio, where = row["section"], row["ratio"], row["id"]
    if section == "throughput" and row["loras"] == 0 and row["baseline"] == "diffusers":
        return [_check("ours no LoRA vs diffusers", where, ratio, ">= 1.0", lambda v: v >= 1.0)]
    if section == "throughput" and row["loras"] == 3 and row["baseline"] == "ours no LoRA":
        return [_check("ours 3 LoRAs fused vs ours no LoRA", where, ratio, ">= 0.97", lambda v: v >= 0.97)]
    if section == "offload" and row["offload"] == "balanced":
        return [_check("balanced (ample VRAM) vs ours none", where, ratio, ">= 0.95", lambda v: v >= 0.95)]
    compiled_vs_eager = (section == "compile" and row["loras"] == 0 and row["baseline"] == "diffusers"
                         and "reduce-overhead" in row["ours"] and row["batch"] == 1)
    if compiled_vs_eager:
        target = 3.0 if row["arch"] == "sd15" else 2.0
        return [_check("compiled vs diffusers eager", where, ratio, f">= {target}", lambda v: v >= target)]
    return []


def _compile_checks(info: dict[str, Any]) -> list[dict[str, Any]]:
    where = f"{info['arch']}/compiled ({info['mode']})"
    rerecords = info["cudagraph_rerecords_during_lora_ops"] or 0
    checks = [
        _check("recompiles + CUDA-graph re-records across LoRA changes", where,
               info["recompiles_during_lora_ops"] + rerecords, "= 0", lambda v: v == 0),
        _check("every LoRA change reached the compiled output", where, info["lora_changes_reached_output"], "true",
               lambda v: v is True),
    ]
    if info["mode"] == "reduce-overhead":
        checks.append(_check("warm restart to compiled speed (s)", where, info.get("warm_restart_s"), "<= 15",
                             lambda v: v <= 15))
    return checks


def acceptance(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the issue this run has data for; `passed` is None where the value is missing."""
    checks = [c for row in results["rows"] for c in _row_checks(row)]
    checks += [_check("ours LoRA re-weight latency (ms)", f"{row['arch']}/reweight", row["ours_ms"], "<= 50",
                      lambda v: v <= 50)
               for row in results["latency"] if row["op"] == "reweight" and "unfused" in row["baseline"]]
    checks += [c for info in results["compile"] for c in _compile_checks(info)]
    return checks


# ------------------------------------------------------------------------------------ output
def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if value == 0 or abs(value) >= 10**-digits else f"{value:.1e}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


def render_markdown(results: dict[str, Any]) -> str:
    env, cfg = results["env"], results["config"]
    lines = [f"# Steady Diffusion vs diffusers: {env['gpu']} ({results['mode']})", "",
             f"{env['created']} · torch {env['torch']} · CUDA {env['cuda']} · diffusers {env['diffusers']} · "
             f"{cfg['dtype']} · {cfg['steps']} steps, Euler, CFG {CFG_SCALE:g} · median of {cfg['repeats']} runs "
             f"after {cfg['warmup']} warm-up · dense bf16 peak {_fmt(env['peak_bf16_tflops'], 1)} TFLOP/s", "",
             "Ratio: ours relative to the baseline, > 1 means ours is better (speed ours/baseline, time "
             "baseline/ours). it/s: UNet-loop rate from hooks on the UNet (prompt encoding and VAE decode "
             "outside; an offload mode's UNet transfers inside). VRAM: peak torch-allocated / NVML device used, "
             "GiB. % peak: it/s × UNet TFLOP per step / dense bf16 peak.", ""]
    if results["mode"] == "smoke":
        lines += ["**Smoke run on tiny models: the numbers only prove the pipeline runs.**", ""]
    lines += ["## Denoising speed", ""]
    lines += _table(["arch", "px", "batch", "offload", "LoRAs", "ours", "it/s", "baseline", "it/s", "ratio",
                     "VRAM ours", "VRAM baseline", "TFLOP/step", "% peak ours", "note"],
                    [[r["arch"], r["resolution"], r["batch"], r["offload"], r["loras"], r["ours"], r["ours_its"],
                      r["baseline"], r["baseline_its"], r["ratio"],
                      f"{_fmt(r['ours_peak_vram_torch_gib'])} / {_fmt(r['ours_peak_vram_nvml_gib'])}",
                      f"{_fmt(r['baseline_peak_vram_torch_gib'])} / {_fmt(r['baseline_peak_vram_nvml_gib'])}",
                      r["tflop_per_step"], _percent(r["ours_peak_fraction"]), r["note"]] for r in results["rows"]])
    lines += ["## LoRA change latency (ms)", "",
              "ours: the whole engine transition; of which patching: the LoRA math alone (the engine's timer).", ""]
    lines += _table(["arch", "op", "ours", "of which patching", "baseline", "baseline ms", "ratio", "note"],
                    [[r["arch"], r["op"], r["ours_ms"], r["ours_patch_ms"], r["baseline"], r["baseline_ms"], r["ratio"],
                      r["note"]] for r in results["latency"]])
    lines += ["## Model load (s)", ""]
    lines += _table(["arch", "ours", "baseline", "baseline s", "ratio"],
                    [[r["arch"], r["ours_s"], r["baseline"], r["baseline_s"], r["ratio"]] for r in results["load"]])
    lines += ["## Compiled UNet", ""]
    lines += _table(["arch", "mode", "backend", "first compile s", "graphs", "recompiles in LoRA ops",
                     "CUDA-graph re-records", "LoRA changes reached output", "warm restart s", "note"],
                    [[c["arch"], c["mode"], c["backend"], c["first_compile_s"], c["compiles_after_warm"],
                      c["recompiles_during_lora_ops"], c["cudagraph_rerecords_during_lora_ops"],
                      c["lora_changes_reached_output"], c.get("warm_restart_s"),
                      c.get("warm_restart_note", c["note"])] for c in results["compile"]])
    lines += ["## Acceptance", ""]
    lines += _table(["check", "where", "value", "target", "passed"],
                    [[c["check"], c["where"], c["value"], c["target"], c["passed"]] for c in results["acceptance"]])
    return "\n".join(lines)


def _percent(fraction: float | None) -> str:
    return "–" if fraction is None else f"{100 * fraction:.1f}%"


def render_chart(results: dict[str, Any], path: Path) -> None:
    """A bar per comparison row: the ratio, with a line at 1.0 (matplotlib is not a dependency)."""
    rows = results["rows"]
    font = ImageFont.load_default()
    line_h, label_w, bar_w, top = 20, 560, 360, 44
    width, height = label_w + bar_w + 260, top + line_h * max(len(rows), 1) + 28
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    env = results["env"]
    draw.text((10, 8), f"ours / baseline speed, {env['gpu']}, {results['mode']} ({env['created']})", fill="black",
              font=font)
    scale = max([1.0] + [r["ratio"] for r in rows if r["ratio"]]) * 1.05
    for i, row in enumerate(rows):
        y = top + i * line_h
        label = f"{row['arch']} b{row['batch']} {row['offload']} {row['loras']}L: {row['ours']} vs {row['baseline']}"
        draw.text((10, y + 4), label[:90], fill="black", font=font)
        if row["ratio"] is None:
            draw.text((label_w + 4, y + 4), f"n/a: {row['note']}"[:70], fill="gray", font=font)
            continue
        end = label_w + bar_w * row["ratio"] / scale
        draw.rectangle([label_w, y + 3, end, y + line_h - 3], fill="#3a8f4a" if row["ratio"] >= 1 else "#d9822b")
        text = f"{row['ratio']:.2f}x ({row['ours_its']:.2f} vs {row['baseline_its']:.2f} it/s)"
        draw.text((end + 6, y + 4), text, fill="black", font=font)
    one = label_w + bar_w / scale
    draw.line([(one, top - 6), (one, height - 24)], fill="black", width=1)
    draw.text((one - 8, height - 20), "1.0", fill="black", font=font)
    image.save(path)


def write_outputs(results: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: out_dir / f"{stem}.{kind}" for kind in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["md"].write_text(render_markdown(results) + "\n")
    render_chart(results, paths["png"])
    return paths


# ------------------------------------------------------------------------------------ running
def bench_arch(arch: str, bench: Bench, results: dict[str, Any]) -> None:
    """Prepare one architecture, measure diffusers then ours, and add the paired results."""
    log.info("[%s] building a random-weight model and its LoRAs", arch)
    model = prepare_model(arch, bench)
    latent_side = bench.config.resolution[arch] // model.latent_scale
    tflop = {b: unet_tflop_per_step(model.unet_config, b, latent_side) for b in bench.config.batches}
    results["models"][arch] = {"resolution": bench.config.resolution[arch], "latent_side": latent_side,
                               "unet_params_m": model.unet_params_m, "loras": list(model.loras),
                               "lora_rank": bench.config.lora_rank,
                               "tflop_per_step": {str(b): t for b, t in tflop.items()}}
    theirs = diffusers_side(model, bench)
    ours = ours_side(model, bench)
    results["rows"] += pair_rows(model, bench, ours, theirs, tflop)
    results["latency"] += latency_rows(model, ours, theirs)
    if bench.wants("load"):
        results["load"].append(load_row(model, ours, theirs))
    results["compile"] += ours.compile_info
    shutil.rmtree(model.data_dir)  # an SDXL folder and its LoRAs take ~8 GB


def run(config: BenchConfig, compile_cache: Path | None = None, peak_override: float | None = None) -> dict[str, Any]:
    """Run every configured section for every architecture; returns the results document."""
    device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
    nvml, nvml_note = open_nvml(device)
    env = environment(config, device, nvml, nvml_note, peak_override)
    env["compile_cache"] = str(compile_cache) if compile_cache else "fresh (the first compile is cold)"
    results = {"schema": SCHEMA, "mode": config.mode, "config": dataclasses.asdict(config), "env": env,
               "models": {}, "rows": [], "latency": [], "load": [], "compile": [], "acceptance": []}
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # One CPU thread for both sides: OpenMP threads spin-wait, so on a shared or small machine the
        # main thread (diffusers) and the engine's worker thread (ours) would otherwise not compare.
        torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="sd-bench-") as tmp:
            cache = compile_cache or Path(tmp) / "compile-cache"
            if "compile" in config.sections and config.compile_backend == "inductor":
                configure_cache(cache, override=True)  # before anything compiles
            bench = Bench(config, device, Path(tmp), cache, nvml, env)
            for arch in config.archs:
                bench_arch(arch, bench, results)
    finally:
        torch.set_num_threads(threads)
    results["acceptance"] = acceptance(results)
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
                                     epilog="Without --quick/--smoke: the full run (needs CUDA).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="SD1.5, batch 1, 0 and 3 LoRAs, balanced offload only (< 3 min on an H100)")
    mode.add_argument("--smoke", action="store_true", help="CPU, tiny models, seconds: checks the pipeline runs")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<gpu>/)")
    parser.add_argument("--archs", help="comma list of sd15,sdxl")
    parser.add_argument("--sections", help=f"comma list of {','.join(SECTIONS)}")
    parser.add_argument("--batches", help="comma list of batch sizes (default 1,4; quick and smoke 1)")
    parser.add_argument("--repeats", type=int, help="timed runs per configuration (median reported)")
    parser.add_argument("--steps", type=int, help="denoising steps per generation")
    parser.add_argument("--compile-cache", type=Path, help="reuse this compile cache (default: a fresh one)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU when not in the table")
    parser.add_argument("--restart-probe", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> tuple[BenchConfig, str]:
    """The preset with the command line's overrides, and the output file stem naming them."""
    preset = PRESETS["quick" if args.quick else "smoke" if args.smoke else "full"]
    archs = _csv(args.archs, ("sd15", "sdxl"), "archs") or preset.archs
    sections = _csv(args.sections, SECTIONS, "sections") or preset.sections
    batches = tuple(int(b) for b in _csv(args.batches, ("1", "2", "3", "4", "8"), "batches") or preset.batches)
    config = dataclasses.replace(preset, archs=archs, sections=sections, batches=batches,
                                 repeats=args.repeats or preset.repeats, steps=args.steps or preset.steps)
    stem = preset.mode
    if archs != preset.archs:
        stem += "-" + "_".join(archs)
    if sections != preset.sections:
        stem += "-" + "_".join(sections)
    if batches != preset.batches:
        stem += "-b" + "+".join(map(str, batches))
    return config, stem


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    if args.restart_probe:
        print(json.dumps(run_restart_probe(json.loads(args.restart_probe))))
        return 0
    config, stem = config_from_args(args)
    if config.device == "cuda" and not torch.cuda.is_available():
        print(f"error: the {config.mode} benchmark needs a CUDA GPU; on this machine run --smoke", file=sys.stderr)
        return 2
    results = run(config, args.compile_cache, args.peak_tflops)
    paths = write_outputs(results, args.out or RESULTS_DIR / results["env"]["gpu_slug"], stem)
    for path in paths.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
