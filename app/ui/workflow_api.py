"""img2img, inpaint and hires fix for the UI tab and the named API: one handler each, shared.

Numbers go through the one rule set (`generate.LIMITS` via `params_from_form`, the workflow
fields via `stage_params.STAGE_LIMITS`), every refusal of one request in one message. The named
endpoints (`/img2img`, `/inpaint`, `/txt2img_hires`) take plain values and images, as `/generate`
does, so `gradio_client` scripts can call them (and stop them with `/interrupt` and `/skip`: a job
is its client's); they are events on hidden components because they return files. A named
endpoint's job carries its client's state (`app/ui/sessions.py`), a tab's run its page's.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from app.controlnet.units import with_units
from app.engine.desired import Desired
from app.engine.generate import SCHEDULERS, GenerateParams, params_from_form
from app.engine.stage_params import MASKED_CONTENT, RESIZE_MODES, SAME, stage_values
from app.ui.common import (
    PROGRESS,
    UiContext,
    gallery_items,
    generation_lane,
    missing_lora_notes,
    run_with_progress,
    user_errors,
)
from app.ui.generate_run import owner_of
from app.ui.hires_fields import hires_params

# The request's own fields, in the order every handler and endpoint takes them.
BASE_FIELDS = ("prompt", "negative_prompt", "sampler", "steps", "cfg", "seed", "width", "height", "batch")


def checked(ctx: UiContext, values: dict, stage_fields: tuple[str, ...]) -> tuple[GenerateParams, dict, tuple]:
    """(request, workflow numbers, rounding notes); every problem of both rule sets in one ValueError."""
    problems, params, notes, stage = [], None, (), {}
    try:
        params, notes = params_from_form(values, ctx.engine.snapshot().family)
    except ValueError as exc:
        problems.append(str(exc))
    try:
        stage = stage_values(values, stage_fields)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ValueError(";\n".join(problems))
    return params, stage, (*notes, *missing_lora_notes(ctx, params))


def _answer(images, notes) -> tuple:
    details = [{"seed": im.seed, "infotext": im.infotext, "file": im.path.name if im.path else None,
                "notes": list(notes)} for im in images]
    return gallery_items(images), images[0].infotext if images else "", details


def img2img_job(ctx: UiContext, base: list, init_image, denoising_strength, resize_mode, mask=None, mask_blur=4,
                inpainting_fill="original", invert=False, desired: Desired | None = None, controlnet_units=(),
                details=None) -> tuple[GenerateParams, Callable, tuple]:
    """img2img (no mask) or inpaint, checked: (request, `call(owner)` running it on the engine with the
    state `desired` (None: as the engine holds it), the ControlNet units and the Detailer's `details`, rounding
    notes). Every refusal is a ValueError before anything is queued."""
    if init_image is None:
        raise ValueError("upload an init image first")
    values = {**dict(zip(BASE_FIELDS, base, strict=True)), "denoising_strength": denoising_strength,
              "mask_blur": mask_blur}
    params, stage, notes = checked(ctx, values, ("denoising_strength", "mask_blur"))
    params = with_units(params, controlnet_units)

    def call(owner: str | None) -> list:
        return ctx.engine.img2img(params, [init_image], denoising_strength=stage["denoising_strength"],
                                  resize_mode=resize_mode, mask=mask, mask_blur=stage["mask_blur"],
                                  inpainting_fill=inpainting_fill, inpainting_mask_invert=bool(invert), owner=owner,
                                  desired=desired, details=details)
    return params, call, notes


def edit_job(ctx: UiContext, base: list, references: list, desired: Desired | None = None
             ) -> tuple[GenerateParams, Callable, tuple]:
    """Reference editing (a family that takes `reference_images`), checked: (request,
    `call(owner)` with the state `desired`, rounding notes). The engine refuses a model that takes
    none, naming it."""
    pictures = [item[0] if isinstance(item, (tuple, list)) else item for item in references or ()]
    if not pictures:
        raise ValueError("add the reference images first")
    params, _stage, notes = checked(ctx, dict(zip(BASE_FIELDS, base, strict=True)), ())
    return params, lambda owner: ctx.engine.edit(params, pictures, owner=owner, desired=desired), notes


def run_img2img(ctx: UiContext, base: list, init_image, denoising_strength, resize_mode, mask=None, mask_blur=4,
                inpainting_fill="original", invert=False, progress=None, owner: str | None = None) -> tuple:
    """img2img (no mask) or inpaint for the named API, with `owner`'s state; returns (gallery items, first
    infotext, details)."""
    with user_errors("img2img" if mask is None else "inpaint", ctx.settings.data_dir, browser=False):
        _params, call, notes = img2img_job(ctx, base, init_image, denoising_strength, resize_mode, mask, mask_blur,
                                           inpainting_fill, invert, _client_state(ctx, owner))
        images = run_with_progress(ctx.engine, lambda: call(owner), progress)
    return _answer(images, notes)


def run_hires(ctx: UiContext, base: list, scale, upscaler, steps, denoising_strength, sampler, prompt, negative,
              progress=None, owner: str | None = None) -> tuple:
    """txt2img with hires fix for the named API, with `owner`'s state; returns (gallery items, first infotext,
    details)."""
    with user_errors("Hires fix", ctx.settings.data_dir, browser=False):
        values = {**dict(zip(BASE_FIELDS, base, strict=True)), "hires_scale": scale, "hires_steps": steps,
                  "denoising_strength": denoising_strength}
        params, stage, notes = checked(ctx, values, ("hires_scale", "hires_steps", "denoising_strength"))
        hires = hires_params(stage, upscaler, sampler, prompt, negative)
        desired = _client_state(ctx, owner)
        images = run_with_progress(ctx.engine, lambda: ctx.engine.generate(params, hires=hires, owner=owner,
                                                                           desired=desired), progress)
    return _answer(images, notes)


def _client_state(ctx: UiContext, owner: str | None) -> Desired | None:
    """The state a named endpoint's job carries: its client's own (`app/ui/sessions.py`; None: no client)."""
    return None if owner is None else ctx.desired_for(owner)


def editor_mask(edited) -> tuple[object, object]:
    """(background, mask) of an ImageEditor value: the mask is where any layer was painted."""
    if not edited or edited.get("background") is None:
        return None, None
    from PIL import Image, ImageChops

    mask = Image.new("L", edited["background"].size, 0)
    for layer in edited.get("layers") or []:
        if layer is not None:
            mask = ImageChops.lighter(mask, layer.convert("RGBA").getchannel("A").resize(mask.size))
    return edited["background"].convert("RGB"), mask


def _base_inputs() -> list:
    defaults = GenerateParams("")
    return [gr.Textbox(label="prompt"), gr.Textbox("", label="negative_prompt"),
            gr.Dropdown(list(SCHEDULERS), value=defaults.sampler, label="sampler"),
            *(gr.Number(getattr(defaults, name), label=name)
              for name in ("steps", "cfg", "seed", "width", "height", "batch"))]


def _outputs() -> list:
    return [gr.Gallery(label="images", format="png"), gr.Textbox(label="infotext"), gr.JSON(label="details")]


def register_workflow_api(ctx: UiContext) -> None:
    """`/img2img`, `/inpaint`, `/txt2img_hires` on hidden components (see the module docstring)."""
    with gr.Column(visible=False):
        base = _base_inputs()
        image = gr.Image(type="pil", label="init_image")
        strength = gr.Number(0.75, label="denoising_strength")
        resize = gr.Dropdown(list(RESIZE_MODES), value=RESIZE_MODES[0], label="resize_mode")
        mask = gr.Image(type="pil", image_mode="L", label="mask")
        blur, fill = gr.Number(4, label="mask_blur"), gr.Dropdown(list(MASKED_CONTENT), value="original",
                                                                   label="inpainting_fill")
        invert = gr.Checkbox(False, label="inpainting_mask_invert")
        hires = [gr.Number(2.0, label="hires_scale"),
                 # any name: a model file added after start is checked by the engine, not by the list
                 gr.Dropdown(ctx.engine.hires_upscalers(), value="Latent", label="hires_upscaler",
                             allow_custom_value=True),
                 gr.Number(0, label="hires_steps"), gr.Number(0.7, label="denoising_strength"),
                 gr.Dropdown([SAME, *SCHEDULERS], value=SAME, label="hires_sampler"),
                 gr.Textbox("", label="hires_prompt"), gr.Textbox("", label="hires_negative_prompt")]
        buttons = [gr.Button(name) for name in ("img2img", "inpaint", "txt2img_hires")]
        outputs = _outputs()

    # Named parameters (not *values): gradio_client takes keyword arguments by these names.
    def img2img(prompt, negative_prompt, sampler, steps, cfg, seed, width, height, batch, init_image,
                denoising_strength, resize_mode, request: gr.Request, progress=PROGRESS):
        base = [prompt, negative_prompt, sampler, steps, cfg, seed, width, height, batch]
        return run_img2img(ctx, base, init_image, denoising_strength, resize_mode, progress=progress,
                           owner=owner_of(request))

    def inpaint(prompt, negative_prompt, sampler, steps, cfg, seed, width, height, batch, init_image,
                denoising_strength, resize_mode, mask, mask_blur, inpainting_fill, inpainting_mask_invert,
                request: gr.Request, progress=PROGRESS):
        if mask is None:
            raise gr.Error("inpaint failed: a mask is required (white repaints)", print_exception=False)
        base = [prompt, negative_prompt, sampler, steps, cfg, seed, width, height, batch]
        return run_img2img(ctx, base, init_image, denoising_strength, resize_mode, mask, mask_blur, inpainting_fill,
                           inpainting_mask_invert, progress=progress, owner=owner_of(request))

    def txt2img_hires(prompt, negative_prompt, sampler, steps, cfg, seed, width, height, batch, hires_scale,
                      hires_upscaler, hires_steps, denoising_strength, hires_sampler, hires_prompt,
                      hires_negative_prompt, request: gr.Request, progress=PROGRESS):
        base = [prompt, negative_prompt, sampler, steps, cfg, seed, width, height, batch]
        return run_hires(ctx, base, hires_scale, hires_upscaler, hires_steps, denoising_strength, hires_sampler,
                         hires_prompt, hires_negative_prompt, progress=progress, owner=owner_of(request))

    common = generation_lane()
    buttons[0].click(img2img, [*base, image, strength, resize], outputs, api_name="img2img", **common,
                     api_description="img2img from one init image (A1111 resize modes); returns (images, infotext, "
                                     "[{seed, infotext, file, notes}]).")
    buttons[1].click(inpaint, [*base, image, strength, resize, mask, blur, fill, invert], outputs, api_name="inpaint",
                     api_description="Inpaint: white in the mask repaints; inpainting_fill is A1111's masked "
                                     "content (fill, original, latent noise, latent nothing).", **common)
    buttons[2].click(txt2img_hires, [*base, *hires], outputs, api_name="txt2img_hires", **common,
                     api_description="txt2img with A1111's hires fix (latent or pixel upscaler, second pass).")
