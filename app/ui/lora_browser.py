"""The LoRA browser: thumbnails named the A1111 way, search, sort, base-model badges, trigger words.

A thumbnail is the first of `name.png`, `name.preview.png`, then the same for jpg, jpeg, webp
and gif, beside `name.safetensors` — where A1111 and Forge look, so an existing folder shows its
pictures. They are opened here and handed to Gradio as images, which Gradio copies into its own
cache to serve: the LoRA folder is never added to `allowed_paths` (that would serve the LoRA
files too), and only names the library lists are looked up, so no request can name a path.

Clicking a thumbnail selects that LoRA in the LoRA panel (as picking it in the selector does)
and lists its trigger words; clicking a word adds it to the prompt. Badges and words come from
the file's own metadata (`ss_base_model_version`, `modelspec.architecture`, `ss_tag_frequency`…).
"fits this model" keeps the LoRAs the engine's `inspect_lora` accepts for the loaded model (the
answer cached per model hash and file); while the engine is busy only answers already known are
used, so the filter never waits behind a long generation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from PIL import Image, ImageDraw, ImageFont, ImageOps, UnidentifiedImageError

from app.ui.common import MAX_LORAS, UiContext
from app.ui.lora_cards import base_badge, card_markdown
from app.ui.lora_panel import LORA_QUEUE, LoraSlots, slot_updates, slot_weights, sync_panel

PREVIEW_SUFFIXES = ("png", "jpg", "jpeg", "webp", "gif")
THUMB_PX = 192
SORTS = ("name", "newest first", "base model")


@dataclass(frozen=True)
class Entry:
    """One LoRA as the browser lists it."""

    name: str
    badge: str
    triggers: tuple[str, ...]
    modified: float
    preview: Path | None
    problem: str = ""


def preview_path(lora_file: Path) -> Path | None:
    """The picture A1111 would show for `lora_file`, if there is one."""
    stem = lora_file.name.removesuffix(lora_file.suffix)
    for suffix in PREVIEW_SUFFIXES:
        for candidate in (f"{stem}.{suffix}", f"{stem}.preview.{suffix}"):
            if (lora_file.parent / candidate).is_file():
                return lora_file.parent / candidate
    return None


def list_entries(ctx: UiContext) -> list[Entry]:
    """Every LoRA of the library with its badge, trigger words and preview (headers only, no hashing)."""
    out = []
    for name in ctx.engine.library.names():
        try:
            path = ctx.engine.library.path_for(name)
            card = ctx.cards.card(name, path, hashed=False)
        except Exception as exc:  # unreadable or vanished: listed with the reason, not hidden
            out.append(Entry(name, base_badge(None), (), 0.0, None, str(exc)))
            continue
        out.append(Entry(name, base_badge(card.base_model), card.trigger_words, card.modified, preview_path(path)))
    return out


def filtered(entries: list[Entry], query: str, sort: str) -> list[Entry]:
    """Entries whose name, badge or a trigger word contains `query` (any case), in the chosen order."""
    needle = (query or "").strip().lower()
    hits = [e for e in entries if not needle or needle in " ".join((e.name, e.badge, *e.triggers)).lower()]
    if sort == "newest first":
        return sorted(hits, key=lambda e: -e.modified)
    if sort == "base model":
        return sorted(hits, key=lambda e: (e.badge, e.name.lower()))
    return sorted(hits, key=lambda e: e.name.lower())


def fitting(ctx: UiContext, entries: list[Entry]) -> tuple[list[Entry], str]:
    """The entries the engine accepts for the loaded model, and a note on what could not be decided."""
    snap = ctx.engine.snapshot()
    if snap.model is None:
        return entries, "No model is loaded: every LoRA is listed."
    kept, unknown = [], 0
    for entry in entries:
        if entry.problem:
            continue
        try:
            path = ctx.engine.library.path_for(entry.name)
            fit = ctx.cards.fit(ctx.engine, entry.name, path, snap.model_key, ask=snap.state == "READY")
        except OSError:  # gone since the listing
            continue
        unknown += fit is None
        if fit is None or fit.level != "error":
            kept.append(entry)
    note = f"{len(kept) - unknown} LoRA(s) fit {snap.model}"
    return kept, note + (f"; {unknown} not checked yet (the engine is busy), listed anyway" if unknown else "")


class Thumbnails:
    """Square thumbnails with the base-model badge drawn on, cached by the preview file's identity."""

    def __init__(self) -> None:
        self._cache: dict[tuple, Image.Image] = {}
        self._lock = threading.Lock()
        self._font = ImageFont.load_default(size=15)

    def get(self, entry: Entry) -> Image.Image:
        stat = entry.preview.stat() if entry.preview else None
        key = (entry.name, entry.badge, str(entry.preview), stat.st_mtime_ns if stat else 0)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        image = self._draw(entry)
        with self._lock:
            self._cache[key] = image
        return image

    def _draw(self, entry: Entry) -> Image.Image:
        image = None
        if entry.preview is not None:
            try:
                with Image.open(entry.preview) as source:
                    image = ImageOps.fit(source.convert("RGB"), (THUMB_PX, THUMB_PX))
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError):
                image = None  # a broken picture: the placeholder below, with the name
        if image is None:
            image = Image.new("RGB", (THUMB_PX, THUMB_PX), "#d0d7de")
            ImageDraw.Draw(image).multiline_text((12, THUMB_PX // 2 - 20), _wrap(entry.name), fill="#424a53",
                                                 font=self._font)
        draw = ImageDraw.Draw(image)
        left, top, right, bottom = draw.textbbox((0, 0), entry.badge, font=self._font)
        draw.rounded_rectangle((6, 6, 18 + right - left, 16 + bottom - top), radius=5, fill="#1f2328")
        draw.text((12 - left, 11 - top), entry.badge, fill="#ffffff", font=self._font)
        return image


def _wrap(text: str, width: int = 18) -> str:
    return "\n".join(text[i:i + width] for i in range(0, min(len(text), width * 3), width))


@dataclass
class _Browser:
    search: gr.Textbox
    sort: gr.Dropdown
    only_fitting: gr.Checkbox
    note: gr.Markdown
    gallery: gr.Gallery
    details: gr.Markdown
    triggers: gr.Dataset
    shown: gr.State


def _layout() -> tuple[gr.Accordion, _Browser]:
    with gr.Accordion("LoRA browser — thumbnails, search, trigger words", open=False,
                      elem_id="sd-lora-browser-panel") as panel:
        with gr.Row(equal_height=True):
            search = gr.Textbox(placeholder="search names, base models, trigger words", show_label=False, scale=3,
                                elem_id="sd-lora-search")
            sort = gr.Dropdown(list(SORTS), value=SORTS[0], show_label=False, scale=1, elem_id="sd-lora-sort")
            only_fitting = gr.Checkbox(False, label="fits this model", scale=1, elem_id="sd-lora-fits")
        note = gr.Markdown(elem_id="sd-lora-browser-note")
        gallery = gr.Gallery(show_label=False, columns=5, height="fit-content", allow_preview=False, object_fit="cover",
                             elem_id="sd-lora-browser", format="png")
        details = gr.Markdown("Click a thumbnail to add that LoRA to the panel above.", elem_id="sd-lora-details")
        triggers = gr.Dataset(components=[gr.Textbox(visible=False)], samples=[], type="values",
                              label="Trigger words — click one to add it to the prompt", elem_id="sd-trigger-words")
    return panel, _Browser(search, sort, only_fitting, note, gallery, details, triggers, gr.State([]))


def build_lora_browser(ctx: UiContext, prompt: gr.Textbox, slots: LoraSlots) -> None:
    """Lay out the browser under the LoRA panel and wire it; it fills when first opened."""
    panel, ui = _layout()
    thumbs = Thumbnails()

    def fill(query, sort, only_fitting):
        entries, note = filtered(list_entries(ctx), query, sort), ""
        if only_fitting:
            entries, note = fitting(ctx, entries)
        items = [(thumbs.get(e), e.name + (f" — {e.problem}" if e.problem else "")) for e in entries]
        return items, [e.name for e in entries], note

    def pick(evt: gr.SelectData, shown, current, slot_names, *values):  # Gradio injects `evt` by position
        name = shown[evt.index]
        entry = next((e for e in list_entries(ctx) if e.name == name), None)
        names = list(current or [])
        note = ""
        if name not in names and len(names) >= MAX_LORAS:
            note = f"\n\n⚠ {MAX_LORAS} LoRAs are selected already: remove one to add {name}."
        elif name not in names:
            names.append(name)
        card = _details(ctx, name) + note
        samples = [[w] for w in (entry.triggers if entry else ())]
        return [card, gr.Dataset(samples=samples), gr.Dropdown(value=names),
                *slot_updates(ctx, names, slot_weights(slot_names, values))]

    refresh = dict(fn=fill, inputs=[ui.search, ui.sort, ui.only_fitting], outputs=[ui.gallery, ui.shown, ui.note],
                   api_visibility="private", show_progress="hidden")
    panel.expand(**refresh)
    ui.search.input(trigger_mode="always_last", **refresh)
    ui.sort.input(**refresh)
    ui.only_fitting.input(**refresh)
    ui.gallery.select(pick, [ui.shown, slots.select, slots.slot_names, *slots.values],
                      [ui.details, ui.triggers, slots.select, *slots.layout], api_visibility="private",
                      concurrency_id=LORA_QUEUE).then(**sync_panel(ctx, slots))
    ui.triggers.click(_add_word, [prompt, ui.triggers], prompt, api_visibility="private")


def _details(ctx: UiContext, name: str) -> str:
    try:
        card = ctx.cards.card(name, ctx.engine.library.path_for(name), hashed=False)
        return card_markdown(card, name)
    except Exception as exc:  # the file went away or is unreadable: say so in the details
        return card_markdown(None, name, problem=str(exc))


def _add_word(prompt: str, sample: list) -> str:
    """Append a trigger word to the prompt unless it is in there already."""
    word = sample[0] if sample else ""
    if not word or word.lower() in (prompt or "").lower():
        return prompt
    return f"{prompt.rstrip().rstrip(',')}, {word}" if prompt and prompt.strip() else word
