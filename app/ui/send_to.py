""""Send to Generate" and "Send to img2img": an infotext (from PNG Info or History) becomes a tab's
settings; img2img also takes the picture itself as its init image.

Prompt, negative prompt, sampler, steps, CFG, seed, size (and, for img2img, the denoising strength) are
put in as written: a value our rules refuse (say 200 steps from another tool) is refused by the tab with
the range, never clamped here. They go into the LOADED family's controls (`fit_to_family`,
`family_control`): its sampler list, a sampler it lacks becoming its nearest with a note, and its
guidance's name and range; a dropdown is never handed a value it would refuse at the next run. LoRAs are
selected with both weights and handed to the engine the same way as a pick in the selector (img2img runs
with the engine's LoRAs too). The checkpoint is found by the infotext's "Model hash" (sha256[:10] of the
file, as A1111 writes it), else by its "Model" name, and loaded before the LoRAs are applied. Whatever
cannot be matched is listed in the receiving tab's note. A picture without infotext still goes in as the
init image; the settings then stay as they were, and the note says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from app.adapters.specs import LoraSpec
from app.engine import checkpoint_files
from app.engine.generate import SCHEDULERS
from app.families import Family, family
from app.image_inputs import open_checked
from app.infotext import Infotext, parse_infotext
from app.ui.common import MAX_LORAS, NO_REFINER, PROGRESS, UiContext, run_with_progress, user_errors
from app.ui.controlnet_panel import fields_from_infotext as controlnet_fields
from app.ui.detailer_panel import fields_from_infotext as detailer_fields
from app.ui.generate_tab import GenerateTab, family_updates, loaded_text, native_size_updates
from app.ui.img2img_tab import Img2ImgTab, family_fill
from app.ui.lora_panel import LORA_QUEUE, selection_updates, sync_panel

# Plan field -> infotext key; numbers are parsed, the rest taken as text.
_NUMBERS = {"steps": "Steps", "cfg": "CFG scale", "seed": "Seed", "denoising_strength": "Denoising strength",
            "clip_skip": "Clip skip", "subseed": "Variation seed", "subseed_strength": "Variation seed strength",
            "refiner_switch_at": "Refiner switch at", "step_cache": "Step cache"}
_REFINER = re.compile(r"(?P<name>.*?)(?: \[(?P<hash>[0-9a-fA-F]+)\])?")  # A1111's "name [short hash]"
# "W x H" infotext keys -> the two plan fields they fill.
_SIZES = {"Size": ("width", "height"), "Seed resize from": ("seed_resize_from_w", "seed_resize_from_h")}
# Fields an infotext without them resets, so the sent settings make the same image: no variation mixed
# in, clip skip 1 (A1111 writes no `Clip skip` at 1, and reads its absence so), no step cache.
_RESET = {"clip_skip": 1, "subseed_strength": 0, "seed_resize_from_w": 0, "seed_resize_from_h": 0, "step_cache": 0}
# The fields both tabs' settings lists start with, in that order.
_FIELDS = ("prompt", "negative", "sampler", "steps", "cfg", "seed", "width", "height")
NO_INFOTEXT = ("⚠ No infotext came with it: the settings were left as they were (other tools, screenshots and "
               "re-saved copies drop the PNG's `parameters` text).")


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


def fields_from_infotext(settings: dict[str, str], notes: list[str]) -> dict[str, object]:
    """The plan fields an infotext's settings give; what cannot be read is named in `notes`."""
    fields: dict[str, object] = dict(_RESET)
    for field, key in _NUMBERS.items():
        if key in settings and (value := _number(settings[key], key, notes)) is not None:
            fields[field] = value
    for key, pair in _SIZES.items():
        first, sep, second = settings.get(key, "").partition("x")
        if sep:
            for field, text in zip(pair, (first, second), strict=True):
                if (value := _number(text, key, notes)) is not None:
                    fields[field] = value
    if (distilled := settings.get("Distilled CFG Scale")) and (value := _number(distilled, "Distilled CFG Scale",
                                                                                 notes)) is not None:
        fields["distilled_cfg"] = value  # the guidance of a guidance-distilled family (`fit_to_family`)
    sampler, schedule = settings.get("Sampler", ""), settings.get("Schedule type", "")
    match = next((s for s in (f"{sampler} {schedule}", sampler) if s in SCHEDULERS), None)
    if match:
        fields["sampler"] = match
    elif sampler:
        notes.append(f"sampler {sampler!r} is not available here ({', '.join(SCHEDULERS)}); left as it was")
    return fields


def nearest_sampler(fam: Family, sampler: str) -> str:
    """`fam`'s own sampler for `sampler`: itself where `fam` has it, else the one the family names as its
    nearest (`Sampling.nearest_samplers`, what the A1111 API runs too), else the one of the same method (the first
    word: "Euler a" -> "Euler", "DPM++ 2M Karras" -> "DPM++ 2M"), else `fam`'s default."""
    if sampler in fam.sampling.samplers:
        return sampler
    if sampler in fam.sampling.nearest_samplers:
        return fam.sampling.nearest_samplers[sampler]
    method = sampler.split(" ")[0]
    return next((own for own in fam.sampling.samplers if own.split(" ")[0] == method), fam.sampling.default_sampler)


def fit_to_family(fields: dict[str, object], fam: Family, notes: list[str]) -> dict[str, object]:
    """The sent fields as the loaded family's controls take them: a sampler it lacks becomes its nearest
    (named in `notes`: the dropdown would refuse it, and the next run failed with Gradio's raw "not in the
    list of choices"); a guidance-distilled family takes the infotext's `Distilled CFG Scale` (its `CFG
    scale` is 1: no CFG ran), another family the `CFG scale`."""
    fitted = dict(fields)
    distilled = fitted.pop("distilled_cfg", None)
    if fam.sampling.distilled_guidance and distilled is not None:
        fitted["cfg"] = distilled
    sampler = fitted.get("sampler")
    if isinstance(sampler, str) and (own := nearest_sampler(fam, sampler)) != sampler:
        notes.append(f"sampler {sampler!r}: {fam.label} has no such sampler; {own!r}, the nearest it has, was put in")
        fitted["sampler"] = own
    return fitted


def family_control(field: str, value: object, fam: Family | None):
    """The update putting `value` into the control of `field`, drawn as the loaded family's: the sampler
    list and the guidance's name and range are its own (a send never leaves another family's there)."""
    if fam is None or field not in ("sampler", "cfg"):
        return gr.update(value=value)
    if field == "sampler":
        return gr.Dropdown(choices=list(fam.sampling.samplers), value=value)
    low, high = fam.sampling.guidance_range
    return gr.Number(value=value, label=fam.sampling.guidance_label, info=f"{low:g}…{high:g}")


def find_checkpoint(ctx: UiContext, model_hash: str, model_name: str) -> tuple[str | None, str]:
    """(checkpoint name, note): by hash first — the loaded model without hashing anything — then by name."""
    snap = ctx.engine.snapshot()
    if model_hash and model_hash == snap.model_hash:
        return snap.model, ""
    infos = checkpoint_files.discover_checkpoints(ctx.settings.checkpoints_dir)
    stem = Path(model_name).stem if model_name else ""
    by_name = [i for i in infos if model_name and (i.name == model_name or Path(i.name).stem == stem)]
    if model_hash:
        for info in [*by_name, *(i for i in infos if i not in by_name)]:
            if ctx.hashes.short(checkpoint_files.weights_file(info), len(model_hash)) == model_hash:
                return info.name, ""
    if by_name:
        differs = f"; its hash differs from {model_hash}" if model_hash else ""
        return by_name[0].name, f"checkpoint {by_name[0].name} found by name{differs}"
    wanted = " ".join(filter(None, (model_name, f"(hash {model_hash})" if model_hash else "")))
    return None, f"checkpoint {wanted or '(not recorded)'} is not among yours; kept {snap.model or 'none'}"


def _refiner_field(ctx: UiContext, settings: dict[str, str], notes: list[str]) -> str:
    """The refiner choice an infotext's `Refiner: name [hash]` names, found as the checkpoint is; none
    when it names none (so the sent settings make the same image)."""
    named = _REFINER.fullmatch(settings.get("Refiner", "").strip())
    if not named or not named["name"]:
        return NO_REFINER
    found, note = find_checkpoint(ctx, named["hash"] or "", named["name"])
    notes.append(note and f"refiner: {note}")
    return found or NO_REFINER


def plan_send(ctx: UiContext, info: Infotext) -> SendPlan:
    notes: list[str] = []
    fields = {"prompt": info.prompt, "negative": info.negative_prompt, **fields_from_infotext(info.settings, notes),
              "refiner_checkpoint": _refiner_field(ctx, info.settings, notes),
              **controlnet_fields(info.settings, notes, ctx.settings), **detailer_fields(info.settings, notes)}
    checkpoint, note = find_checkpoint(ctx, info.settings.get("Model hash", ""), info.settings.get("Model", ""))
    notes.append(note)
    known = set(ctx.engine.library.names())
    loras = tuple(spec for spec in info.loras if spec.name in known)[:MAX_LORAS]
    folder = ctx.settings.lora_dir.relative_to(ctx.settings.data_dir).as_posix()  # as every message names it
    notes += [f"LoRA {spec.name} is not in {folder}" for spec in info.loras if spec.name not in known]
    if len(loras) < len([s for s in info.loras if s.name in known]):
        notes.append(f"only the first {MAX_LORAS} LoRAs were selected")
    keep = None if checkpoint == ctx.engine.snapshot().model else checkpoint
    return SendPlan(fields, keep, loras, tuple(n for n in notes if n))


@dataclass(frozen=True)
class SendTarget:
    """A tab a send fills: its components by plan field (a field the plan lacks is left as it is, one
    the tab lacks is not sent), its note, the (tabs, id) pairs to select, outer first, so the user
    lands on the filled panel, and, for img2img, the image component that takes the picture and the
    state saying which model its family fields were filled for (fields the send leaves out take the
    loaded model's, as when the tab opens: `family_fill`)."""

    tab_id: str  # also the buttons' element-id suffix
    label: str
    fields: dict[str, gr.components.Component]
    note: gr.Markdown
    tabs: tuple[tuple[gr.Tabs, str], ...]
    image: gr.Image | None = None
    shown: gr.State | None = None


@dataclass(frozen=True)
class Senders:
    """What the send buttons write to: the targets, and the Generate tab, whose checkpoint, status line
    and LoRA panel show the engine state any send changes."""

    generate: GenerateTab
    targets: tuple[SendTarget, ...]


def senders(generate: GenerateTab, img2img: Img2ImgTab, tabs: gr.Tabs) -> Senders:
    """Generate and img2img as send targets; `tabs` are the app's top-level tabs."""
    return Senders(generate, (
        SendTarget("generate", "Generate", {**dict(zip(_FIELDS, generate.settings, strict=False)),
                                            "clip_skip": generate.clip_skip, **generate.variation,
                                            **generate.refiner, "step_cache": generate.step_cache,
                                            "hires_sampler": generate.hires.sampler, **generate.controlnet.fields(),
                                            **generate.detailer.send_fields},
                   generate.note, ((tabs, "generate"),)),
        SendTarget("img2img", "img2img", {**dict(zip(_FIELDS, img2img.settings, strict=False)),
                                          "denoising_strength": img2img.strength, **img2img.controlnet.fields(),
                                          **img2img.detailer.send_fields},
                   img2img.note,
                   ((tabs, "img2img"), (img2img.panels, "i2i-img2img")), img2img.image, img2img.shown)))


def readable_picture(path: str | None) -> str | None:
    """`path` once it has passed the input checks (`app.image_inputs`: PNG, JPEG or WebP within the
    pixel cap, from its header) and decoded whole, so a deleted, broken or oversized file fails here,
    in the sender's one toast. The path itself goes on (Gradio copies the file): a re-encoded copy
    could differ."""
    if path:
        with open_checked(Path(path).read_bytes(), Path(path).name) as picture:
            picture.load()
    return path or None


def _note(plan: SendPlan | None, picture: str | None, fitted: list[str]) -> str:
    lines = ["ℹ️ Init image sent."] if picture else []
    if plan is None:
        return "\n\n".join([*lines, NO_INFOTEXT])
    return "\n\n".join([*lines, "ℹ️ Settings sent from an infotext.", *(f"⚠ {n}" for n in (*plan.notes, *fitted))])


def loaded_fill(target: SendTarget, before, snap, shown):
    """(the family fields to fill by name, the img2img tab's new `shown`): img2img's as when it opens
    (`family_fill`); the Generate tab's, where the send loaded a model, as a pick in its dropdown fills them
    (`family_updates`, `native_size_updates`)."""
    if target.shown is not None:
        return family_fill(snap, shown)
    if snap.family is None or snap.model == before.model:
        return {}, None
    sampler, hires, steps, cfg = family_updates(before, snap)
    width, height = native_size_updates(before.native_size, snap.native_size)
    return dict(sampler=sampler, hires_sampler=hires, steps=steps, cfg=cfg, width=width, height=height), None


def add_send_buttons(ctx: UiContext, sends: Senders, text: gr.Textbox, picture: gr.components.Component,
                     progress_on: gr.components.Component, elem_prefix: str) -> None:
    """One "Send to …" button per target, laid out where this is called, each wired by `wire_send`."""
    for target in sends.targets:
        button = gr.Button(f"Send to {target.label}", variant="primary", elem_id=f"{elem_prefix}-{target.tab_id}")
        wire_send(ctx, button, text, picture, target, sends.generate, progress_on)


def wire_send(ctx: UiContext, button: gr.Button, text: gr.Textbox, picture: gr.components.Component,
              target: SendTarget, tab: GenerateTab, progress_on: gr.components.Component) -> None:
    """Clicking `button` sends the infotext in `text` (and, to img2img, the picture whose path `picture`
    holds) to `target` and switches to it. Progress (a model load) and a failure's mark show on
    `progress_on`, beside the button, not on the fields."""
    slots, engine = tab.loras, ctx.engine

    def send(infotext, path, progress=PROGRESS, shown=None):  # Gradio puts `progress` at its index, then `shown`
        with user_errors(f"Sending to {target.label}", ctx.settings.data_dir):
            path = readable_picture(path) if target.image is not None else None
            text = (infotext or "").strip()
            plan = plan_send(ctx, parse_infotext(text)) if text else None
            status, before = gr.update(), engine.snapshot()
            if plan is not None and plan.checkpoint is not None:
                status = loaded_text(run_with_progress(engine, lambda: engine.load_model(plan.checkpoint), progress))
        snap, fitted = engine.snapshot(), []
        fam = family(snap.family) if snap.family is not None else None
        known = {} if plan is None else plan.fields if fam is None else fit_to_family(plan.fields, fam, fitted)
        fill, shown = loaded_fill(target, before, snap, shown)
        fields = [family_control(f, known[f], fam) if f in known else fill.get(f, gr.update()) for f in target.fields]
        image = [gr.update(value=path) if path else gr.update()] if target.image is not None else []
        loras = (selection_updates(ctx, list(plan.loras)) if plan is not None
                 else [gr.update()] * (1 + len(slots.layout)))
        return [*fields, *image, *([shown] if target.shown is not None else []), _note(plan, path, fitted),
                gr.Dropdown(value=engine.snapshot().model), status, *loras,
                *(gr.Tabs(selected=tab_id) for _tabs, tab_id in target.tabs)]

    state = [target.shown] if target.shown is not None else []
    outputs = [*target.fields.values(), *([target.image] if target.image is not None else []), *state, target.note,
               tab.model, tab.model_status, slots.select, *slots.layout, *(tabs for tabs, _id in target.tabs)]
    button.click(send, [text, picture, *state], outputs, api_visibility="private", concurrency_id=LORA_QUEUE,
                 show_progress_on=[progress_on]).success(
        **sync_panel(ctx, slots))
