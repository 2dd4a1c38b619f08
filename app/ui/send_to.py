""""Send to Generate": an infotext (from PNG Info or History) becomes the Generate tab's settings.

Prompt, negative prompt, sampler, steps, CFG, seed and size are put in as written: a value our
rules refuse (say 200 steps from another tool) is refused by Generate with the range, never
clamped here. LoRAs are selected with both weights and handed to the engine the same way as a
pick in the selector. The checkpoint is found by the infotext's "Model hash" (sha256[:10] of
the file, as A1111 writes it), else by its "Model" name, and loaded before the LoRAs are
applied. Whatever cannot be matched is listed in the Generate tab's note.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from app.adapters.specs import LoraSpec
from app.engine import models
from app.engine.generate import SCHEDULERS
from app.infotext import Infotext, parse_infotext
from app.ui.common import MAX_LORAS, PROGRESS, UiContext, run_with_progress, user_errors
from app.ui.generate_tab import GenerateTab, loaded_text
from app.ui.lora_panel import LORA_QUEUE, selection_updates, sync_panel

# Generate-tab field -> infotext key; numbers are parsed, the rest taken as text.
_NUMBERS = {"steps": "Steps", "cfg": "CFG scale", "seed": "Seed"}
_FIELDS = ("prompt", "negative", "sampler", "steps", "cfg", "seed", "width", "height")


@dataclass(frozen=True)
class SendPlan:
    """What sending an infotext changes: field values, the checkpoint to load (None: keep), LoRAs, notes."""

    fields: dict[str, object]
    checkpoint: str | None
    loras: tuple[LoraSpec, ...]
    notes: tuple[str, ...]


def _number(text: str, key: str, notes: list[str]) -> float | int | None:
    try:
        value = float(text)
    except ValueError:
        notes.append(f"{key} {text!r} is not a number; left as it was")
        return None
    return int(value) if value.is_integer() else value


def _settings_fields(settings: dict[str, str], notes: list[str]) -> dict[str, object]:
    fields: dict[str, object] = {}
    for field, key in _NUMBERS.items():
        if key in settings and (value := _number(settings[key], key, notes)) is not None:
            fields[field] = value
    width, sep, height = settings.get("Size", "").partition("x")
    if sep:
        for field, text in (("width", width), ("height", height)):
            if (value := _number(text, "Size", notes)) is not None:
                fields[field] = value
    sampler, schedule = settings.get("Sampler", ""), settings.get("Schedule type", "")
    match = next((s for s in (f"{sampler} {schedule}", sampler) if s in SCHEDULERS), None)
    if match:
        fields["sampler"] = match
    elif sampler:
        notes.append(f"sampler {sampler!r} is not available here ({', '.join(SCHEDULERS)}); left as it was")
    return fields


def find_checkpoint(ctx: UiContext, model_hash: str, model_name: str) -> tuple[str | None, str]:
    """(checkpoint name, note): by hash first — the loaded model without hashing anything — then by name."""
    snap = ctx.engine.snapshot()
    if model_hash and model_hash == snap.model_hash:
        return snap.model, ""
    infos = models.discover_checkpoints(ctx.settings.checkpoints_dir)
    stem = Path(model_name).stem if model_name else ""
    by_name = [i for i in infos if model_name and (i.name == model_name or Path(i.name).stem == stem)]
    if model_hash:
        for info in [*by_name, *(i for i in infos if i not in by_name)]:
            if ctx.hashes.short(models.weights_file(info), len(model_hash)) == model_hash:
                return info.name, ""
    if by_name:
        differs = f"; its hash differs from {model_hash}" if model_hash else ""
        return by_name[0].name, f"checkpoint {by_name[0].name} found by name{differs}"
    wanted = " ".join(filter(None, (model_name, f"(hash {model_hash})" if model_hash else "")))
    return None, f"checkpoint {wanted or '(not recorded)'} is not among yours; kept {snap.model or 'none'}"


def plan_send(ctx: UiContext, info: Infotext) -> SendPlan:
    notes: list[str] = []
    fields = {"prompt": info.prompt, "negative": info.negative_prompt, **_settings_fields(info.settings, notes)}
    checkpoint, note = find_checkpoint(ctx, info.settings.get("Model hash", ""), info.settings.get("Model", ""))
    notes.append(note)
    known = set(ctx.engine.library.names())
    loras = tuple(spec for spec in info.loras if spec.name in known)[:MAX_LORAS]
    notes += [f"LoRA {spec.name} is not in {ctx.settings.lora_dir}" for spec in info.loras if spec.name not in known]
    if len(loras) < len([s for s in info.loras if s.name in known]):
        notes.append(f"only the first {MAX_LORAS} LoRAs were selected")
    keep = None if checkpoint == ctx.engine.snapshot().model else checkpoint
    return SendPlan(fields, keep, loras, tuple(n for n in notes if n))


def wire_send(ctx: UiContext, button: gr.Button, text: gr.Textbox, tab: GenerateTab, tabs: gr.Tabs,
              progress_on: gr.components.Component) -> None:
    """Clicking `button` sends the infotext in `text` to the Generate tab and switches to it. Progress
    (a model load) and a failure's mark show on `progress_on`, beside the button, not on the fields."""
    slots, engine = tab.loras, ctx.engine

    def send(infotext, progress=PROGRESS):
        with user_errors("Sending to Generate"):
            plan = plan_send(ctx, parse_infotext(infotext or ""))
            status = gr.update()
            if plan.checkpoint is not None:
                status = loaded_text(run_with_progress(engine, lambda: engine.load_model(plan.checkpoint), progress))
        fields = [gr.update(value=plan.fields[f]) if f in plan.fields else gr.update() for f in _FIELDS]
        note = "\n\n".join(["ℹ️ Settings sent from an infotext.", *(f"⚠ {n}" for n in plan.notes)])
        return [*fields, note, gr.Dropdown(value=engine.snapshot().model), status,
                *selection_updates(ctx, list(plan.loras)), gr.Tabs(selected="generate")]

    outputs = [tab.prompt, tab.negative, tab.sampler, tab.steps, tab.cfg, tab.seed, tab.width, tab.height, tab.note,
               tab.model, tab.model_status, slots.select, *slots.layout, tabs]
    button.click(send, text, outputs, api_visibility="private", concurrency_id=LORA_QUEUE,
                 show_progress_on=[progress_on]).success(
        **sync_panel(ctx, slots))
