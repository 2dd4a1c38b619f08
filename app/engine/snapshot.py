"""The engine's published picture: immutable records the worker builds after each transition.

The UI, the API and the bug report only ever read these; nothing in them refers back to live
tensors or to the pipeline, so a snapshot can be kept, compared and serialised freely.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from app import diagnostics
from app.adapters.specs import LoraSpec
from app.adapters.strength_schedule import StrengthSchedule
from app.engine import compiled, placement
from app.engine.desired import Desired
from app.engine.timeline import JobTimeline
from app.engine.upscaler_slot import UpscalerFacts


class EngineState(str, enum.Enum):
    EMPTY = "EMPTY"
    LOADING = "LOADING"
    READY = "READY"
    PATCHING = "PATCHING"
    MOVING = "MOVING"
    GENERATING = "GENERATING"
    ERROR = "ERROR"


@dataclass(frozen=True)
class Transition:
    """One row of the bounded history."""

    command: str
    detail: str
    state: str
    started: float
    duration_s: float
    outcome: str  # "ok" | "interrupted" | "failed, rolled back" | "failed, engine in ERROR"
    violations_found: int
    violations_repaired: int
    error: str | None = None

    @property
    def failed(self) -> bool:
        """An interrupted generation ended as asked: only a failure counts as one."""
        return self.outcome.startswith("failed")


@dataclass(frozen=True)
class ErrorRecord:
    command: str
    message: str
    traceback: str
    at: float


@dataclass(frozen=True)
class Progress:
    phase: str
    step: int
    total: int
    preview: tuple | None = None  # live preview pictures (PIL images) of the latents, while denoising
    preview_step: int | None = None  # the step those latents are of (a preview is shown a step later)


@dataclass(frozen=True)
class LoraState:
    """One LoRA of the wanted list as the engine sees it: the truth the UI draws."""

    name: str
    unet_strength: float
    te_strength: float
    status: str  # "applied" | "set aside" | "disabled" | "no model loaded"
    reason: str = ""  # why set aside or disabled
    schedule: StrengthSchedule | None = None  # the UNet strength by step (`unet_strength`: its step-0 one)

    @property
    def unet_shown(self) -> str:
        """The UNet strength as the page shows it: the schedule as typed, else the number."""
        return self.schedule.text if self.schedule is not None else f"{self.unet_strength:g}"


@dataclass(frozen=True)
class Snapshot:
    """An immutable picture of the engine, built by the worker after each transition."""

    state: str
    model: str | None = None
    family: str | None = None
    model_label: str | None = None  # "SD1.5", "SD1.5 inpainting": the family as the page names the loaded model
    model_hash: str | None = None  # None also while a first load's file is being read (file_scans)
    native_size: int | None = None  # the side, in pixels, the model was trained at (UNet sample size × VAE factor)
    defaults: tuple[int, float] | None = None  # the steps and guidance the page fills in for this model
    device: str = "cpu"
    dtype: str | None = None
    requested_dtype: str = "auto"
    offload: str = "none"
    weights: str = "full"  # as asked; "fp8": the large weights rest in 8 bits; "fp8-compute": and compute in fp8
    stored_layers: int = 0  # layers whose weight rests in 8 bits
    bytes_saved: int = 0  # by them, against the compute dtype
    matmul_layers: int = 0  # of them, computed as fp8 matmuls (fp8-compute)
    matmul_unfit: tuple[str, ...] = ()  # why the others widen instead: "n × reason", most first
    stored_as: tuple[str, ...] = ()  # layers per codec, most first: "120 × gguf Q4_K"
    resting_bytes: int = 0  # what the stored weights rest in, scales included
    loras: tuple[LoraSpec, ...] = ()  # applied to the model now
    lora_states: tuple[LoraState, ...] = ()  # every wanted LoRA: applied, set aside or disabled, and why
    lora_mode: str = "fused"  # "fused", "bypass" or "fused + bypass"
    lora_backups: str = "none"  # originals held for fused LoRAs: layers, size, where (LoraStack.backup_summary)
    placement: tuple[diagnostics.ModuleRow, ...] = ()
    violations: tuple[placement.Violation, ...] = ()  # found (and repaired) by the last transition
    violations_found_total: int = 0
    violations_repaired_total: int = 0
    lora_counters: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    timers: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    history: tuple[Transition, ...] = ()
    last_error: ErrorRecord | None = None
    progress: Progress | None = None
    embeddings: tuple[str, ...] = ()
    upscaler: UpscalerFacts | None = None  # the upscaler model loaded (Extras, hires fix), if any
    compile: compiled.CompileStatus | None = None
    queued: int = 0  # commands waiting behind the one running
    generating: bool = False  # a generation is running (Interrupt and Skip apply)
    desired: Desired = field(default_factory=Desired)  # what the engine holds now (the last one realised)
    held_for: str | None = None  # whose job asked for it (a session or API client; None: a direct change)
    last_generation: JobTimeline | None = None  # where the last generation's time went (app/engine/timeline.py)
    taken_at: float = 0.0

    @property
    def model_key(self) -> str | None:
        """What names the loaded model in a cache: its hash, or its name while the hash is being read."""
        return self.model_hash or self.model


@dataclass(frozen=True)
class LoadedFacts:
    """What the snapshot shows about the loaded model."""

    model: str
    family: str
    model_hash: str | None  # None while the file is being read (file_scans)
    native_size: int  # the side, in pixels, the model was trained at (UNet sample size × VAE factor)
    defaults: tuple[int, float]  # Family.defaults_for
    dtype: torch.dtype
    offload: str
    loras: tuple[LoraSpec, ...]
    lora_mode: str  # "fused", "bypass" or "fused + bypass"
    embeddings: tuple[str, ...]
    set_aside: Mapping[str, str]
    weights: str  # "full", or how the large weights are stored ("fp8", "fp8-compute")
    stored_layers: int  # layers whose weight rests in that dtype
    bytes_saved: int  # against holding them in the compute dtype
    lora_backups: str  # originals held for fused LoRAs: layers, size, where (LoraStack.backup_summary)
    matmul_layers: int = 0  # stored layers computed as fp8 matmuls
    matmul_unfit: tuple[str, ...] = ()  # why the other stored layers widen instead (MatmulLayers.unfit_summary)
    label: str = ""  # what the page calls it: the family's label, "SD1.5 inpainting" for an inpainting checkpoint
    stored_as: tuple[str, ...] = ()  # layers per codec (storage.codec_counts)
    resting_bytes: int = 0  # what the stored weights rest in (storage.resting_bytes)


def lora_states(wanted: tuple[LoraSpec, ...], facts: LoadedFacts | None,
                counters: Mapping[str, object]) -> tuple[LoraState, ...]:
    """Each wanted LoRA's status on the loaded model."""
    applied = {s.name for s in facts.loras} if facts is not None else set()
    out = []
    for spec in wanted:
        counter = counters.get(spec.name)
        if facts is None:
            status, reason = "no model loaded", ""
        elif spec.name in applied:
            status, reason = "applied", ""
        elif counter is not None and counter.disabled:
            status, reason = "disabled", counter.message
        else:
            status, reason = "set aside", facts.set_aside.get(spec.name, "")
        out.append(LoraState(spec.name, spec.unet_strength, spec.te_strength, status, reason, spec.schedule))
    return tuple(out)


def build_snapshot(*, state: str, device: str, desired: Desired, facts: LoadedFacts | None, rows, violations,
                   upscaler: UpscalerFacts | None,
                   found_total: int, repaired_total: int, counters: MappingProxyType, timers: dict,
                   history: tuple[Transition, ...], last_error: ErrorRecord | None,
                   held_for: str | None = None) -> Snapshot:
    common = dict(state=state, device=device, requested_dtype=desired.dtype, offload=desired.offload,
                  weights=desired.weights, upscaler=upscaler, placement=rows,
                  violations=violations, violations_found_total=found_total, violations_repaired_total=repaired_total,
                  lora_counters=counters, timers=MappingProxyType(timers), history=history, last_error=last_error,
                  lora_states=lora_states(desired.loras, facts, counters), desired=desired, held_for=held_for,
                  taken_at=time.time())
    if facts is None:
        return Snapshot(**common)
    return Snapshot(model=facts.model, family=facts.family, model_label=facts.label or facts.family,
                    model_hash=facts.model_hash, native_size=facts.native_size,
                    defaults=facts.defaults, dtype=placement.dtype_name(facts.dtype), loras=facts.loras,
                    lora_mode=facts.lora_mode, embeddings=facts.embeddings, stored_layers=facts.stored_layers,
                    bytes_saved=facts.bytes_saved, lora_backups=facts.lora_backups, matmul_layers=facts.matmul_layers,
                    matmul_unfit=facts.matmul_unfit, stored_as=facts.stored_as, resting_bytes=facts.resting_bytes,
                    **common)
