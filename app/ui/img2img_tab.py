"""The "img2img" tab: img2img and inpaint (mask drawn in the image editor or uploaded) and, for models
that take them (`Family.reference_images`), reference editing from reference pictures, each run by
the engine as one transition per stage (see Diagnostics → History), with the live preview,
Interrupt and Skip of the Generate tab (`generate_run.stream_job`).

The tab only draws: numbers are checked by the engine's rule sets (the same as the API's,
`app.ui.workflow_api`). Each run carries the page's own state (the Generate tab's checkpoint and LoRA
cards, with the engine-wide dtype, offload and weight storage) plus any `<lora:…>` prompt tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gradio as gr

from app.engine.generate import LIMITS, SCHEDULERS, GenerateParams
from app.engine.snapshot import Snapshot
from app.engine.stage_params import MASKED_CONTENT, RESIZE_MODES, STAGE_LIMITS
from app.families import family
from app.ui.common import UiContext, gallery_items, user_errors
from app.ui.controlnet_panel import ControlNetPanel, build_controlnet_panel, units_from_form
from app.ui.detailer_panel import DetailerPanel, build_detailer_panel, details_from_form, mask_previews, notes_of
from app.ui.generate_run import (
    Generation,
    StopControls,
    build_stop_controls,
    desired_from_panel,
    failed_gallery,
    owner_of,
    result_gallery,
    run_buttons,
    stream_job,
    wire_stop,
)
from app.ui.generate_tab import NEGATIVE_LABEL, ModelShown, family_updates, native_size_updates, wire_negative_box
from app.ui.kept_upload import keep_on_refusal
from app.ui.workflow_api import BASE_FIELDS, edit_job, editor_mask, img2img_job

QUEUE = "loras"  # the lane every engine-changing event shares, in order
RUN_IMG2IMG, RUN_INPAINT, RUN_EDIT = "Run img2img", "Run inpaint", "Run edit"


@dataclass
class _Outputs:
    """Where the tab's runs show: the gallery (live previews, then the result), the infotext, the last
    result (it comes back after a failure), Interrupt and Skip, and the note (a run's notes: an unused
    negative prompt, a missing LoRA left out, as the Generate tab's note says them)."""

    gallery: gr.Gallery
    infotext: gr.Textbox
    last: gr.State
    stops: StopControls
    note: gr.Markdown

    def run_outputs(self, go: gr.Button) -> list:
        return [self.gallery, self.infotext, self.last, go, *self.stops.buttons, self.note]


def _stream(ctx: UiContext, request: gr.Request, action: str, label: str, prepare, last: list, page: tuple,
            show_masks: bool = False):
    """Run the checked job `prepare(desired)` returns (params, call(owner), notes) as this page's, with
    the page's state (`page`: the values of the Generate tab's `state_inputs`), streaming previews into
    the gallery and the step on the run button, as Generate does; the run's notes go under the settings, the
    Detailer's are toasts and its mask previews (`show_masks`) follow the images."""
    try:
        with user_errors(action, ctx.settings.data_dir):
            params, call, notes = prepare(desired_from_panel(ctx, page))
    except gr.Error:  # refused before it ran: the last result is not this run's either
        yield [failed_gallery(last), gr.skip(), gr.skip(), *run_buttons(None, label), gr.skip()]
        raise
    job = Generation(ctx.engine, call, owner_of(request))

    def frame(gallery, snap) -> list:
        return [gallery, gr.skip(), gr.skip(), *run_buttons(snap, label, snap is not None and job.runs_in(snap)),
                gr.skip()]

    images = yield from stream_job(job, (params.width, params.height), action, frame, last)
    for note in notes_of(images):
        gr.Info(note)
    masks = mask_previews(images) if show_masks else None
    yield [result_gallery(images, params.steps, masks), images[0].infotext if images else "", gallery_items(images),
           *run_buttons(None, label), "\n\n".join(f"ℹ️ {note}" for note in notes)]


def _number(field: str, label: str, value: float, step: float, panel: str = "i2i") -> gr.Number:
    """A number field showing its rule's range (no Gradio bounds: the shared rules speak)."""
    rule = LIMITS.get(field) or STAGE_LIMITS[field]
    return gr.Number(value, label=label, step=step, info=str(rule), elem_id=f"sd-{panel}-{field}")


def _settings() -> list:
    """The request's fields, in `workflow_api.BASE_FIELDS` order."""
    defaults = GenerateParams("")
    prompt = gr.Textbox(label="Prompt", lines=2, elem_id="sd-i2i-prompt")
    negative = gr.Textbox(label=NEGATIVE_LABEL, lines=1, elem_id="sd-i2i-negative")
    with gr.Row():
        sampler = gr.Dropdown(list(SCHEDULERS), value=defaults.sampler, label="Sampler", elem_id="sd-i2i-sampler")
        steps, cfg = _number("steps", "Steps", defaults.steps, 1), _number("cfg", "CFG scale", defaults.cfg, 0.5)
        seed = _number("seed", "Seed", -1, 1)
    with gr.Row():
        width, height = _number("width", "Width", 64, 8), _number("height", "Height", 64, 8)
        batch = _number("batch", "Batch", 1, 1)
    return [prompt, negative, sampler, steps, cfg, seed, width, height, batch]


@dataclass
class Img2ImgTab:
    """The tab's components "send to img2img" writes to: the shared settings, the img2img panel's init
    image and denoising strength, a note for what the send did, and the sub-tabs (to show that panel);
    `shown`: the `ModelShown` its family fields were last filled for (`family_fill`)."""

    settings: list
    image: gr.Image
    strength: gr.Number
    note: gr.Markdown
    panels: gr.Tabs
    stops: StopControls
    shown: gr.State
    controlnet: ControlNetPanel
    detailer: DetailerPanel
    # the event arguments that show or hide the "Reference images" panel for the loaded model: run as the tab
    # opens and after a load, not only at a panel choice (with Inpaint active it stayed hidden)
    show_references: dict

    @property
    def family_components(self) -> list:
        """The settings `FAMILY_FIELDS` names, in its order."""
        named = dict(zip(BASE_FIELDS, self.settings, strict=True))
        return [named[name] for name in FAMILY_FIELDS]


FAMILY_FIELDS = ("sampler", "steps", "cfg", "width", "height")  # what the loaded model's family fills in


def family_fill(snap: Snapshot, shown: ModelShown | None) -> tuple[dict[str, object], ModelShown | None]:
    """The family fields to fill, by name, and what they are then filled for: the loaded model's
    sampler, steps, guidance (its name and range) and native size when the tab's were filled for
    another model, or never (a fresh page); as on the Generate tab, between two models of one family
    the user's choices stay (`family_updates`). Without this the tab kept SD's 20 steps, CFG 7 and a
    64² size for every model: a distilled model ran 20 steps at CFG 7, SDXL drew at 64²."""
    now = ModelShown.of(snap)
    if snap.family is None or shown == now:
        return {}, shown
    sampler, _hires, steps, cfg = family_updates(shown, snap)
    size = native_size_updates(shown.native_size if shown else None, snap.native_size)
    return dict(zip(FAMILY_FIELDS, (sampler, steps, cfg, *size), strict=True)), now


def family_fields(ctx: UiContext, shown: ModelShown | None) -> list:
    """[sampler, steps, CFG, width, height, shown] as the page loads or the tab opens (`family_fill`):
    fields already filled for the loaded model, its sampler list included, are left as they are."""
    fill, now = family_fill(ctx.engine.snapshot(), shown)
    return [*(fill.get(name, gr.update()) for name in FAMILY_FIELDS), now]


def _controlnet_units(ctx: UiContext, values: Sequence) -> tuple:
    """The ControlNet accordion's units (a unit without a picture takes the init image, as in the extension)."""
    return units_from_form(ctx.settings, values, needs_image=False)


def _img2img_panel(ctx: UiContext, base: list, out: _Outputs, page: list,
                   cn: list) -> tuple[gr.Image, gr.Number, DetailerPanel]:
    image = gr.Image(type="pil", label="Init image", elem_id="sd-i2i-image", height=300, format="png")
    with gr.Row():
        resize = gr.Radio(list(RESIZE_MODES), value=RESIZE_MODES[0], label="Resize mode", elem_id="sd-i2i-resize")
        strength = _number("denoising_strength", "Denoising strength", 0.75, 0.05)
    detailer = build_detailer_panel(ctx, "sd-i2i-ad", skip_option=True)
    go = gr.Button(RUN_IMG2IMG, variant="primary", elem_id="sd-i2i-run")
    split = 12 + len(detailer.inputs)

    def img2img(request: gr.Request, last, *values):
        init, strength_v, resize_v = values[9:12]

        def prepare(desired):
            details = details_from_form(ctx, *values[12:split])
            return img2img_job(ctx, list(values[:9]), init, strength_v, resize_v, desired=desired, details=details,
                               controlnet_units=_controlnet_units(ctx, values[split:split + len(cn)]))
        yield from _stream(ctx, request, "img2img", RUN_IMG2IMG, prepare, last, values[split + len(cn):], values[14])

    go.click(img2img, [out.last, *base, image, strength, resize, *detailer.inputs, *cn, *page], out.run_outputs(go),
             api_visibility="private", concurrency_id=QUEUE, show_progress_on=[out.gallery])
    return image, strength, detailer


def _inpaint_panel(ctx: UiContext, base: list, out: _Outputs, page: list, cn: list) -> None:
    editor = gr.ImageEditor(type="pil", label="Image and mask (paint the area to repaint)", elem_id="sd-inpaint-editor",
                            brush=gr.Brush(colors=["#ffffff"], color_mode="fixed", default_size=12),
                            height=360, layers=False, transforms=(), format="png")  # lossless: the pixels outside
    # the mask are pasted back as they arrive
    uploaded = gr.Image(type="pil", label="…or upload a mask (white repaints; overrides the painting)",
                        elem_id="sd-inpaint-mask", height=160)
    with gr.Row():
        fill = gr.Radio(list(MASKED_CONTENT), value="original", label="Masked content", elem_id="sd-inpaint-fill")
        invert = gr.Checkbox(False, label="Inpaint not masked (invert)", elem_id="sd-inpaint-invert")
    with gr.Row():
        blur = _number("mask_blur", "Mask blur", 4, 1, "inpaint")
        strength = _number("denoising_strength", "Denoising strength", 0.75, 0.05, "inpaint")
        resize = gr.Radio(list(RESIZE_MODES), value=RESIZE_MODES[0], label="Resize mode")
    go = gr.Button(RUN_INPAINT, variant="primary", elem_id="sd-inpaint-run")

    def prepare(desired, base_values, units, edited, upload, strength_v, resize_v, blur_v, fill_v, invert_v):
        image, painted = editor_mask(edited)
        mask = upload if upload is not None else painted
        if image is not None and mask is None:
            raise ValueError("paint the area to repaint, or upload a mask")
        return img2img_job(ctx, base_values, image, strength_v, resize_v, mask, blur_v, fill_v, invert_v,
                           desired=desired, controlnet_units=_controlnet_units(ctx, units))

    def inpaint(request: gr.Request, last, *values):
        units, rest = values[16:16 + len(cn)], values[16 + len(cn):]
        yield from _stream(ctx, request, "inpaint", RUN_INPAINT,
                           lambda desired: prepare(desired, list(values[:9]), units, *values[9:16]), last, rest)

    go.click(inpaint, [out.last, *base, editor, uploaded, strength, resize, blur, fill, invert, *cn, *page],
             out.run_outputs(go), api_visibility="private", concurrency_id=QUEUE, show_progress_on=[out.gallery])


def reference_panel_state(ctx: UiContext) -> tuple[bool, str]:
    """(is the reference panel shown, its gallery's label) for the model the engine's snapshot names:
    shown while its family takes reference images, the label saying how many."""
    family_name = ctx.engine.snapshot().family
    most = family(family_name).reference_images if family_name is not None else 0
    return most > 0, f"Reference images (1-{most})" if most else "Reference images"


def _reference_updates(ctx: UiContext) -> tuple[gr.Tab, gr.Gallery]:
    shown, label = reference_panel_state(ctx)
    return gr.Tab(visible=shown), gr.Gallery(label=label)


def _reference_panel(ctx: UiContext, base: list, out: _Outputs, page: list) -> gr.Gallery:
    """Reference editing: the pictures the model edits from or combines (as many as its family takes), at the
    settings' size; no denoising strength, nothing is masked. Returns the gallery (its label follows the model)."""
    pictures = gr.Gallery(type="pil", label=reference_panel_state(ctx)[1], interactive=True, columns=4, height=240,
                          elem_id="sd-i2i-references")
    go = gr.Button(RUN_EDIT, variant="primary", elem_id="sd-i2i-edit-run")

    def edit(request: gr.Request, last, *values):
        yield from _stream(ctx, request, "edit", RUN_EDIT,
                           lambda desired: edit_job(ctx, list(values[:9]), values[9], desired=desired), last,
                           values[10:])

    go.click(edit, [out.last, *base, pictures, *page], out.run_outputs(go), api_visibility="private",
             concurrency_id=QUEUE, show_progress_on=[out.gallery])
    return pictures


def build_img2img_tab(ctx: UiContext, page: list) -> Img2ImgTab:
    """Lay out the tab: shared settings on the left, one sub-tab per workflow, the results on the right
    (built first, unrendered, so every panel's button can write to them) under Interrupt and Skip.
    The hires fix is the Generate tab's checkbox, as in A1111. `page`: the Generate tab's
    `state_inputs`, the state every run carries."""
    with gr.Row():
        with gr.Column(scale=2, render=False) as results:
            stops = build_stop_controls("sd-i2i")
            out = _Outputs(gr.Gallery(label="Images", columns=2, height=420, elem_id="sd-i2i-gallery", format="png",
                                      object_fit="contain"),
                           gr.Textbox(label="Infotext", lines=6, buttons=["copy"], elem_id="sd-i2i-infotext"),
                           gr.State([]), stops, gr.Markdown(elem_id="sd-i2i-note", render=False))
        with gr.Column(scale=3):
            base = _settings()
            note = out.note.render()  # what "send to img2img" filled in, or could not; a run's notes
            controlnet = build_controlnet_panel(ctx, "sd-i2i")
            with gr.Tabs() as panels:
                with gr.Tab("img2img", id="i2i-img2img"):
                    image, strength, detailer = _img2img_panel(ctx, base, out, page, controlnet.inputs)
                with gr.Tab("Inpaint", id="i2i-inpaint"):
                    _inpaint_panel(ctx, base, out, page, controlnet.inputs)
                # shown for a model that takes reference images, checked at page load and on every panel choice
                with gr.Tab("Reference images", id="i2i-reference",
                            visible=reference_panel_state(ctx)[0]) as references:
                    pictures = _reference_panel(ctx, base, out, page)
        results.render()
    show_references = dict(fn=lambda: _reference_updates(ctx), inputs=None, outputs=[references, pictures],
                           api_visibility="private", show_progress="hidden")
    panels.select(**show_references)
    gr.on(None, **show_references)
    wire_negative_box(ctx, base[4], base[1])
    keep_on_refusal(image, note)
    wire_stop(ctx, stops)
    return Img2ImgTab(base, image, strength, note, panels, stops, gr.State(None), controlnet, detailer,
                      show_references)
