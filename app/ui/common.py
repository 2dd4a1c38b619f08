"""What every tab and the API share: the context object, engine-call helpers, input validation.

Engine calls block until the worker has run them. Handlers run them in a helper thread and
poll `engine.snapshot().progress` meanwhile, so a Gradio progress bar follows the real phases
(loading, placing, applying LoRAs, denoising steps) and the page stays responsive.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from app.adapters.specs import LoraSpec
from app.engine import models
from app.engine.generate import GeneratedImage, GenerateParams
from app.engine.worker import Engine
from app.paths import UnsafePathError, resolve_under
from app.settings import Settings
from app.ui.lora_cards import CardCache

log = logging.getLogger(__name__)
POLL_S = 0.15
MAX_LORAS = 8  # slots on the Generate tab; the API takes any number
# Gradio finds a progress tracker by a parameter *default* that is a `gr.Progress`, and only among
# positional parameters; handlers with `*values` therefore put `progress=PROGRESS` first.
PROGRESS = gr.Progress()


@dataclass
class UiContext:
    """The engine plus what the UI keeps beside it (log capture for reports, secrets to redact)."""

    engine: Engine
    settings: Settings
    log_lines: Callable[[], list[str]] = list
    secrets: tuple[str, ...] = ()
    cards: CardCache = field(default_factory=CardCache)


@contextlib.contextmanager
def user_errors(action: str) -> Iterator[None]:
    """Turn any failure into a `gr.Error` with its message (the engine log keeps the traceback)."""
    try:
        yield
    except gr.Error:
        raise
    except Exception as exc:
        log.info("%s refused: %s", action, str(exc))
        raise gr.Error(f"{action} failed: {exc}", duration=None) from exc


def run_with_progress(engine: Engine, call: Callable[[], Any], progress: gr.Progress | None) -> Any:
    """Run a blocking engine call in a helper thread; report the engine's phase/step until it returns."""
    future: Future = Future()

    def target() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting handler
            future.set_exception(exc)

    threading.Thread(target=target, name="ui-engine-call", daemon=True).start()
    while not future.done():
        snap = engine.snapshot()
        if progress is not None:
            if snap.progress is not None and snap.progress.total:
                progress((snap.progress.step, snap.progress.total), desc=snap.progress.phase, unit="steps")
            else:
                progress(None, desc=f"engine {snap.state}")
        time.sleep(POLL_S)
    return future.result()


def checkpoint_names(settings: Settings) -> list[str]:
    """Checkpoints the user may pick: only what discovery finds under the checkpoints folder."""
    return [info.name for info in models.discover_checkpoints(settings.checkpoints_dir)]


def checked_checkpoint(settings: Settings, name: str) -> str:
    """Accept only a discovered checkpoint name (never a path) so the API cannot load arbitrary files."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError("checkpoint name is empty")
    resolve_under(settings.checkpoints_dir, name, "checkpoint")
    known = checkpoint_names(settings)
    if name not in known:
        raise ValueError(f"checkpoint {name!r} is not in {settings.checkpoints_dir}; available: {', '.join(known)}")
    return name


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def specs_from_json(items: Any) -> list[LoraSpec]:
    """`[{"name": str, "weight": 1.0, "unet_weight"?: x, "te_weight"?: y}, ...]` (or `[name, weight]` pairs)."""
    if not isinstance(items, list):
        raise ValueError("loras must be a list of {name, weight[, unet_weight, te_weight]} objects")
    specs = []
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            item = {"name": item[0], "weight": item[1]}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"each LoRA needs a string 'name'; got {item!r}")
        unknown = set(item) - {"name", "weight", "unet_weight", "te_weight"}
        if unknown:
            raise ValueError(f"LoRA {item['name']!r}: unknown fields {sorted(unknown)}")
        optional = {k: _finite(item[k], f"{item['name']}.{k}") for k in ("unet_weight", "te_weight")
                    if item.get(k) is not None}
        specs.append(LoraSpec(item["name"], _finite(item.get("weight", 1.0), f"{item['name']}.weight"), **optional))
    return specs


def generate_params(prompt, negative, sampler, steps, cfg, seed, width, height, batch) -> GenerateParams:
    """Form/API values (numbers may arrive as floats from sliders and JSON) -> validated parameters."""
    return GenerateParams(prompt or "", negative or "", steps=int(steps), cfg=float(cfg), seed=int(seed),
                          width=int(width), height=int(height), batch=int(batch), sampler=sampler)


def gallery_items(images: list[GeneratedImage]) -> list[tuple]:
    """The saved PNGs (infotext inside, so a download keeps it), captioned with their seeds."""
    return [(str(im.path) if im.path else im.image, f"seed {im.seed}") for im in images]


def snapshot_summary(ctx: UiContext) -> dict:
    """A short JSON answer for mutating endpoints: state, model, placement policy, LoRAs and counters."""
    snap = ctx.engine.snapshot()
    return {
        "state": snap.state, "model": snap.model, "arch": snap.arch, "device": snap.device, "dtype": snap.dtype,
        "offload": snap.offload,
        "loras": [{"name": s.name, "unet_weight": s.unet_strength, "te_weight": s.te_strength} for s in snap.loras],
        "lora_counters": {k: {"matched_layers": v.matched_layers, "unmatched_keys": v.unmatched_keys,
                              "apply_errors": v.apply_errors, "runtime_errors": v.runtime_errors,
                              "message": v.message} for k, v in snap.lora_counters.items()},
        "patched_modules": sum(1 for row in snap.placement if row.loras),
        "violations": len(snap.violations),
    }
