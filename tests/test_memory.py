"""Memory across switches: switching models and adding/removing LoRAs over and over returns the
process's RAM (and, on a GPU, its VRAM) instead of accumulating it.

What would leak: a swapped-out pipeline kept alive by a hook, a strategy or a LoRA stack; backups
of patched layers kept after their LoRA is removed; parsed adapter files piling up. The engine
drops the old model, collects and calls `malloc_trim`, so resident memory after each cycle must
stay within 5% of what it was after the first cycle (which already holds every cache a cycle
fills). After every removal the LoRA stack must hold zero backups and zero parsed adapters.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import weakref
from pathlib import Path

import psutil
import pytest
import torch

from app.adapters.errors import LoraApplyError
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import write_adapter
from app.demo import build_tiny_pipeline
from app.engine.worker import Engine
from app.settings import Settings

MODELS = {"sd15": "tiny-sd15.safetensors", "sdxl": "tiny-sdxl.safetensors"}
ALGOS = ("lora", "loha", "lokr", "dora", "full")
MODEL_CYCLES, LORA_CYCLES, TOLERANCE = 10, 50, 0.05


def rss() -> int:
    return psutil.Process().memory_info().rss


def lora_list(family_name: str, weight: float = 1.0) -> list[LoraSpec]:
    return [LoraSpec(f"{family_name}-{algo}", weight) for algo in ALGOS]


def assert_stack_empty(engine: Engine) -> None:
    stack = engine.lora_stack
    assert stack._backups == {}, f"{len(stack._backups)} backups kept after every LoRA was removed"
    assert stack.bypassed() == {}, f"{len(stack.bypassed())} bypass layers kept after every LoRA was removed"
    assert stack._prepared == {} and stack.applied == ()


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("memory")
    for sub in ("models/Stable-diffusion", "embeddings"):
        shutil.copytree(demo_dir / sub, target / sub, copy_function=os.link)
    for family_name in MODELS:
        pipe = build_tiny_pipeline(family_name)
        for algo in ALGOS:
            write_adapter(target / "models" / "Lora" / f"{family_name}-{algo}.safetensors", pipe, family_name, algo,
                          "lycoris")
    return target


@pytest.fixture(autouse=True)
def records_not_retained():
    """Measure the engine, not pytest: pytest's log capture keeps every LogRecord of a test, and a
    record whose args or exc_info hold an exception pins its traceback's frames — and through
    them whole pipelines (see `test_retained_log_records_do_not_pin_swapped_out_models`). Here
    the app's records stop at a NullHandler instead of reaching the capture handler."""
    logger = logging.getLogger("app")
    handler, propagate = logging.NullHandler(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    yield
    logger.removeHandler(handler)
    logger.propagate = propagate


def _within(readings: list[int], what: str) -> None:
    first = readings[0]
    worst = max(readings[1:])
    mib = [round(r / 2**20, 1) for r in readings]
    print(f"{what}: RSS per cycle (MiB) {mib}")
    assert worst <= first * (1 + TOLERANCE), f"{what}: RSS grew from {mib[0]} MiB to {max(mib)} MiB: {mib}"


def test_switching_models_back_and_forth_returns_ram(data):
    """Ten SD1.5 → SDXL → SD1.5 cycles, each model swapped out with five LoRAs fused (so its stack
    holds backups): RSS after every cycle stays within 5% of the first cycle's. The other
    architecture's LoRAs do not fit the new model, so the load skips them and starts with an
    empty stack."""
    engine = Engine(Settings(data_dir=data, device="cpu"))
    readings = []
    try:
        for _ in range(MODEL_CYCLES):
            for family_name in ("sd15", "sdxl"):
                snap = engine.load_model(MODELS[family_name], dtype="fp32")
                assert snap.history[-1].outcome == "ok"
                assert_stack_empty(engine)
                snap = engine.set_loras(lora_list(family_name))
                assert len(snap.loras) == len(ALGOS) and engine.lora_stack._backups
            readings.append(rss())
        engine.unload()
    finally:
        engine.close()
    _within(readings, "model switches")


def test_adding_and_removing_loras_returns_ram_and_frees_backups(data):
    """Fifty add/re-weight/remove cycles of five LoRAs of different algorithms: after each removal
    the stack holds no backup and no parsed adapter, and RSS stays within 5% of the first cycle."""
    engine = Engine(Settings(data_dir=data, device="cpu"))
    readings = []
    try:
        engine.load_model(MODELS["sd15"], dtype="bf16")
        for i in range(LORA_CYCLES):
            engine.set_loras(lora_list("sd15"))
            engine.set_loras(lora_list("sd15", weight=-0.5 + i / LORA_CYCLES))
            engine.set_loras(lora_list("sd15")[::2])
            snap = engine.set_loras([])
            assert snap.loras == () and snap.history[-1].outcome == "ok"
            assert_stack_empty(engine)
            readings.append(rss())
    finally:
        engine.close()
    _within(readings, "LoRA add/remove")


def test_unload_releases_the_model(data):
    """After unload the pipeline, its stack and its strategy are gone: RSS drops back below what it
    was with the model loaded, by at least the size of the model's weights."""
    engine = Engine(Settings(data_dir=data, device="cpu"))
    try:
        engine.load_model(MODELS["sdxl"], dtype="fp32")
        engine.set_loras(lora_list("sdxl"))
        size = sum(p.numel() * p.element_size() for c in ("unet", "vae", "text_encoder", "text_encoder_2")
                   for p in getattr(engine.pipeline, c).parameters())
        loaded = rss()
        engine.unload()
        assert engine.pipeline is None
        assert rss() <= loaded - 0.8 * size, (loaded, rss(), size)
    finally:
        engine.close()


class KeepRecords(logging.Handler):
    """What pytest's caplog, `logging.handlers.MemoryHandler` or a queue backlog do: keep records."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _assert_sd15_freed_after_swap(data, prepare) -> None:
    """Run `prepare(engine, records)` with SD1.5 loaded and a record-keeping log handler attached,
    then swap SD1.5 for SDXL: the SD1.5 UNet must be freed despite the retained records."""
    keep = KeepRecords()
    logger = logging.getLogger("app")
    logger.addHandler(keep)
    engine = Engine(Settings(data_dir=data, device="cpu"))
    try:
        prepare(engine, keep.records)
        unet = weakref.ref(engine.pipeline.unet)
        engine.load_model(MODELS["sdxl"], dtype="fp32")
        gc.collect()
        assert unet() is None, "the swapped-out SD1.5 UNet is still alive"
    finally:
        logger.removeHandler(keep)
        engine.close()


def test_retained_log_records_do_not_pin_swapped_out_models(data):
    """A log handler that keeps records must not keep a swapped-out model alive: the engine's
    records should carry text, not live exceptions whose tracebacks reference the pipeline.
    Scenario: SD1.5 loads while an SDXL LoRA is desired (it does not fit and is skipped, with a
    warning); then SDXL replaces SD1.5 — the SD1.5 UNet must be freed."""
    def prepare(engine, records):
        engine.load_model(MODELS["sdxl"], dtype="fp32")
        engine.set_loras([LoraSpec("sdxl-lora")])
        engine.load_model(MODELS["sd15"], dtype="fp32")
        assert any("set aside" in r.getMessage() for r in records)

    _assert_sd15_freed_after_swap(data, prepare)


def test_retained_failure_records_do_not_pin_swapped_out_models(data):
    """The same for a failed transition's error record: a refused set_loras on SD1.5 is recorded
    (its traceback kept as text for Diagnostics and the bug report; the log has one line), then
    SDXL replaces SD1.5 — the SD1.5 UNet must be freed."""
    def prepare(engine, records):
        engine.load_model(MODELS["sd15"], dtype="fp32")
        with pytest.raises(LoraApplyError):
            engine.set_loras([LoraSpec("sdxl-lora")])
        error = engine.snapshot().last_error
        assert error.command == "set_loras" and "Traceback" in error.traceback

    _assert_sd15_freed_after_swap(data, prepare)


@pytest.mark.gpu
def test_gpu_switches_return_vram_and_ram(data):
    """On CUDA, every offload mode: model switches and LoRA add/remove cycles return allocated
    VRAM to exactly the first cycle's figure (the caching allocator is emptied on release) and RSS
    to within 5%."""
    engine = Engine(Settings(data_dir=data, device="cuda"))
    try:
        for offload in ("none", "model", "sequential", "group", "balanced"):
            engine.set_offload(offload)
            vram, ram = [], []
            for i in range(MODEL_CYCLES):
                for family_name in ("sd15", "sdxl"):
                    engine.set_loras([])
                    engine.load_model(MODELS[family_name], dtype="fp16" if i % 2 else "bf16")
                    engine.set_loras(lora_list(family_name))
                    engine.set_loras([])
                    assert_stack_empty(engine)
                torch.cuda.synchronize()
                vram.append(torch.cuda.memory_allocated())
                ram.append(rss())
            assert max(vram[1:]) <= vram[0], (offload, vram)
            _within(ram, f"GPU model switches ({offload})")
    finally:
        engine.close()
