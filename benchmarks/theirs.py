"""The diffusers side: the same model the way a diffusers user runs it (PEFT adapters for LoRAs,
diffusers' own offload modes), with one pipeline alive beside our engine so both run in ABBA order."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file

from app.families import family
from benchmarks.config import PROMPT, SEED, Bench, guidance, has_package
from benchmarks.denoiser import denoiser_of
from benchmarks.measure import free_memory, timed_ms
from benchmarks.workload import PreparedModel

log = logging.getLogger("bench")

OFFLOAD_LABELS = {"model": "enable_model_cpu_offload", "sequential": "enable_sequential_cpu_offload",
                  "group": "enable_group_offload (blocks, stream)"}
_NEEDS_ACCELERATE = ("model", "sequential")


def _enable_offload(pipe, case: str, device: torch.device) -> None:
    if case == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif case == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        pipe.enable_group_offload(onload_device=device, offload_type="block_level", num_blocks_per_group=1,
                                  use_stream=True)


def euler(family_name: str, scheduler_config):
    """The family's "Euler" sampler (SD's Euler discrete, Flux's flow-match Euler), which ours runs too."""
    cls, overrides = family(family_name).sampling.samplers["Euler"]
    return cls.from_config(scheduler_config, **overrides)


def load_pipeline(model: PreparedModel, bench: Bench, to_device: bool = True):
    """The saved folder loaded the way a diffusers user loads it, with the sampler ours uses."""
    fam = family(model.family)
    pipe = fam.plain_pipeline_class.from_pretrained(model.folder, dtype=bench.dtype, local_files_only=True,
                                                    **fam.pipeline_kwargs)
    pipe.scheduler = euler(model.family, pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    if to_device:
        pipe.to(bench.device)
    return pipe


def generator(pipe, model: PreparedModel, bench: Bench, batch: int) -> Callable[[], Any]:
    side = bench.config.resolution[model.family]
    family_arguments = family(model.family).call_arguments(guidance(model.family))

    def generate():
        generators = [torch.Generator("cpu").manual_seed(SEED + i) for i in range(batch)]
        return pipe(prompt=PROMPT, num_inference_steps=bench.config.steps, width=side, height=side,
                    num_images_per_prompt=batch, generator=generators, output_type="pil", **family_arguments).images

    return generate


class DiffusersSide:
    """One diffusers pipeline and its PEFT adapter state, driven to whatever state a variant needs.

    `to_state(count, fused)` is a variant's untimed setup: the adapters are unloaded whenever the
    count changes (so "no LoRA" is plain diffusers without PEFT wrappers, and one LoRA is not slowed
    by two inactive ones) and re-loaded from the files, fused into the weights when asked.
    """

    def __init__(self, model: PreparedModel, bench: Bench) -> None:
        self.model, self.bench = model, bench
        self.pipe = None
        self.notes: dict[str, str] = {}
        if not has_package("peft"):
            self.notes["lora"] = "diffusers loads LoRAs through peft, which is not installed"
        self._count, self._fused = 0, False
        self._fused_components = [family(model.family).denoiser]  # the LoRAs cover the denoiser only

    def load(self) -> float:
        """Load (timed, the GPU drained before and after); returns seconds."""
        self.free()
        return timed_ms(lambda: setattr(self, "pipe", load_pipeline(self.model, self.bench)), self.bench.device) / 1e3

    def free(self) -> None:
        self.pipe = None
        self._count, self._fused = 0, False
        free_memory()

    def generator(self, batch: int) -> Callable[[], Any]:
        return generator(self.pipe, self.model, self.bench, batch)

    @property
    def denoiser(self) -> torch.nn.Module:
        return denoiser_of(self.pipe)

    @property
    def names(self) -> list[str]:
        return [f"l{i}" for i in range(self._count)]

    def _load_adapter(self, index: int) -> None:
        """Read the file and give diffusers the tensors (a fresh dict: it may rewrite the one it gets)."""
        self.pipe.load_lora_weights(load_file(str(self.model.lora_paths[index])), adapter_name=f"l{index}")

    def to_state(self, count: int, fused: bool) -> None:
        if (count, fused) == (self._count, self._fused):
            return
        if self._fused:
            self.pipe.unfuse_lora(components=self._fused_components)
            self._fused = False
        if count != self._count:
            if self._count:
                self.pipe.unload_lora_weights()
            for index in range(count):
                self._load_adapter(index)
            self._count = count
        if count:
            self.pipe.set_adapters(self.names, [1.0] * count)
        if fused and count:
            self.pipe.fuse_lora(components=self._fused_components, adapter_names=self.names)
            self._fused = True

    def state_setup(self, count: int, fused: bool) -> Callable[[], None]:
        return functools.partial(self.to_state, count, fused)

    def _change(self, weights: list[float], change: Callable[[], Any] | None = None) -> None:
        """One LoRA change the diffusers way; a fused stack is unfused first and fused again after,
        since PEFT cannot re-weight or remove an adapter that is merged into the weights."""
        if self._fused:
            self.pipe.unfuse_lora(components=self._fused_components)
        if change is not None:
            change()
        self.pipe.set_adapters(self.names, weights)
        if self._fused:
            self.pipe.fuse_lora(components=self._fused_components, adapter_names=self.names)

    def latency_round(self, fused: bool, reweights: int) -> dict[str, list[float]]:
        """Add a third LoRA on top of two, re-weight it `reweights` times, remove it (ms each)."""
        self.to_state(2, fused)
        device, times = self.bench.device, {"add": [], "reweight": [], "remove": []}

        def add():
            self._load_adapter(2)
            self._count = 3

        def remove():
            self.pipe.delete_adapters("l2")
            self._count = 2

        times["add"].append(timed_ms(functools.partial(self._change, [1.0] * 3, add), device))
        for i in range(reweights):
            times["reweight"].append(timed_ms(functools.partial(self._change, [1.0, 1.0, 1.1 - i % 2 / 10]), device))
        times["remove"].append(timed_ms(functools.partial(self._change, [1.0, 1.0], remove), device))
        return times

    def offload_pipeline(self, case: str):
        """A fresh pipeline with diffusers' offload `case` enabled (sequential offload leaves weights on
        `meta` and group offload has no public undo, so none is reused), or None with a note."""
        label = OFFLOAD_LABELS[case]
        if self.bench.device.type != "cuda":
            self.notes[f"offload:{case}"] = f"diffusers {label} needs a CUDA device"
            return None
        if case in _NEEDS_ACCELERATE and not has_package("accelerate"):
            self.notes[f"offload:{case}"] = f"diffusers {label} needs accelerate, which is not installed"
            return None
        pipe = load_pipeline(self.model, self.bench, to_device=False)
        try:
            _enable_offload(pipe, case, self.bench.device)
        except Exception as exc:  # noqa: BLE001 - reported in the row, the run goes on
            self.notes[f"offload:{case}"] = f"diffusers {label} failed: {type(exc).__name__}: {exc}"
            log.warning("[%s] %s", self.model.family, self.notes[f"offload:{case}"])
            return None
        return pipe
