"""The "Extras" tab: A1111's upscale of a single image or a batch, by a factor or to a size, with a second
upscaler blended in at a visibility, each image one transition of the engine (Diagnostics → History).

The tab only draws: the numbers are checked by `ExtrasParams` (the rule set the A1111 API uses), the
upscaler lists are the engine's (`None`, the resamplers, every model file found; refreshed each time
the tab is opened, so a file dropped into a folder shows up), and the results are the saved PNGs, which
carry A1111's postprocessing text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr

from app.ui.common import PROGRESS, UiContext, run_with_progress, user_errors
from app.ui.kept_upload import keep_on_refusal
from app.upscalers.extras import EXTRAS_LIMITS, NONE, RESIZE_MODES, ExtrasParams

QUEUE = "loras"  # the lane every engine-changing event shares, in order


def _first_model(ctx: UiContext) -> str:
    """The first upscaler model found, else Lanczos: an Extras run should enlarge by default."""
    models = ctx.engine.upscalers.names()
    return models[0] if models else "Lanczos"


def run_extras(ctx: UiContext, single, batch, source: str, mode: str, factor, width, height, crop, upscaler,
               upscaler_2, visibility, progress=None) -> tuple[list[tuple], str]:
    """Upscale the single image or the batch (whichever sub-tab is open); (gallery items, first infotext)."""
    with user_errors("Extras", ctx.settings.data_dir):
        images = [item[0] for item in batch or []] if source == "batch" else [single] if single is not None else []
        if not images:
            raise ValueError("upload an image first" if source == "single" else "add images to the batch first")
        params = ExtrasParams(str(upscaler), mode, factor, width, height, bool(crop), str(upscaler_2 or NONE),
                              visibility if visibility is not None else 0.0)
        results = run_with_progress(ctx.engine, lambda: ctx.engine.extras(images, params), progress)
    items = [(str(r.path) if r.path else r.image, f"{r.image.width}x{r.image.height}") for r in results]
    return items, results[0].infotext if results else ""


@dataclass
class ExtrasTab:
    """What `build_app` wires: the refresh of the upscaler lists when the tab is opened."""

    refresh: Callable[[], tuple]
    dropdowns: list[gr.Dropdown]


def _number(field: str, label: str, value: float, step: float) -> gr.Number:
    return gr.Number(value, label=label, step=step, info=str(EXTRAS_LIMITS[field]), elem_id=f"sd-extras-{field}")


def build_extras_tab(ctx: UiContext) -> ExtrasTab:
    with gr.Row():
        with gr.Column(scale=3):
            source = gr.State("single")
            with gr.Tabs():
                with gr.Tab("Single image", id="extras-single") as single_tab:
                    single = gr.Image(type="pil", label="Image", elem_id="sd-extras-image", height=300, format="png")
                with gr.Tab("Batch", id="extras-batch") as batch_tab:
                    batch = gr.Gallery(type="pil", label="Images", elem_id="sd-extras-batch", interactive=True,
                                       columns=4, height=300)
            single_tab.select(lambda: "single", None, source, api_visibility="private")
            batch_tab.select(lambda: "batch", None, source, api_visibility="private")
            mode = gr.Radio(list(RESIZE_MODES), value=RESIZE_MODES[0], label="Resize", elem_id="sd-extras-mode")
            with gr.Row():
                factor = _number("upscaling_resize", "Scale by", 2.0, 0.25)
                width = _number("upscaling_resize_w", "Width (scale to)", 512, 8)
                height = _number("upscaling_resize_h", "Height (scale to)", 512, 8)
                crop = gr.Checkbox(True, label="Crop to fit", elem_id="sd-extras-crop")
            choices = ctx.engine.extras_upscalers()
            upscaler = gr.Dropdown(choices, value=_first_model(ctx), label="Upscaler 1", elem_id="sd-extras-upscaler")
            with gr.Row():
                upscaler_2 = gr.Dropdown(choices, value=NONE, label="Upscaler 2", elem_id="sd-extras-upscaler-2")
                visibility = _number("extras_upscaler_2_visibility", "Upscaler 2 visibility", 0.0, 0.05)
            go = gr.Button("Upscale", variant="primary", elem_id="sd-extras-run")
        with gr.Column(scale=2):
            gallery = gr.Gallery(label="Upscaled", columns=2, height=420, elem_id="sd-extras-gallery", format="png",
                                 object_fit="contain")
            infotext = gr.Textbox(label="Postprocessing", lines=3, buttons=["copy"], elem_id="sd-extras-infotext")
    keep_on_refusal(single, infotext)  # the text of the last result is not left beside an emptied field
    go.click(lambda progress=PROGRESS, *v: run_extras(ctx, *v, progress=progress),
             [single, batch, source, mode, factor, width, height, crop, upscaler, upscaler_2, visibility],
             [gallery, infotext], api_visibility="private", concurrency_id=QUEUE, show_progress_on=[gallery])

    def refresh() -> tuple:
        names = ctx.engine.extras_upscalers()
        return gr.Dropdown(choices=names), gr.Dropdown(choices=names)
    return ExtrasTab(refresh, [upscaler, upscaler_2])
