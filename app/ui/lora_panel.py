"""The LoRA panel of the Generate tab: the selector, one card per selected LoRA, live sliders.

LoRA slots are a fixed pool of `MAX_LORAS` cards shown or hidden as the multi-select changes,
instead of components created in `gr.render`: every slider then exists from the start, a slider
event can read *all* weights at once (no per-session race between two quick moves), and the
browser test can address each slot by a stable element id. Which LoRA sits in which slot is
kept in `slot_names`; all LoRA events share one concurrency group so they run in order.

The panel keeps no policy of its own: every selected LoRA goes to the engine
(`set_loras(..., set_aside_unfit=True)`), which applies what fits the loaded model and sets the
rest aside with its reason; the cards then draw the engine's `lora_states` and counters. Other
parts of the page (the LoRA browser, "send to Generate", a model load) select LoRAs through
`selection_updates` followed by `sync_panel`, the same path as a pick in the selector.

Each card also takes the UNet's strength by step (`1@0,0@0.3`, the prompt tags' loractl syntax): a schedule
there stands for the UNet slider, and a malformed one is refused in the status line, the engine's list unchanged.

Each card has the LoRA's "apply in part" box: the engine refuses a LoRA of which less than half the
tensors match the loaded model unless an admin allows it, once, for that LoRA (remembered by the
engine in the data folder for every user, `Engine.set_lora_partial`).
"""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass

import gradio as gr

from app.accounts import AdminRequired, require_admin
from app.adapters.specs import LoraSpec
from app.adapters.strength_schedule import parse_schedule
from app.engine.snapshot import Snapshot
from app.ui.common import MAX_LORAS, PROGRESS, EngineCallError, UiContext, run_with_progress
from app.ui.lora_cards import card_markdown, state_badge

log = logging.getLogger(__name__)
LORA_QUEUE = "loras"  # one ordered lane for selection changes, slider moves and generate's LoRA sync
SCHEDULE_HINT = "e.g. 1@0,0@0.3: strength@step, linear between (steps ≤ 1: fractions of the pass, above: step numbers)"
PARTIAL_LABEL = "Apply even when less than half of its tensors match this model (remembered for this LoRA)"


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
    schedule: list[gr.Textbox]
    partial: list[gr.Checkbox]
    slot_names: gr.State

    @property
    def sliders(self) -> list[gr.Slider]:
        return [*self.unet, *self.te]

    @property
    def values(self) -> list:
        """Every slot's strengths: UNet sliders, text-encoder sliders, then UNet step schedules (the order
        `slot_weights` reads)."""
        return [*self.unet, *self.te, *self.schedule]

    @property
    def layout(self) -> list:
        """What `slot_updates` writes, in its order."""
        return [*self.groups, *self.cards, *self.values, *self.partial, self.slot_names]

    @property
    def view(self) -> list:
        """What `panel_view` writes: every card and the status line."""
        return [*self.cards, self.status]


def slot_weights(slot_names: list[str], values: tuple) -> dict[str, tuple[float, float, str]]:
    """{name: (unet, te, schedule)} from `LoraSlots.values` (MAX_LORAS UNet sliders, as many TE sliders, as many
    schedule boxes)."""
    return {name: (float(values[i]), float(values[MAX_LORAS + i]), (values[2 * MAX_LORAS + i] or "").strip())
            for i, name in enumerate(slot_names)}


def slot_spec(name: str, unet: float, te: float, schedule: str) -> LoraSpec:
    """One card's spec: the sliders, or the UNet's step schedule when its box holds one (the slider is then
    unused); a malformed schedule is a ValueError naming the LoRA."""
    if not schedule:
        return LoraSpec(name, weight=unet, te_weight=te)
    parsed = parse_schedule(schedule, name, f"LoRA {name!r}, UNet weight by step")
    if isinstance(parsed, float):
        return LoraSpec(name, weight=parsed, te_weight=te)
    return LoraSpec(name, weight=unet, te_weight=te, schedule=parsed)


def selected_specs(slot_names: list[str], values: tuple) -> tuple[LoraSpec, ...]:
    """Every selected LoRA with its slider weights and schedule, in the selector's order."""
    weights = slot_weights(slot_names, values)
    return tuple(slot_spec(name, *weights[name]) for name in slot_names)


def wanted_differs(specs: tuple[LoraSpec, ...], snap: Snapshot) -> bool:
    """Whether the page's selection differs from the engine's wanted list (applied or set aside)."""
    wanted = [(s.name, s.unet_strength, s.te_strength, s.schedule) for s in snap.lora_states]
    return [(s.name, s.unet_strength, s.te_strength, s.schedule) for s in specs] != wanted


def sync_selection(ctx: UiContext, specs: tuple[LoraSpec, ...], progress) -> None:
    """Hand the engine the whole selection when it differs from its wanted list; it applies what fits
    the loaded model and sets the rest aside with the reason."""
    engine = ctx.engine
    if wanted_differs(specs, engine.snapshot()):
        run_with_progress(engine, lambda: engine.set_loras(specs, set_aside_unfit=True), progress)


def build_lora_panel(ctx: UiContext) -> LoraSlots:
    lo, hi = ctx.settings.slider_min, ctx.settings.slider_max
    with gr.Accordion("LoRAs", open=True):
        with gr.Row(equal_height=True):
            select = gr.Dropdown(ctx.engine.library.names(), multiselect=True, max_choices=MAX_LORAS, scale=6,
                                 label="LoRAs", elem_id="sd-loras",
                                 info=f"a slider move re-weights at once; range {lo:g}…{hi:g} (API: any finite)")
            refresh = gr.Button("↻", scale=0, min_width=44, elem_id="sd-lora-refresh")
        status = gr.Markdown(elem_id="sd-lora-status")
        groups, cards, unet, te, schedule, partial = [], [], [], [], [], []
        for i in range(MAX_LORAS):
            with gr.Group(visible=False, elem_classes="sd-lora-card") as group:
                cards.append(gr.Markdown(elem_id=f"sd-lora-card-{i}"))
                unet.append(gr.Slider(lo, hi, value=1.0, step=0.05, label="UNet weight", interactive=True,
                                      elem_id=f"sd-lora-unet-{i}"))
                schedule.append(gr.Textbox(label="UNet weight by step (instead of the slider; Enter applies)",
                                           placeholder=SCHEDULE_HINT, max_lines=1, interactive=True,
                                           elem_id=f"sd-lora-schedule-{i}"))
                with gr.Accordion("Text-encoder weight", open=False):
                    te.append(gr.Slider(lo, hi, value=1.0, step=0.05, label="Text-encoder weight",
                                        interactive=True, elem_id=f"sd-lora-te-{i}"))
                partial.append(gr.Checkbox(False, label=PARTIAL_LABEL, interactive=True,
                                           elem_id=f"sd-lora-partial-{i}"))
            groups.append(group)
    return LoraSlots(select, refresh, status, groups, cards, unet, te, schedule, partial, gr.State([]))


def slot_updates(ctx: UiContext, names: list[str], weights: dict[str, tuple[float, float]]) -> list:
    """Show one card per selected name (in order), hide the rest; keep each LoRA's weights.

    Cards say "asking the engine…" until the follow-up `sync_panel` draws the engine's answer."""
    names = list(names or [])[:MAX_LORAS]
    groups, cards, unet, te, schedule, partial = [], [], [], [], [], []
    for i in range(MAX_LORAS):
        if i >= len(names):
            groups.append(gr.Group(visible=False))
            cards.append(gr.Markdown())
            unet.append(gr.Slider())
            te.append(gr.Slider())
            schedule.append(gr.Textbox(value=""))
            partial.append(gr.Checkbox())
            continue
        name = names[i]
        groups.append(gr.Group(visible=True))
        cards.append(gr.Markdown(_card_text(ctx, name, "<span class='sd-badge'>asking the engine…</span>")))
        u, t, steps = weights.get(name, (1.0, 1.0, ""))
        unet.append(gr.Slider(value=u, label=f"{name} — UNet weight"))
        te.append(gr.Slider(value=t, label=f"{name} — text-encoder weight"))
        schedule.append(gr.Textbox(value=steps))
        partial.append(gr.Checkbox(value=ctx.engine.lora_partial_allowed(name)))
    return [*groups, *cards, *unet, *te, *schedule, *partial, names]


def selection_updates(ctx: UiContext, specs: list[LoraSpec]) -> list:
    """The selector plus the card layout for exactly `specs` (outputs: `[slots.select, *slots.layout]`)."""
    names = [spec.name for spec in specs][:MAX_LORAS]
    weights = {spec.name: (spec.unet_strength, spec.te_strength, spec.schedule_text) for spec in specs}
    return [gr.Dropdown(choices=ctx.engine.library.names(), value=names), *slot_updates(ctx, names, weights)]


def _card_text(ctx: UiContext, name: str, badge: str) -> str:
    try:
        card = ctx.cards.card(name, ctx.engine.library.path_for(name))
    except Exception as exc:  # unreadable or vanished file: the card says so instead of disappearing
        return card_markdown(None, name, problem=str(exc))
    return card_markdown(card, name, badge)


def _badge(ctx: UiContext, name: str, snap: Snapshot) -> str:
    """The engine's state for `name`, with the engine's match report of an applied file (asked only of
    an idle engine: the report is information, not worth waiting behind a generation for)."""
    state = next((s for s in snap.lora_states if s.name == name), None)
    fit = None
    if state is not None and state.status == "applied":
        try:
            fit = ctx.cards.fit(ctx.engine, name, ctx.engine.library.path_for(name), snap.model_key,
                                ask=snap.state == "READY")
        except OSError:  # the file went away after it was applied: the badge alone still holds
            fit = None
    return state_badge(state, snap.lora_counters.get(name), fit)


_STATUS_LABELS = {"set aside": "Set aside (its card says why)", "disabled": "Disabled (its card says why)",
                  "no model loaded": "Waiting for a model"}


def panel_status(snap: Snapshot, problem: str = "") -> str:
    """One line per status as the engine reports it (each card says why), and why a change was refused."""
    by_status: dict[str, list[str]] = {}
    for s in snap.lora_states:
        by_status.setdefault(s.status, []).append(f"`{s.name}` UNet {s.unet_shown} / TE {s.te_strength:g}")
    lines = ["Applied: " + ("; ".join(by_status.pop("applied", [])) or "none")]
    lines += [f"{_STATUS_LABELS.get(status, status)}: " + "; ".join(items) for status, items in by_status.items()]
    if problem:
        lines.append(f"<span class='sd-bad'>✗ LoRAs not changed: {html.escape(problem)}</span>")
    return "\n\n".join(lines)


def panel_view(ctx: UiContext, slot_names: list[str], problem: str = "") -> list:
    """Every card and the status line from one snapshot (outputs: `slots.view`)."""
    snap = ctx.engine.snapshot()
    cards = [gr.Markdown(_card_text(ctx, name, _badge(ctx, name, snap))) for name in slot_names]
    cards += [gr.Markdown() for _ in range(MAX_LORAS - len(cards))]
    return [*cards, panel_status(snap, problem)]


def panel_unchanged() -> list:
    """`slots.view` left as it is (while a generation streams its previews)."""
    return [gr.skip()] * (MAX_LORAS + 1)


def sync_panel(ctx: UiContext, slots: LoraSlots) -> dict:
    """Event arguments for "hand the selection to the engine, then draw its answer": after a selection
    change, a slider release, a page load or anything else that selects LoRAs. A refusal (the engine
    kept its previous list) is shown in the panel only: one place, not also a toast."""

    def sync(progress=PROGRESS, slot_names=(), *values):
        problem = ""
        try:
            sync_selection(ctx, selected_specs(list(slot_names), values), progress)
        except (EngineCallError, ValueError) as exc:  # a vanished file, a full queue: the previous list stays
            log.info("LoRA change refused: %s", exc)
            problem = str(exc)
        return panel_view(ctx, list(slot_names), problem)

    return dict(fn=sync, inputs=[slots.slot_names, *slots.values], outputs=slots.view, api_visibility="private",
                concurrency_id=LORA_QUEUE, show_progress_on=[slots.status])


def allow_partial_event(ctx: UiContext, slots: LoraSlots, slot: int) -> dict:
    """Event arguments for one card's "apply in part" box: the engine remembers the choice for that
    LoRA and applies the wanted list again; then the page's selection is handed over as usual."""

    def allow_partial(allowed, request: gr.Request, progress=PROGRESS, slot_names=(), *values):
        problem = ""
        try:
            require_admin(ctx.account(request), "Allowing a LoRA in part (remembered for every user)")
            name = list(slot_names)[slot]
            run_with_progress(ctx.engine, lambda: ctx.engine.set_lora_partial(name, bool(allowed)), progress)
            sync_selection(ctx, selected_specs(list(slot_names), values), progress)
        except (EngineCallError, ValueError, IndexError, AdminRequired) as exc:  # a vanished file, a full
            # queue, a stale slot, another account than an admin
            log.info("partial application not changed: %s", exc)
            problem = str(exc)
        return panel_view(ctx, list(slot_names), problem)

    return dict(fn=allow_partial, inputs=[slots.partial[slot], slots.slot_names, *slots.values], outputs=slots.view,
                api_visibility="private", concurrency_id=LORA_QUEUE, show_progress_on=[slots.status])


def wire_loras(ctx: UiContext, slots: LoraSlots) -> None:
    private = dict(api_visibility="private", concurrency_id=LORA_QUEUE)

    def on_select(names, slot_names, *values):
        return slot_updates(ctx, names, slot_weights(slot_names, values))

    slots.select.input(on_select, [slots.select, slots.slot_names, *slots.values], slots.layout,
                       **private).then(**sync_panel(ctx, slots))
    for slider in slots.sliders:
        slider.release(**sync_panel(ctx, slots))
    for box in slots.schedule:
        box.submit(**sync_panel(ctx, slots))
        box.blur(**sync_panel(ctx, slots))
    for slot, box in enumerate(slots.partial):
        box.input(**allow_partial_event(ctx, slots, slot))
    slots.refresh.click(lambda: gr.Dropdown(choices=ctx.engine.library.names()), None, slots.select,
                        api_visibility="private")
