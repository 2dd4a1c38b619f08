"""Observability in one place: placement rows, per-LoRA counters, timers, GPU/RAM readings, recent logs.

Everything here is read-only with respect to the model: the engine's worker calls these to
build immutable snapshots; the Diagnostics tab and the bug report only ever see snapshots.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil
import torch

from app.engine.offload import MODES
from app.engine.placement import (
    STORAGE_DTYPES,
    PlacementPlan,
    Violation,
    dtype_name,
    iter_module_tensors,
    iter_tensors,
    torch_components,
)
from app.engine.storage import MATMUL_MODES
from app.hooks import HookRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModuleRow:
    """One module that owns tensors directly, as the Diagnostics table shows it: `storage` is what its
    tensors rest in (`fp8 e4m3fn+bf16`: a weight stored in 8 bits beside a bf16 bias), `compute` the
    dtype its forward runs in (empty for a module with no floating tensor)."""

    component: str
    module: str
    cls: str
    device: str
    storage: str
    compute: str
    params: int
    mib: float
    loras: tuple[str, ...]
    offload: str
    violation: bool
    hooks: tuple[str, ...] = ()  # named hooks on this module, in the order they run


@dataclass(frozen=True)
class TimerStat:
    count: int
    last_s: float
    total_s: float


class Timers:
    """Named durations (load, patch, move, generate, verify) with count, last and total."""

    def __init__(self) -> None:
        self._stats: dict[str, TimerStat] = {}

    def record(self, name: str, seconds: float) -> None:
        old = self._stats.get(name, TimerStat(0, 0.0, 0.0))
        self._stats[name] = TimerStat(old.count + 1, seconds, old.total_s + seconds)

    def snapshot(self) -> dict[str, TimerStat]:
        return dict(self._stats)


def _join(values: set[str]) -> str:
    return "+".join(sorted(values))


def storage_label(dtype: torch.dtype) -> str:
    """A dtype as Diagnostics names it: storage dtypes with their format (`fp8 e4m3fn`), others short."""
    if dtype in STORAGE_DTYPES.values():
        return f"{dtype_name(dtype)} {str(dtype).removeprefix('torch.float8_')}"
    return dtype_name(dtype)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def storage_summary(weights: str, stored_layers: int, bytes_saved: int, compute: str | None, *,
                    matmul_layers: int = 0, matmul_unfit: tuple[str, ...] = (), stored_as: tuple[str, ...] = (),
                    resting_bytes: int = 0) -> str:
    """The Diagnostics line on weight storage: how many layers rest in which codec (fp8, int8, a GGUF block
    type), the bytes they rest in and the bytes saved; in fp8-compute, how many of them run as fp8 matmuls
    and why the others widen instead."""
    if compute is None:
        return ""
    if not stored_layers:
        return f"weights: {weights} — every weight rests in its compute dtype ({compute})"
    saved = f"{_size(bytes_saved)} saved ({bytes_saved:,} bytes), {_size(resting_bytes)} at rest"
    label = storage_label(STORAGE_DTYPES["fp8"])
    names = [entry.partition(" × ")[2] for entry in stored_as]
    held = (label if names in ([], ["fp8"]) else names[0]) if len(names) < 2 else f"codecs ({', '.join(stored_as)})"
    if weights in MATMUL_MODES:
        widened = f"; the other {stored_layers - matmul_layers} widen to {compute} ({'; '.join(matmul_unfit)})" \
            if matmul_unfit else ""
        return (f"weights: {weights} — {stored_layers} layers rest in {held}, {matmul_layers} of them computed "
                f"as {label} matmuls writing {compute}{widened}; {saved}")
    return f"weights: {weights} — {stored_layers} layers rest in {held} and compute in {compute}; {saved}"


def _offload_state(plan: PlacementPlan, component: str) -> str:
    comp_plan = plan.components.get(component)
    if comp_plan is None or not comp_plan.offloaded or component in plan.resident:
        return "resident"
    return "streamed" if MODES[plan.offload].streams_weights else "offloaded"


def placement_rows(pipe, plan: PlacementPlan, patched: Mapping[tuple[str, str], tuple[str, ...]],
                   violations: list[Violation], hooks: HookRegistry,
                   modules: Iterable[tuple[str, str, torch.nn.Module]] | None = None,
                   packed: Mapping[tuple[str, str], str] | None = None) -> tuple[ModuleRow, ...]:
    """One row per module that owns tensors or carries a named hook (mixed devices show as `a+b`);
    with `modules` ((component, path, module)), the rows of those modules only, from their tensors alone.
    `packed` names the codec of each weight held packed from its file (`gguf Q4_K`: its bytes are uint8)."""
    packed = packed or {}
    bad = {(v.component, v.module) for v in violations}
    acc: dict[tuple[str, str], dict] = {}

    def row_for(comp: str, path: str, module) -> dict:
        return acc.setdefault((comp, path), {"cls": type(module).__name__, "devices": set(), "dtypes": set(),
                                             "floating": False, "params": 0, "bytes": 0, "hooks": hooks.names(module)})

    for comp, path, module, name, tensor, is_param in (iter_tensors(pipe) if modules is None
                                                       else iter_module_tensors(modules)):
        row = row_for(comp, path, module)
        row["devices"].add(str(tensor.device))
        codec = packed.get((comp, path)) if name == "weight" else None
        row["dtypes"].add(codec or storage_label(tensor.dtype))
        row["floating"] |= tensor.is_floating_point()
        row["params"] += tensor.numel() if is_param else 0
        row["bytes"] += tensor.numel() * tensor.element_size()
    if modules is None and any(True for _ in hooks.hooked()):  # blocks without tensors (group offload) show too
        for comp, component in torch_components(pipe).items():
            for path, module in component.named_modules():
                if hooks.names(module):
                    row_for(comp, path, module)
    rows = []
    for (comp, path), row in acc.items():
        offload = _offload_state(plan, comp)
        comp_plan = plan.components.get(comp)
        compute = dtype_name(comp_plan.compute.dtype) if comp_plan is not None and row["floating"] else ""
        kept = comp_plan.pinned.get((path, "weight")) if comp_plan is not None else None
        if kept in STORAGE_DTYPES.values():  # an fp8-matmul layer: its weight is never widened
            compute = f"{storage_label(kept)} matmul → {compute}"
        rows.append(ModuleRow(comp, path, row["cls"], _join(row["devices"]), _join(row["dtypes"]), compute,
                              row["params"],
                              round(row["bytes"] / 2**20, 3), tuple(patched.get((comp, path), ())), offload,
                              (comp, path) in bad, row["hooks"]))
    return tuple(rows)


def process_memory() -> dict[str, float]:
    """Resident RAM of this process and, on CUDA, allocated/reserved VRAM in MiB."""
    out = {"ram_mib": psutil.Process(os.getpid()).memory_info().rss / 2**20}
    if torch.cuda.is_available():
        out["vram_allocated_mib"] = torch.cuda.memory_allocated() / 2**20
        out["vram_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
    return out


def gpu_stats() -> list[dict] | str:
    """Per-GPU memory, utilisation and temperature from NVML; a note string when unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # NVML missing or no driver: a CPU box, not an error
        return f"NVML unavailable ({type(exc).__name__}: {exc}); running without GPU statistics"
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            gpus.append({
                "index": i,
                "name": pynvml.nvmlDeviceGetName(handle),
                "memory_used_mib": mem.used / 2**20,
                "memory_total_mib": mem.total / 2**20,
                "utilization_pct": util.gpu,
                "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            })
        return gpus
    finally:
        pynvml.nvmlShutdown()


class MemoryTimeline:
    """RAM/VRAM samples over the last minutes, with transition markers, for the timeline chart."""

    def __init__(self, seconds: float = 600.0) -> None:
        self._seconds = seconds
        self._samples: collections.deque[tuple[float, dict[str, float], str]] = collections.deque()
        self._lock = threading.Lock()

    def sample(self, marker: str = "") -> None:
        now = time.time()
        with self._lock:
            self._samples.append((now, process_memory(), marker))
            while self._samples and self._samples[0][0] < now - self._seconds:
                self._samples.popleft()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [{"t": t, **mem, "marker": marker} for t, mem, marker in self._samples]


class RecentLogHandler(logging.Handler):
    """Keeps the last N formatted log lines for the bug report."""

    def __init__(self, capacity: int = 500) -> None:
        super().__init__()
        self._lines: collections.deque[str] = collections.deque(maxlen=capacity)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self._lines.append(self.format(record))

    def lines(self) -> list[str]:
        return list(self._lines)


SHOWN_ERRORS_LOGGER = "app.ui.errors"  # `app.ui.common.user_errors` logs every error a page shows here


class ShownErrors(logging.Handler):
    """The errors the pages showed this session (a refused value, a failed generation: each toast of
    `user_errors`), newest last, for the Diagnostics tab and the bug report. The engine's own `last_error`
    holds only failed transitions; without these a report after a refused send said "no errors this
    session" while the user looked at a red toast. `attach` listens on `SHOWN_ERRORS_LOGGER`; `detach`
    stops (an app closing)."""

    def __init__(self, capacity: int = 50) -> None:
        super().__init__(logging.INFO)
        self._records: collections.deque[dict] = collections.deque(maxlen=capacity)
        self.count = 0  # every one shown, beyond `capacity` too

    def emit(self, record: logging.LogRecord) -> None:
        action, _, message = record.getMessage().partition(": ")
        self._records.append({"command": action, "message": message, "at": record.created, "traceback": "",
                              "shown": True})
        self.count += 1

    def records(self) -> list[dict]:
        return list(self._records)

    def attach(self) -> ShownErrors:
        logger = logging.getLogger(SHOWN_ERRORS_LOGGER)
        if logger.level == logging.NOTSET:  # a refusal is logged at INFO: kept whatever the root's level
            logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger(SHOWN_ERRORS_LOGGER).removeHandler(self)


def set_debug_logging(lora_debug: bool, move_debug: bool) -> None:
    """Apply the run-time debug toggles: DEBUG level on the adapter and placement loggers."""
    logging.getLogger("app.adapters").setLevel(logging.DEBUG if lora_debug else logging.INFO)
    logging.getLogger("app.engine.placement").setLevel(logging.DEBUG if move_debug else logging.INFO)
