"""The Generate tab: model/dtype/offload, prompt and settings, the LoRA panel and browser, the gallery.

Settings are number fields checked by the one rule set in `app.engine.generate.LIMITS` (the API
uses the same): a value out of range is refused with its range instead of being clamped by a
slider, and a size that is not a multiple of the model's 8 is rounded down with a note beside
the fields, which then show the size that was used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import gradio as gr

from app.accounts import require_admin
from app.engine.generate import LIMITS, SCHEDULERS, GenerateParams
from app.engine.offload import idle_note
from app.engine.snapshot import Snapshot
from app.engine.stage_params import SAME
from app.families import family
from app.settings import DTYPE_CHOICES, OFFLOAD_CHOICES
from app.ui.common import (
    NO_REFINER,
    PROGRESS,
    UiContext,
    checked_checkpoint,
    checkpoint_names,
    run_with_progress,
    user_errors,
)
from app.ui.controlnet_panel import ControlNetPanel, build_controlnet_panel
from app.ui.detailer_panel import DetailerPanel, build_detailer_panel
from app.ui.generate_run import GALLERY_LABEL, StopControls, build_stop_controls, owner_of, wire_generate
from app.ui.hires_fields import HiresFields, build_hires_fields
from app.ui.lora_browser import build_lora_browser
from app.ui.lora_panel import LORA_QUEUE, LoraSlots, build_lora_panel, selection_updates, sync_panel, wire_loras
from app.ui.model_options import ModelOptions, build_model_options, engine_wide, option_updates, wire_model_options
from app.ui.styles_panel import build_styles_row, refresh_styles

NEGATIVE_LABEL = "Negative prompt"


@dataclass
class GenerateTab:
    """The tab's components other parts of the page write to (page load, "send to Generate")."""

    model: gr.Dropdown
    dtype: gr.Radio
    offload: gr.Radio
    model_status: gr.Markdown
    loras: LoraSlots
    prompt: gr.Textbox
    negative: gr.Textbox
    sampler: gr.Dropdown
    steps: gr.Number
    cfg: gr.Number
    seed: gr.Number
    width: gr.Number
    height: gr.Number
    batch: gr.Number
    n_iter: gr.Number
    clip_skip: gr.Number
    note: gr.Markdown
    options: ModelOptions
    variation: dict[str, gr.Number]  # subseed, subseed_strength, seed_resize_from_w/h (A1111's names)
    styles: gr.Dropdown
    refiner: dict[str, gr.components.Component]  # refiner_checkpoint, refiner_switch_at
    hires: HiresFields
    stops: StopControls
    step_cache: gr.Number
    controlnet: ControlNetPanel
    detailer: DetailerPanel

    @property
    def state_inputs(self) -> list:
        """The page's own state every generation on it carries (`desired_from_panel` reads them): checkpoint and
        the LoRA cards (dtype, offload and weight storage are engine-wide)."""
        return [self.model, self.loras.slot_names, *self.loras.values]

    @property
    def settings(self) -> list:
        """The fields a generation reads, in `generate_params` order."""
        return [self.prompt, self.negative, self.sampler, self.steps, self.cfg, self.seed, self.width, self.height,
                self.batch, self.n_iter, self.clip_skip, *self.variation.values(), self.styles,
                *self.refiner.values(), self.step_cache]


class ModelShown(NamedTuple):
    """What a tab's family fields were last filled for (what `family_updates` and
    `native_size_updates` compare): kept per page by a tab that fills them when it opens."""

    family: str | None
    defaults: tuple[int, float] | None
    native_size: int | None

    @classmethod
    def of(cls, snap: Snapshot) -> ModelShown:
        return cls(snap.family, snap.defaults, snap.native_size)


def family_updates(previous: Snapshot | ModelShown | None, current: Snapshot) -> list:
    """[sampler, hires sampler, steps, CFG] for the model `current` shows loaded after the one `previous`
    showed (None: a fresh page). The sampler lists are always the loaded family's own (a sampler it
    lacks would be refused at Generate); when the family changes, its defaults fill the fields: sampler
    (the hires pass's: the same), steps, and the guidance with its name and range ("Distilled CFG Scale"
    on FLUX.1-dev). Between two models of one family the user's choices stay, unless the two want other
    steps and guidance (a distilled and an undistilled checkpoint): then those two are filled in."""
    if current.family is None:
        return [gr.update()] * 4
    fam = family(current.family)
    steps, guidance = current.defaults
    samplers = [gr.Dropdown(choices=list(fam.sampling.samplers)), gr.Dropdown(choices=[SAME, *fam.sampling.samplers])]
    if previous is not None and current.family == previous.family:
        if current.defaults == previous.defaults:
            return [*samplers, gr.update(), gr.update()]
        return [*samplers, gr.Number(value=steps), gr.Number(value=guidance)]
    low, high = fam.sampling.guidance_range
    return [gr.Dropdown(choices=list(fam.sampling.samplers), value=fam.sampling.default_sampler),
            gr.Dropdown(choices=[SAME, *fam.sampling.samplers], value=SAME), gr.Number(value=steps),
            gr.Number(value=guidance, label=fam.sampling.guidance_label, info=f"{low:g}…{high:g}")]


def negative_box(family_name: str | None, guidance) -> gr.Textbox:
    """The negative prompt box as the loaded family at `guidance` reads it: its label and placeholder say
    so where nothing reads it (`Family.negative_unused`: distilled guidance, no CFG at all, CFG 1), so a newcomer does
    not write one believing it counts. It stays editable: the text comes back into use on a model or CFG
    that reads it."""
    why = family(family_name).negative_unused(float(guidance)) \
        if family_name is not None and isinstance(guidance, int | float) else ""
    if not why:
        return gr.Textbox(label=NEGATIVE_LABEL, placeholder="")
    return gr.Textbox(label=f"{NEGATIVE_LABEL} (not used: {why})",
                      placeholder=f"not used: {why}; a model or CFG that reads it uses what is written here")


def wire_negative_box(ctx: UiContext, cfg: gr.Number, negative: gr.Textbox, *after: object) -> dict:
    """Redraw `negative` (`negative_box`) when the guidance changes; returns the event arguments `after`
    (a model load, the page load, a tab's fill) runs too."""
    redraw = dict(fn=lambda value: negative_box(ctx.engine.snapshot().family, value), inputs=cfg, outputs=negative,
                  api_visibility="private", show_progress="hidden")
    cfg.change(**redraw)
    return redraw


def native_size_updates(previous: int | None, current: int | None) -> list:
    """Width and height jump to a newly loaded model's native size when it differs from the last
    model's (SDXL draws badly at SD1.5's 512², SD1.5 slowly and oddly at 1024²); otherwise the
    user's choice stays."""
    if current is None or current == previous:
        return [gr.update(), gr.update()]
    return [gr.update(value=current), gr.update(value=current)]


def without_size_note(note: str | None, field: str) -> str:
    """The settings note without its rounding line for `field` ("ℹ️ width 100 → 96: …"): once the
    user edits that field, the note about the old value is stale (the other lines stay)."""
    kept = [part for part in (note or "").split("\n\n") if not part.startswith(f"ℹ️ {field} ")]
    return "\n\n".join(kept)


# ----------------------------------------------------------------------------------------- layout
def _model_row(ctx: UiContext) -> tuple[gr.Dropdown, gr.Button, gr.Radio, gr.Radio, gr.Markdown]:
    with gr.Row(equal_height=True):
        model = gr.Dropdown(checkpoint_names(ctx.settings), label="Checkpoint", scale=4, elem_id="sd-model",
                            info="files and diffusers folders under models/Stable-diffusion")
        refresh = gr.Button("↻", scale=0, min_width=44, elem_id="sd-model-refresh")
        dtype = gr.Radio(list(DTYPE_CHOICES), value=ctx.settings.dtype, label="dtype", scale=2)
        # Without a GPU every mode keeps the model in RAM: said where the mode is chosen.
        no_gpu = any(idle_note(mode, ctx.engine.snapshot().device) for mode in OFFLOAD_CHOICES)
        offload = gr.Radio(list(OFFLOAD_CHOICES), value=ctx.settings.offload, label="Offload", scale=3,
                           info="no GPU here: no mode changes anything (offload saves GPU memory)" if no_gpu else None)
    status = gr.Markdown(elem_id="sd-model-status")
    return model, refresh, dtype, offload, status


def _number(field: str, label: str, value: float, step: float, **kwargs) -> gr.Number:
    """A number field showing its allowed range; no Gradio bounds or precision, so the shared rules speak."""
    return gr.Number(value, label=label, step=step, info=str(LIMITS[field]), elem_id=f"sd-{field}", **kwargs)


def _settings_fields() -> list:
    defaults = GenerateParams("")
    prompt = gr.Textbox(label="Prompt", lines=3, elem_id="sd-prompt",
                        placeholder="a watercolour fox <lora:name:0.8>  (tags apply LoRAs for this prompt)")
    negative = gr.Textbox(label=NEGATIVE_LABEL, lines=2, elem_id="sd-negative")
    with gr.Row():
        sampler = gr.Dropdown(list(SCHEDULERS), value=defaults.sampler, label="Sampler", elem_id="sd-sampler")
        steps = _number("steps", "Steps", defaults.steps, 1)
        cfg = _number("cfg", "CFG scale", defaults.cfg, 0.5)
    with gr.Row():
        width = _number("width", "Width", defaults.width, 8)
        height = _number("height", "Height", defaults.height, 8)
        batch = _number("batch", "Batch size", defaults.batch, 1)
        n_iter = _number("n_iter", "Batch count", defaults.n_iter, 1)
        # A1111's "Clip skip": CLIP reads its layer -N; SDXL reads its penultimate layer whatever this says.
        clip_skip = _number("clip_skip", "Clip skip", defaults.clip_skip, 1)
    note = gr.Markdown(elem_id="sd-settings-note")  # rounding, "stopped early" and "sent from an infotext" notes
    return [prompt, negative, sampler, steps, cfg, width, height, batch, n_iter, clip_skip, note]


def _variation_fields() -> dict[str, gr.Number]:
    """A1111's "Extra" seed options: a variation seed mixed in at a strength, and the size to draw the noise as."""
    with gr.Accordion("Variation seed", open=False, elem_id="sd-variation"):
        with gr.Row(equal_height=True):
            fields = {"subseed": _number("subseed", "Variation seed", -1, 1),
                      "subseed_strength": _number("subseed_strength", "Variation strength", 0, 0.05)}
        with gr.Row(equal_height=True):
            fields["seed_resize_from_w"] = _number("seed_resize_from_w", "Resize seed from width", 0, 8)
            fields["seed_resize_from_h"] = _number("seed_resize_from_h", "Resize seed from height", 0, 8)
    return fields


def _refiner_fields(ctx: UiContext) -> dict[str, gr.components.Component]:
    """A1111's refiner: a checkpoint that finishes the image after the switch point (SDXL)."""
    with gr.Accordion("Refiner", open=False, elem_id="sd-refiner"):
        with gr.Row(equal_height=True):
            checkpoint = gr.Dropdown([NO_REFINER, *checkpoint_names(ctx.settings)], value=NO_REFINER, scale=3,
                                     label="Refiner checkpoint", elem_id="sd-refiner-checkpoint",
                                     info="finishes the image after the switch point (SDXL base models)")
            switch_at = _number("refiner_switch_at", "Switch at", GenerateParams("").refiner_switch_at, 0.05)
    return {"refiner_checkpoint": checkpoint, "refiner_switch_at": switch_at}


def _step_cache_field() -> gr.Number:
    """The step cache's threshold (app/engine/step_cache.py), per generation; 0 is off."""
    with gr.Accordion("Step cache", open=False, elem_id="sd-step-cache-panel"):
        return gr.Number(GenerateParams("").step_cache, label="Step cache threshold", step=0.05,
                         info=f"{LIMITS['step_cache']}: base models reuse the last whole step while the first block "
                              "changes less than this (0.05-0.2 typical, faster, a little less exact); "
                              "step-distilled models refuse it", elem_id="sd-step_cache")


def build_generate_tab(ctx: UiContext) -> GenerateTab:
    """Lay out the tab and wire its events; engine-mutating events share the `LORA_QUEUE` lane, in order."""
    model, refresh, dtype, offload, model_status = _model_row(ctx)
    options = build_model_options(ctx)
    with gr.Row():
        with gr.Column(scale=3):
            prompt, negative, sampler, steps, cfg, width, height, batch, n_iter, clip_skip, note = _settings_fields()
            styles = build_styles_row(ctx, prompt, negative)
            with gr.Row(equal_height=True):
                seed = _number("seed", "Seed", -1, 1, scale=4)
                random_seed = gr.Button("⚄ random", scale=0, min_width=80)
                reuse_seed = gr.Button("♻ reuse", scale=0, min_width=80, elem_id="sd-reuse-seed")
            variation = _variation_fields()
            hires = build_hires_fields(ctx)
            detailer = build_detailer_panel(ctx, "sd-ad", skip_option=False)
            refiner = _refiner_fields(ctx)
            step_cache = _step_cache_field()
            controlnet = build_controlnet_panel(ctx, "sd")
            loras = build_lora_panel(ctx)
            build_lora_browser(ctx, prompt, loras)
        with gr.Column(scale=2):
            go = gr.Button("Generate", variant="primary", elem_id="sd-generate")
            stops = build_stop_controls()
            gallery = gr.Gallery(label=GALLERY_LABEL, columns=2, height=420, elem_id="sd-gallery", format="png",
                                 object_fit="contain", buttons=["download", "download_all", "fullscreen"])
            infotext = gr.Textbox(label="Infotext of the selected image", lines=6, buttons=["copy"],
                                  elem_id="sd-infotext")
    tab = GenerateTab(model, dtype, offload, model_status, loras, prompt, negative, sampler, steps, cfg, seed, width,
                      height, batch, n_iter, clip_skip, note, options, variation, styles, refiner, hires, stops,
                      step_cache, controlnet, detailer)
    infos, chosen_seed = gr.State([]), gr.State(None)
    _wire_model(ctx, tab, refresh, wire_negative_box(ctx, cfg, negative))
    wire_loras(ctx, loras)
    # Progress and a failure's "Error" mark go on the gallery only; the message itself is one toast.
    wire_generate(ctx, go, stops, (tab.settings, hires.inputs, detailer.inputs, tab.state_inputs, controlnet.inputs),
                  loras, [gallery, infotext, infos, chosen_seed, width, height, note])
    gallery.select(_select_image, [infos], [infotext, chosen_seed], api_visibility="private")
    for field, box in (("width", width), ("height", height)):
        box.input(lambda text, f=field: without_size_note(text, f), note, note, api_visibility="private",
                  show_progress="hidden")
    random_seed.click(lambda: -1, None, seed, api_visibility="private")
    reuse_seed.click(lambda s, current: current if s is None else s, [chosen_seed, seed], seed,
                     api_visibility="private")
    return tab


# --------------------------------------------------------------------------------------- handlers
def load_checkpoint(ctx: UiContext, name: str, progress, admin: bool = False) -> list:
    """Load `name` unless it is the loaded model already (re-selecting it, or opening and closing the
    dropdown, must not reload); an `admin`'s choice becomes the default checkpoint of every session that
    chose none. Returns [status text, width, height, sampler, hires sampler, steps, CFG] (see
    `native_size_updates`, `family_updates`)."""
    engine = ctx.engine
    if name == engine.snapshot().model:
        if admin:
            ctx.sessions.set_default_model(name)
        return [gr.update()] * 7
    with user_errors("Loading the model", ctx.settings.data_dir):
        name = checked_checkpoint(ctx.settings, name)
        before = engine.snapshot()
        snap = run_with_progress(engine, lambda: engine.load_model(name), progress)
    if admin:
        ctx.sessions.set_default_model(name)
    return [loaded_text(snap), *native_size_updates(before.native_size, snap.native_size),
            *family_updates(before, snap)]


def loaded_text(snap) -> str:
    return (f"Loaded **{snap.model}** ({snap.model_label}, {snap.dtype} on {snap.device}; "
            f"native size {snap.native_size}²)")


def _wire_model(ctx: UiContext, tab: GenerateTab, refresh: gr.Button, negative: dict) -> None:
    engine = ctx.engine

    def ui_set_dtype(dtype, request: gr.Request, progress=PROGRESS):
        with user_errors("Changing the dtype", ctx.settings.data_dir):
            require_admin(ctx.account(request), "Changing the dtype")
            snap = run_with_progress(engine, lambda: engine.set_dtype(dtype), progress)
        return f"dtype now **{snap.dtype}** (asked {snap.requested_dtype})"

    def ui_set_offload(mode, request: gr.Request, progress=PROGRESS):
        with user_errors("Changing the offload mode", ctx.settings.data_dir):
            require_admin(ctx.account(request), "Changing the offload mode")
            snap = run_with_progress(engine, lambda: engine.set_offload(mode), progress)
        note = idle_note(snap.offload, snap.device)
        return f"offload now **{snap.offload}**" + (f": {note}" if note else "")

    def ui_load(name, request: gr.Request, progress=PROGRESS):
        return load_checkpoint(ctx, name, progress, admin=ctx.account(request).admin)

    private = dict(api_visibility="private", concurrency_id=LORA_QUEUE)
    redraw = sync_panel(ctx, tab.loras)  # a load re-applies what fits the new model and sets the rest aside
    # `select`, not `input`: Gradio's dropdown also sends `input` when it merely loses focus, which reloaded
    # the model (or repeated a failure and its toast). After a refusal the dropdown shows the model the
    # engine still holds (`.failure`: a `.then` after an error never runs in Gradio 6.31).
    loaded = tab.model.select(ui_load, tab.model,
                              [tab.model_status, tab.width, tab.height, tab.sampler, tab.hires.sampler, tab.steps,
                               tab.cfg],
                              show_progress_on=[tab.model_status], **private)
    loaded.failure(lambda: gr.Dropdown(value=engine.snapshot().model), None, tab.model, api_visibility="private")
    loaded.success(**redraw).then(lambda: option_updates(ctx), None, tab.options.outputs,
                                  api_visibility="private").then(**negative)
    wire_model_options(ctx, tab.options, tab.model_status, **private)
    tab.dtype.input(ui_set_dtype, tab.dtype, tab.model_status, **private).success(**redraw)
    tab.offload.input(ui_set_offload, tab.offload, tab.model_status, **private).success(**redraw)
    def ui_refresh():
        names = checkpoint_names(ctx.settings)
        return gr.Dropdown(choices=names), gr.Dropdown(choices=[NO_REFINER, *names])

    refresh.click(ui_refresh, None, [tab.model, tab.refiner["refiner_checkpoint"]], api_visibility="private")


def wire_page_load(ctx: UiContext, tab: GenerateTab, demo: gr.Blocks) -> None:
    """On (re)load the page starts from the app's defaults, never from what another session left in the
    engine: the default checkpoint and no LoRA (`app/ui/sessions.py`); dtype and offload show the
    engine's (engine-wide: an admin's controls, shown as such to others); the notes say why the start-up
    model is not the first checkpoint, if it is not; the sampler, steps, CFG and size fields take the
    loaded family's defaults, so the page's first Generate works on whatever model loaded first."""
    slots = tab.loras

    def options_on_load(request: gr.Request) -> list:
        return option_updates(ctx, ctx.account(request).admin)

    def on_load(request: gr.Request):
        snap = ctx.engine.snapshot()
        admin = ctx.account(request).admin
        return [gr.Dropdown(choices=checkpoint_names(ctx.settings), value=ctx.desired_for(owner_of(request)).model),
                gr.Radio(value=snap.requested_dtype, **engine_wide(admin)), gr.Radio(value=snap.offload,
                                                                                      **engine_wide(admin)),
                "\n\n".join(ctx.startup_notes), *native_size_updates(None, snap.native_size),
                *family_updates(None, snap), *selection_updates(ctx, [])]

    demo.load(on_load, None, [tab.model, tab.dtype, tab.offload, tab.model_status, tab.width, tab.height,
                              tab.sampler, tab.hires.sampler, tab.steps, tab.cfg, slots.select, *slots.layout],
              api_visibility="private").then(**sync_panel(ctx, slots)).then(
        options_on_load, None, tab.options.outputs, api_visibility="private")
    demo.load(**refresh_styles(ctx, tab.styles))


def _select_image(infos, evt: gr.SelectData):
    if not infos or evt.index is None or evt.index >= len(infos):
        return gr.Textbox(), None
    return infos[evt.index]["infotext"], infos[evt.index]["seed"]
