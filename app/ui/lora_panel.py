"""The LoRA panel of the Generate tab: the selector, one card per selected LoRA, live sliders.

LoRA slots are a fixed pool of `MAX_LORAS` cards shown or hidden as the multi-select changes,
instead of components created in `gr.render`: every slider then exists from the start, a slider
event can read *all* weights at once (no per-session race between two quick moves), and the
browser test can address each slot by a stable element id. Which LoRA sits in which slot is
kept in `slot_names`; all LoRA events share one concurrency group so they run in order.
Other parts of the page (the LoRA browser, "send to Generate") select LoRAs through
`selection_updates` followed by `fit_check`, the same path as a pick in the selector.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr

from app.adapters.specs import LoraSpec
from app.ui.common import MAX_LORAS, PROGRESS, UiContext, run_with_progress
from app.ui.lora_cards import Fit, card_markdown

LORA_QUEUE = "loras"  # one ordered lane for selection changes, slider moves and generate's LoRA sync


@dataclass
class LoraSlots:
    """The fixed pool of LoRA cards and the per-session state that maps slots to LoRA names."""

    select: gr.Dropdown
    refresh: gr.Button
    status: gr.Markdown
    groups: list[gr.Group]
    cards: list[gr.Markdown]
    unet: list[gr.Slider]
    te: list[gr.Slider]
    slot_names: gr.State
    fits: gr.State

    @property
    def sliders(self) -> list[gr.Slider]:
        return [*self.unet, *self.te]

    @property
    def layout(self) -> list:
        """What `slot_updates` writes, in its order."""
        return [*self.groups, *self.cards, *self.sliders, self.slot_names]


def slot_weights(slot_names: list[str], values: tuple) -> dict[str, tuple[float, float]]:
    """{name: (unet, te)} from the slider values (the first MAX_LORAS are UNet, the rest TE)."""
    return {name: (float(values[i]), float(values[MAX_LORAS + i])) for i, name in enumerate(slot_names)}


def fitting_specs(slot_names: list[str], fits: dict, values: tuple) -> list[LoraSpec]:
    """The LoRAs to apply: every selected one except those the fit check refused."""
    weights = slot_weights(slot_names, values)
    return [LoraSpec(name, weight=weights[name][0], te_weight=weights[name][1]) for name in slot_names
            if fits.get(name, "ok") != "error"]


def _lora_status(specs: list[LoraSpec], fits: dict, counters) -> str:
    parts = []
    for spec in specs:
        c = counters.get(spec.name)
        matched = f", {c.matched_layers} layers" if c is not None else ""
        warn = f" — ⚠ **{c.unmatched_keys} keys matched nothing**" if c is not None and c.unmatched_keys else ""
        parts.append(f"`{spec.name}` UNet {spec.unet_strength:g} / TE {spec.te_strength:g}{matched}{warn}")
    refused = [name for name, level in fits.items() if level == "error"]
    text = "Applied: " + ("; ".join(parts) if parts else "none")
    if refused:
        text += "\n\n<span class='sd-bad'>✗ not applied (does not fit this model): " + ", ".join(refused) + "</span>"
    return text


def build_lora_panel(ctx: UiContext) -> LoraSlots:
    lo, hi = ctx.settings.slider_min, ctx.settings.slider_max
    with gr.Accordion("LoRAs", open=True):
        with gr.Row(equal_height=True):
            select = gr.Dropdown(ctx.engine.library.names(), multiselect=True, max_choices=MAX_LORAS, scale=6,
                                 label="LoRAs", elem_id="sd-loras",
                                 info=f"a slider move re-weights at once; range {lo:g}…{hi:g} (API: any finite)")
            refresh = gr.Button("↻", scale=0, min_width=44, elem_id="sd-lora-refresh")
        status = gr.Markdown(elem_id="sd-lora-status")
        groups, cards, unet, te = [], [], [], []
        for i in range(MAX_LORAS):
            with gr.Group(visible=False, elem_classes="sd-lora-card") as group:
                cards.append(gr.Markdown(elem_id=f"sd-lora-card-{i}"))
                unet.append(gr.Slider(lo, hi, value=1.0, step=0.05, label="UNet weight", interactive=True,
                                      elem_id=f"sd-lora-unet-{i}"))
                with gr.Accordion("Text-encoder weight", open=False):
                    te.append(gr.Slider(lo, hi, value=1.0, step=0.05, label="Text-encoder weight",
                                        interactive=True, elem_id=f"sd-lora-te-{i}"))
            groups.append(group)
    return LoraSlots(select, refresh, status, groups, cards, unet, te, gr.State([]), gr.State({}))


def slot_updates(ctx: UiContext, names: list[str], weights: dict[str, tuple[float, float]]) -> list:
    """Show one card per selected name (in order), hide the rest; keep each LoRA's weights.

    Cards show "checking fit…" until the follow-up fit check (which needs the engine) fills the badges.
    """
    names = list(names or [])[:MAX_LORAS]
    groups, cards, unet, te = [], [], [], []
    for i in range(MAX_LORAS):
        if i >= len(names):
            groups.append(gr.Group(visible=False))
            cards.append(gr.Markdown())
            unet.append(gr.Slider())
            te.append(gr.Slider())
            continue
        name = names[i]
        groups.append(gr.Group(visible=True))
        cards.append(gr.Markdown(_card_text(ctx, name, None)))
        u, t = weights.get(name, (1.0, 1.0))
        unet.append(gr.Slider(value=u, label=f"{name} — UNet weight"))
        te.append(gr.Slider(value=t, label=f"{name} — text-encoder weight"))
    return [*groups, *cards, *unet, *te, names]


def selection_updates(ctx: UiContext, specs: list[LoraSpec]) -> list:
    """The selector plus the card layout for exactly `specs` (outputs: `[slots.select, *slots.layout]`)."""
    names = [spec.name for spec in specs][:MAX_LORAS]
    weights = {spec.name: (spec.unet_strength, spec.te_strength) for spec in specs}
    return [gr.Dropdown(choices=ctx.engine.library.names(), value=names), *slot_updates(ctx, names, weights)]


def _card_text(ctx: UiContext, name: str, fit: Fit | None) -> str:
    try:
        card = ctx.cards.card(name, ctx.engine.library.path_for(name))
    except Exception as exc:  # unreadable or vanished file: the card says so instead of disappearing
        return card_markdown(None, None, name, problem=str(exc))
    return card_markdown(card, fit, name)


def _check_and_apply(ctx: UiContext, slot_names: list[str], values: tuple, progress) -> list:
    """Fit-check every selected LoRA (engine worker), redraw the cards with badges, apply the fitting ones."""
    model_hash = ctx.engine.snapshot().model_hash
    fit_objs = {}
    for name in slot_names:
        try:
            fit_objs[name] = ctx.cards.fit(ctx.engine, name, ctx.engine.library.path_for(name), model_hash)
        except Exception as exc:  # name vanished from disk between selection and check
            fit_objs[name] = Fit("error", str(exc))
    fits = {name: fit.level for name, fit in fit_objs.items()}
    cards = [gr.Markdown(_card_text(ctx, name, fit_objs[name])) for name in slot_names]
    cards += [gr.Markdown() for _ in range(MAX_LORAS - len(cards))]
    return [*cards, fits, _apply(ctx, slot_names, fits, values, progress)]


def _apply(ctx: UiContext, slot_names: list[str], fits: dict, values: tuple, progress) -> str:
    """Apply the fitting LoRAs; a refusal is shown in the panel only (one place, not also a toast)."""
    specs = fitting_specs(slot_names, fits, values)
    snap = ctx.engine.snapshot()
    try:
        if tuple(specs) != snap.loras:  # e.g. a page reload showing what is applied: nothing to do
            snap = run_with_progress(ctx.engine, lambda: ctx.engine.set_loras(specs), progress)
    except Exception as exc:  # the engine kept the previous stack
        return f"<span class='sd-bad'>✗ LoRAs not applied: {html.escape(str(exc))}</span>"
    return _lora_status(specs, fits, snap.lora_counters)


def fit_check(ctx: UiContext, slots: LoraSlots) -> dict:
    """Event arguments for "check fit, redraw cards, apply": after any selection change and on page load."""

    def check(progress=PROGRESS, slot_names=(), *values):
        return _check_and_apply(ctx, list(slot_names), values, progress)

    return dict(fn=check, inputs=[slots.slot_names, *slots.sliders], outputs=[*slots.cards, slots.fits, slots.status],
                api_visibility="private", concurrency_id=LORA_QUEUE)


def wire_loras(ctx: UiContext, slots: LoraSlots) -> None:
    private = dict(api_visibility="private", concurrency_id=LORA_QUEUE)

    def on_select(names, slot_names, *values):
        return slot_updates(ctx, names, slot_weights(slot_names, values))

    def on_release(progress=PROGRESS, slot_names=(), fits=None, *values):
        return _apply(ctx, list(slot_names), fits or {}, values, progress)

    slots.select.input(on_select, [slots.select, slots.slot_names, *slots.sliders], slots.layout,
                       **private).then(**fit_check(ctx, slots))
    for slider in slots.sliders:
        slider.release(on_release, [slots.slot_names, slots.fits, *slots.sliders], slots.status, **private)
    slots.refresh.click(lambda: gr.Dropdown(choices=ctx.engine.library.names()), None, slots.select,
                        api_visibility="private")
