"""The Generate tab: model/dtype/offload, LoRA cards with live sliders, prompt controls, gallery.

LoRA slots are a fixed pool of `MAX_LORAS` cards shown or hidden as the multi-select changes,
instead of components created in `gr.render`: every slider then exists from the start, a slider
event can read *all* weights at once (no per-session race between two quick moves), and the
browser test can address each slot by a stable element id. Which LoRA sits in which slot is
kept in `slot_names`; all LoRA events share one concurrency group so they run in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app.adapters.specs import LoraSpec
from app.engine.generate import SCHEDULERS, GenerateParams
from app.settings import DTYPE_CHOICES, OFFLOAD_CHOICES
from app.ui.common import (
    MAX_LORAS,
    PROGRESS,
    UiContext,
    checked_checkpoint,
    checkpoint_names,
    gallery_items,
    generate_params,
    run_with_progress,
    user_errors,
)
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


@dataclass
class GenerateTab:
    """Components the page-load sync writes to."""

    model: gr.Dropdown
    dtype: gr.Radio
    offload: gr.Radio
    model_status: gr.Markdown
    loras: LoraSlots
    width: gr.Slider
    height: gr.Slider


# ----------------------------------------------------------------------------------- pure helpers
def native_size_updates(previous: int | None, current: int | None) -> list:
    """Width and height jump to a newly loaded model's native size when it differs from the last
    model's (SDXL draws badly at SD1.5's 512², SD1.5 slowly and oddly at 1024²); otherwise the
    user's choice stays."""
    if current is None or current == previous:
        return [gr.update(), gr.update()]
    return [gr.update(value=current), gr.update(value=current)]


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


# ----------------------------------------------------------------------------------------- layout
def _model_row(ctx: UiContext) -> tuple[gr.Dropdown, gr.Button, gr.Radio, gr.Radio, gr.Markdown]:
    with gr.Row(equal_height=True):
        model = gr.Dropdown(checkpoint_names(ctx.settings), label="Checkpoint", scale=4, elem_id="sd-model",
                            info="files and diffusers folders under models/Stable-diffusion")
        refresh = gr.Button("↻", scale=0, min_width=44, elem_id="sd-model-refresh")
        dtype = gr.Radio(list(DTYPE_CHOICES), value=ctx.settings.dtype, label="dtype", scale=2)
        offload = gr.Radio(list(OFFLOAD_CHOICES), value=ctx.settings.offload, label="Offload", scale=3)
    status = gr.Markdown(elem_id="sd-model-status")
    return model, refresh, dtype, offload, status


def _lora_panel(ctx: UiContext) -> LoraSlots:
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


def _prompt_controls() -> list[gr.components.Component]:
    defaults = GenerateParams("")
    prompt = gr.Textbox(label="Prompt", lines=3, elem_id="sd-prompt",
                        placeholder="a watercolour fox <lora:name:0.8>  (tags apply LoRAs for this prompt)")
    negative = gr.Textbox(label="Negative prompt", lines=2, elem_id="sd-negative")
    with gr.Row():
        sampler = gr.Dropdown(list(SCHEDULERS), value=defaults.sampler, label="Sampler")
        steps = gr.Slider(1, 150, value=defaults.steps, step=1, label="Steps", elem_id="sd-steps")
        cfg = gr.Slider(1.0, 30.0, value=defaults.cfg, step=0.5, label="CFG scale")
    with gr.Row():
        width = gr.Slider(64, 2048, value=defaults.width, step=8, label="Width", elem_id="sd-width")
        height = gr.Slider(64, 2048, value=defaults.height, step=8, label="Height", elem_id="sd-height")
        batch = gr.Slider(1, 16, value=defaults.batch, step=1, label="Batch")
    return [prompt, negative, sampler, steps, cfg, width, height, batch]


def build_generate_tab(ctx: UiContext) -> GenerateTab:
    """Lay out the tab and wire its events; engine-mutating events share the `LORA_QUEUE` lane, in order."""
    model, refresh, dtype, offload, model_status = _model_row(ctx)
    with gr.Row():
        with gr.Column(scale=3):
            controls = _prompt_controls()
            with gr.Row(equal_height=True):
                seed = gr.Number(-1, label="Seed (-1 = random)", precision=0, minimum=-1, elem_id="sd-seed", scale=4)
                random_seed = gr.Button("⚄ random", scale=0, min_width=80)
                reuse_seed = gr.Button("♻ reuse", scale=0, min_width=80, elem_id="sd-reuse-seed")
            loras = _lora_panel(ctx)
        with gr.Column(scale=2):
            go = gr.Button("Generate", variant="primary", elem_id="sd-generate")
            gallery = gr.Gallery(label="Images", columns=2, height=420, elem_id="sd-gallery", format="png",
                                 object_fit="contain", buttons=["download", "download_all", "fullscreen"])
            infotext = gr.Textbox(label="Infotext of the selected image", lines=6, buttons=["copy"],
                                  elem_id="sd-infotext")
    prompt, negative, sampler, steps, cfg, width, height, batch = controls
    tab = GenerateTab(model, dtype, offload, model_status, loras, width, height)
    infos, chosen_seed = gr.State([]), gr.State(None)
    _wire_model(ctx, tab, refresh)
    _wire_loras(ctx, loras)
    go.click(lambda progress=PROGRESS, *args: _generate(ctx, progress, *args),
             [prompt, negative, sampler, steps, cfg, seed, width, height, batch, loras.slot_names, loras.fits,
              *loras.sliders], [gallery, infotext, infos, chosen_seed], api_visibility="private",
             concurrency_id=LORA_QUEUE)
    gallery.select(_select_image, [infos], [infotext, chosen_seed], api_visibility="private")
    random_seed.click(lambda: -1, None, seed, api_visibility="private")
    reuse_seed.click(lambda s, current: current if s is None else s, [chosen_seed, seed], seed,
                     api_visibility="private")
    return tab


# --------------------------------------------------------------------------------------- handlers
def _wire_model(ctx: UiContext, tab: GenerateTab, refresh: gr.Button) -> None:
    engine = ctx.engine

    def ui_load_model(name, progress=PROGRESS):
        with user_errors("Loading the model"):
            name = checked_checkpoint(ctx.settings, name)
            previous = engine.snapshot().native_size
            snap = run_with_progress(engine, lambda: engine.load_model(name), progress)
        return [f"Loaded **{snap.model}** ({snap.arch}, {snap.dtype} on {snap.device}; native size "
                f"{snap.native_size}²)", *native_size_updates(previous, snap.native_size)]

    def ui_set_dtype(dtype, progress=PROGRESS):
        with user_errors("Changing the dtype"):
            snap = run_with_progress(engine, lambda: engine.set_dtype(dtype), progress)
        return f"dtype now **{snap.dtype}** (asked {snap.requested_dtype})"

    def ui_set_offload(mode, progress=PROGRESS):
        with user_errors("Changing the offload mode"):
            snap = run_with_progress(engine, lambda: engine.set_offload(mode), progress)
        return f"offload now **{snap.offload}**"

    private = dict(api_visibility="private", concurrency_id=LORA_QUEUE)
    tab.model.input(ui_load_model, tab.model, [tab.model_status, tab.width, tab.height], **private)
    tab.dtype.input(ui_set_dtype, tab.dtype, tab.model_status, **private)
    tab.offload.input(ui_set_offload, tab.offload, tab.model_status, **private)
    refresh.click(lambda: gr.Dropdown(choices=checkpoint_names(ctx.settings)), None, tab.model,
                  api_visibility="private")


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
    specs = fitting_specs(slot_names, fits, values)
    snap = ctx.engine.snapshot()
    try:
        if tuple(specs) != snap.loras:  # e.g. a page reload showing what is applied: nothing to do
            snap = run_with_progress(ctx.engine, lambda: ctx.engine.set_loras(specs), progress)
    except Exception as exc:  # shown loudly in the panel and as a toast; the engine kept the previous stack
        gr.Warning(f"LoRAs not applied: {exc}")
        return f"<span class='sd-bad'>✗ LoRAs not applied: {exc}</span>"
    return _lora_status(specs, fits, snap.lora_counters)


def _fit_check(ctx: UiContext, slots: LoraSlots) -> dict:
    """Event arguments for "check fit, redraw cards, apply": after a selection change and on page load."""

    def check(progress=PROGRESS, slot_names=(), *values):
        return _check_and_apply(ctx, list(slot_names), values, progress)

    return dict(fn=check, inputs=[slots.slot_names, *slots.sliders], outputs=[*slots.cards, slots.fits, slots.status],
                api_visibility="private", concurrency_id=LORA_QUEUE)


def wire_page_load(ctx: UiContext, tab: GenerateTab, demo: gr.Blocks) -> None:
    """On (re)load show what the engine really holds: another tab or an API client may have changed it."""
    slots = tab.loras

    def on_load():
        snap = ctx.engine.snapshot()
        names = [s.name for s in snap.loras]
        weights = {s.name: (s.unet_strength, s.te_strength) for s in snap.loras}
        return [gr.Dropdown(choices=checkpoint_names(ctx.settings), value=snap.model), snap.requested_dtype,
                snap.offload, *native_size_updates(None, snap.native_size),
                gr.Dropdown(choices=ctx.engine.library.names(), value=names), *slot_updates(ctx, names, weights)]

    demo.load(on_load, None, [tab.model, tab.dtype, tab.offload, tab.width, tab.height, slots.select, *slots.groups,
                              *slots.cards, *slots.sliders, slots.slot_names],
              api_visibility="private").then(**_fit_check(ctx, slots))


def _wire_loras(ctx: UiContext, slots: LoraSlots) -> None:
    layout_outputs = [*slots.groups, *slots.cards, *slots.sliders, slots.slot_names]
    private = dict(api_visibility="private", concurrency_id=LORA_QUEUE)

    def on_select(names, slot_names, *values):
        return slot_updates(ctx, names, slot_weights(slot_names, values))

    def on_release(progress=PROGRESS, slot_names=(), fits=None, *values):
        return _apply(ctx, list(slot_names), fits or {}, values, progress)

    slots.select.input(on_select, [slots.select, slots.slot_names, *slots.sliders], layout_outputs,
                       **private).then(**_fit_check(ctx, slots))
    for slider in slots.sliders:
        slider.release(on_release, [slots.slot_names, slots.fits, *slots.sliders], slots.status, **private)
    slots.refresh.click(lambda: gr.Dropdown(choices=ctx.engine.library.names()), None, slots.select,
                        api_visibility="private")


def _generate(ctx: UiContext, progress, prompt, negative, sampler, steps, cfg, seed, width, height, batch,
              slot_names, fits, *values):
    """Sync the engine's LoRAs with the sliders if they differ, then generate with a live progress bar."""
    engine = ctx.engine
    with user_errors("Generation"):
        params = generate_params(prompt, negative, sampler, steps, cfg, seed, width, height, batch)
        specs = tuple(fitting_specs(slot_names, fits, values))
        if specs != engine.snapshot().loras:
            run_with_progress(engine, lambda: engine.set_loras(specs), progress)
        images = run_with_progress(engine, lambda: engine.generate(params), progress)
    infos = [{"seed": im.seed, "infotext": im.infotext} for im in images]
    return gallery_items(images), infos[0]["infotext"], infos, infos[0]["seed"]


def _select_image(infos, evt: gr.SelectData):
    if not infos or evt.index is None or evt.index >= len(infos):
        return gr.Textbox(), None
    return infos[evt.index]["infotext"], infos[evt.index]["seed"]
