"""The "img2img" tab: img2img, inpaint (mask drawn in the image editor or uploaded) and txt2img
with hires fix, each run by the engine as one transition per stage (see Diagnostics → History).

The tab only draws: numbers are checked by the engine's rule sets (the same as the API's,
`app.ui.workflow_api`). Each run carries the page's own state (the Generate tab's checkpoint,
dtype, offload, weight storage and LoRA cards) plus any `<lora:…>` prompt tags.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app.engine.generate import LIMITS, SCHEDULERS, GenerateParams
from app.engine.stage_params import MASKED_CONTENT, RESIZE_MODES, SAME, STAGE_LIMITS, UPSCALERS
from app.ui.common import PROGRESS, UiContext
from app.ui.generate_run import desired_from_panel
from app.ui.workflow_api import editor_mask, run_hires, run_img2img

QUEUE = "loras"  # the lane every engine-changing event shares, in order


@dataclass
class _Outputs:
    gallery: gr.Gallery
    infotext: gr.Textbox

    @property
    def all(self) -> list:
        return [self.gallery, self.infotext]


def _number(field: str, label: str, value: float, step: float, panel: str = "i2i") -> gr.Number:
    """A number field showing its rule's range (no Gradio bounds: the shared rules speak)."""
    rule = LIMITS.get(field) or STAGE_LIMITS[field]
    return gr.Number(value, label=label, step=step, info=str(rule), elem_id=f"sd-{panel}-{field}")


def _settings() -> list:
    """The request's fields, in `workflow_api.BASE_FIELDS` order."""
    defaults = GenerateParams("")
    prompt = gr.Textbox(label="Prompt", lines=2, elem_id="sd-i2i-prompt")
    negative = gr.Textbox(label="Negative prompt", lines=1, elem_id="sd-i2i-negative")
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
    image and denoising strength, a note for what the send did, and the sub-tabs (to show that panel)."""

    settings: list
    image: gr.Image
    strength: gr.Number
    note: gr.Markdown
    panels: gr.Tabs


def _page_state(ctx: UiContext, values: tuple):
    """The `state` argument of a run: the page's panel, read from the last inputs (`GenerateTab.state_inputs`)."""
    return lambda: desired_from_panel(ctx, values)


def _img2img_panel(ctx: UiContext, base: list, out: _Outputs, page: list) -> tuple[gr.Image, gr.Number]:
    image = gr.Image(type="pil", label="Init image", elem_id="sd-i2i-image", height=300)
    with gr.Row():
        resize = gr.Radio(list(RESIZE_MODES), value=RESIZE_MODES[0], label="Resize mode", elem_id="sd-i2i-resize")
        strength = _number("denoising_strength", "Denoising strength", 0.75, 0.05)
    go = gr.Button("Run img2img", variant="primary", elem_id="sd-i2i-run")
    n = len(page)
    go.click(lambda progress=PROGRESS, *v: run_img2img(ctx, list(v[:9]), *v[9:-n], progress=progress,
                                                       state=_page_state(ctx, v[-n:]))[:2],
             [*base, image, strength, resize, *page], out.all, api_visibility="private", concurrency_id=QUEUE,
             show_progress_on=[out.gallery])
    return image, strength


def _inpaint_panel(ctx: UiContext, base: list, out: _Outputs, page: list) -> None:
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
    go = gr.Button("Run inpaint", variant="primary", elem_id="sd-inpaint-run")

    def inpaint(progress=PROGRESS, *values):
        edited, upload, strength_v, resize_v, blur_v, fill_v, invert_v = values[9:9 + 7]
        image, painted = editor_mask(edited)
        mask = upload if upload is not None else painted
        if image is not None and mask is None:
            raise gr.Error("Inpaint failed: paint the area to repaint, or upload a mask", print_exception=False)
        return run_img2img(ctx, list(values[:9]), image, strength_v, resize_v, mask, blur_v, fill_v, invert_v,
                           progress=progress, state=_page_state(ctx, values[9 + 7:]))[:2]

    go.click(inpaint, [*base, editor, uploaded, strength, resize, blur, fill, invert, *page], out.all,
             api_visibility="private", concurrency_id=QUEUE, show_progress_on=[out.gallery])


def _hires_panel(ctx: UiContext, base: list, out: _Outputs, page: list) -> None:
    with gr.Row():
        scale = _number("hires_scale", "Upscale by", 2.0, 0.25, "hires")
        upscaler = gr.Dropdown(list(UPSCALERS), value="Latent", label="Upscaler", elem_id="sd-hires-upscaler")
        steps = _number("hires_steps", "Hires steps", 0, 1, "hires")
        strength = _number("denoising_strength", "Denoising strength", 0.7, 0.05, "hires")
    sampler = gr.Dropdown([SAME, *SCHEDULERS], value=SAME, label="Hires sampler", elem_id="sd-hires-sampler")
    prompt = gr.Textbox(label="Hires prompt (empty: the prompt; its <lora:…> tags set this pass's LoRAs)",
                        elem_id="sd-hires-prompt")
    negative = gr.Textbox(label="Hires negative prompt (empty: the negative prompt)")
    go = gr.Button("Run txt2img + hires fix", variant="primary", elem_id="sd-hires-run")
    n = len(page)
    go.click(lambda progress=PROGRESS, *v: run_hires(ctx, list(v[:9]), *v[9:-n], progress=progress,
                                                     state=_page_state(ctx, v[-n:]))[:2],
             [*base, scale, upscaler, steps, strength, sampler, prompt, negative, *page], out.all,
             api_visibility="private", concurrency_id=QUEUE, show_progress_on=[out.gallery])


def build_img2img_tab(ctx: UiContext, page: list) -> Img2ImgTab:
    """Lay out the tab: shared settings on the left, one sub-tab per workflow, the results on the right
    (built first, unrendered, so every panel's button can write to them). `page`: the Generate tab's
    `state_inputs`, the state every run carries."""
    out = _Outputs(gr.Gallery(label="Images", columns=2, height=420, elem_id="sd-i2i-gallery", format="png",
                              object_fit="contain", render=False),
                   gr.Textbox(label="Infotext", lines=6, buttons=["copy"], elem_id="sd-i2i-infotext", render=False))
    with gr.Row():
        with gr.Column(scale=3):
            base = _settings()
            note = gr.Markdown(elem_id="sd-i2i-note")  # what "send to img2img" filled in, or could not
            with gr.Tabs() as panels:
                with gr.Tab("img2img", id="i2i-img2img"):
                    image, strength = _img2img_panel(ctx, base, out, page)
                with gr.Tab("Inpaint", id="i2i-inpaint"):
                    _inpaint_panel(ctx, base, out, page)
                with gr.Tab("Hires fix", id="i2i-hires"):
                    _hires_panel(ctx, base, out, page)
        with gr.Column(scale=2):
            out.gallery.render()
            out.infotext.render()
    return Img2ImgTab(base, image, strength, note, panels)
