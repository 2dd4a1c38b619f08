"""Measuring: step timing (wall and thread CPU time), peak memory, ABBA-interleaved repeats and aten
op counts, all from hooks on the denoiser (SD's UNet, Flux's transformer; the hooks' variable names
say `unet` for either). Statistics over the repeats live in `stats.py`; FLOPs in `denoiser.py`."""

from __future__ import annotations

import collections
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app.engine.memory import release_memory

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


def free_memory() -> None:
    """Between phases, give back what the last one dropped, as the engine does after an unload: the
    C heap keeps freed memory until told (app/heap.py), and the next full-size model needs it."""
    release_memory()


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


def fits(need_bytes: float) -> tuple[bool, str]:
    """Whether `need_bytes` (plus a quarter for transients) fits in the RAM free now, and if not why:
    a full-size model that does not fit is skipped with that reason, never swapped for a smaller one."""
    available = psutil.virtual_memory().available
    ok = need_bytes * 1.25 < available
    return ok, "" if ok else f"needs ~{need_bytes * 1.25 / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"


def abba(keys: list, round_index: int) -> list:
    """The order of one round: forward on even rounds, reversed on odd ones (A B B A for two), so
    over an even number of rounds every variant has the same mean position in time and a slow drift
    (clocks, thermals, a neighbour's load) cannot turn into a ratio."""
    return list(keys) if round_index % 2 == 0 else list(reversed(keys))


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


class StepTimer:
    """Times the denoising loop from hooks on the UNet: start of its first call to end of its last,
    as wall time and as CPU time of the thread that calls the UNet (the engine's worker for ours).

    Thread CPU time is what the host spends per step: on a GPU the launch cost an eager loop is bound
    by, on the CPU (one intra-op thread) the compute itself; unlike wall time it does not count time
    the thread spends waiting for a core on a shared machine. The pre-hook is prepended so it runs
    before any offload hook that moves the UNet in. On a GPU the wall marks are CUDA events (no
    synchronisation inside the loop). With `capture`, the first image's output of the last call is
    kept (a device copy, no sync) so a caller can tell whether a LoRA change reached the output.
    """

    def __init__(self, unet: torch.nn.Module, device: torch.device, capture: bool = False) -> None:
        self._cuda = device.type == "cuda"
        self._capture = capture
        self._marks: list = []
        self._cpu: list[float] = []
        self._usage: list[tuple[float, int]] = []  # (user seconds, minor page faults) of the thread
        self.last_output: torch.Tensor | None = None
        self._handles = [unet.register_forward_pre_hook(self._before, prepend=True),
                         unet.register_forward_hook(self._after)]

    def _stamp(self):
        self._cpu.append(time.thread_time())
        if _RUSAGE_THREAD is not None:
            usage = resource.getrusage(_RUSAGE_THREAD)
            self._usage.append((usage.ru_utime, usage.ru_minflt))
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
            first = sample[0] if isinstance(sample, list) else sample[:1]  # a list: one tensor per image
            self.last_output = first.detach().clone()

    def reset(self) -> None:
        self._marks.clear()
        self._cpu.clear()
        self._usage.clear()

    def _calls(self) -> int:
        calls = len(self._marks) // 2
        if calls == 0:
            raise RuntimeError("the UNet was not called during the measured generation")
        return calls

    def its(self) -> float:
        """UNet calls per second over the marked span (one call per step: CFG runs batched)."""
        calls = self._calls()
        if self._cuda:
            self._marks[-1].synchronize()
            seconds = self._marks[0].elapsed_time(self._marks[-1]) / 1e3
        else:
            seconds = self._marks[-1] - self._marks[0]
        return calls / seconds

    def cpu_ms_per_step(self) -> float:
        """Thread CPU time over the same span, per UNet call, in milliseconds."""
        return (self._cpu[-1] - self._cpu[0]) * 1e3 / self._calls()

    def user_ms_and_faults_per_step(self) -> tuple[float | None, float | None]:
        """The user part of that CPU time and the minor page faults, per UNet call (None where the OS
        has no per-thread usage). Why both: the kernel time is mostly page faults, whose count depends
        on the allocator's history (glibc maps a fresh buffer for every oneDNN weight reorder above its
        mmap threshold unless a freed chunk fits), not on the work a variant does."""
        if not self._usage:
            return None, None
        (user0, faults0), (user1, faults1) = self._usage[0], self._usage[-1]
        calls = self._calls()
        return (user1 - user0) * 1e3 / calls, (faults1 - faults0) / calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class PeakMemory:
    """Peak VRAM over a block: the torch allocator's peak and NVML's device-wide used memory, the
    latter sampled every 10 ms on a helper thread (NVML has no peak counter). `transient_gib` is the
    allocator's peak above what was allocated when the block began: the one figure that still
    belongs to one side when both sides' models are resident. None on the CPU."""

    def __init__(self, device: torch.device, nvml: Nvml | None) -> None:
        self._device, self._nvml = device, nvml
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml_peak = self._start = 0
        self.torch_gib: float | None = None
        self.nvml_gib: float | None = None
        self.transient_gib: float | None = None

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._nvml_peak = max(self._nvml_peak, self._nvml.used_bytes())

    def __enter__(self) -> PeakMemory:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
            self._start = torch.cuda.memory_allocated(self._device)
        if self._nvml is not None:
            self._nvml_peak = self._nvml.used_bytes()
            self._thread = threading.Thread(target=self._sample, name="nvml-peak", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            peak = torch.cuda.max_memory_allocated(self._device)
            self.torch_gib, self.transient_gib = peak / 2**30, (peak - self._start) / 2**30
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvml_peak = max(self._nvml_peak, self._nvml.used_bytes())
            self.nvml_gib = self._nvml_peak / 2**30


@dataclass(frozen=True)
class Variant:
    """One configuration in an interleaved comparison: `setup` (untimed) brings its side to it,
    `generate` is the timed generation, `unet` is where the step hooks go, `timeline` (our engine's side)
    reads the timeline of the generation just timed."""

    setup: Callable[[], Any]
    generate: Callable[[], Any]
    unet: torch.nn.Module
    timeline: Callable[[], dict | None] | None = None  # ours: where the last generation's time went (its phases)


@dataclass
class Measurement:
    """Repeated generations of one configuration, one entry per round (rounds pair across variants)."""

    its_runs: list[float] = field(default_factory=list)
    cpu_ms_runs: list[float] = field(default_factory=list)  # thread CPU ms per step
    user_ms_runs: list[float | None] = field(default_factory=list)  # its user part
    faults_runs: list[float | None] = field(default_factory=list)  # minor page faults per step
    gen_s_runs: list[float] = field(default_factory=list)
    transient_gib_runs: list[float | None] = field(default_factory=list)
    # The allocator's absolute peak during the generation: this side's own peak plus whatever the
    # other sides keep resident (little in the offload pools, where they rest on the CPU).
    peak_gib_runs: list[float | None] = field(default_factory=list)
    timeline_runs: list[dict] = field(default_factory=list)  # ours: each generation's phases (JobTimeline.as_dict)


def control_key(key: tuple) -> tuple:
    """The key of a variant's same-vs-same twin: the same configuration measured as a second variant."""
    return (*key[:2], f"control:{key[2]}", *key[3:])


def with_control(variants: dict[tuple, Variant], key: tuple) -> dict[tuple, Variant]:
    """`variants` plus a twin of `key`, placed last so ABBA puts it at the other end of each round."""
    return {**variants, control_key(key): variants[key]}


def measure_interleaved(variants: dict[Any, Variant], device: torch.device, repeats: int, warmup: int,
                        nvml: Nvml | None = None) -> dict[Any, Measurement]:
    """Warm every variant up, then run `repeats` rounds in ABBA order; each round runs every variant's
    setup and then its timed generation, so clock and thermal drift hit every variant alike."""
    for variant in variants.values():
        variant.setup()
        for _ in range(warmup):
            variant.generate()
    runs = {key: Measurement() for key in variants}
    timers = {id(v.unet): StepTimer(v.unet, device) for v in variants.values()}
    try:
        for round_index in range(repeats):
            for key in abba(list(variants), round_index):
                variant, timer, run = variants[key], timers[id(variants[key].unet)], runs[key]
                variant.setup()
                timer.reset()
                with PeakMemory(device, nvml) as peak:
                    run.gen_s_runs.append(timed_ms(variant.generate, device) / 1e3)
                run.its_runs.append(timer.its())
                run.cpu_ms_runs.append(timer.cpu_ms_per_step())
                user_ms, faults = timer.user_ms_and_faults_per_step()
                run.user_ms_runs.append(user_ms)
                run.faults_runs.append(faults)
                run.transient_gib_runs.append(peak.transient_gib)
                run.peak_gib_runs.append(peak.torch_gib)
                timeline = variant.timeline() if variant.timeline is not None else None
                if timeline is not None:
                    run.timeline_runs.append(timeline)
    finally:
        for timer in timers.values():
            timer.remove()
    return runs


class OpCounter(TorchDispatchMode):
    """Counts aten ops inside UNet calls: entered by a forward pre-hook and left by the forward hook,
    so it sees exactly the ops of the calling thread during the UNet (dispatch modes are per thread,
    and ours runs the UNet on the engine's worker). Slows the calls down: never time under it."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.calls = 0
        self._handles = [unet.register_forward_pre_hook(self._enter, prepend=True),
                         unet.register_forward_hook(self._leave)]

    def _enter(self, *_args) -> None:  # a pre-hook's return value would replace the UNet's inputs
        self.__enter__()

    def _leave(self, *_args) -> None:
        self.__exit__(None, None, None)
        self.calls += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def per_call(self) -> dict[str, float]:
        return {op: count / self.calls for op, count in sorted(self.ops.items())} if self.calls else {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
