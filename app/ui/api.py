"""The scripting API: stable endpoint names with plain JSON-able arguments, for `gradio_client`.

    from gradio_client import Client
    c = Client("http://127.0.0.1:7860/", auth=("user", "pass"))
    c.predict([{"name": "style", "weight": 0.8}, {"name": "detail", "weight": 1.5, "te_weight": 0.5}],
              api_name="/set_loras")
    images, infotext, details = c.predict("a fox", "", "Euler a", 20, 7.0, 42, 512, 512, 1, api_name="/generate")

Endpoints: generate, img2img, inpaint, txt2img_hires (app/ui/workflow_api.py), set_loras, set_offload,
set_dtype, load_model, unload, set_debug,
list_models, list_loras, inspect_lora, snapshot, bug_report (the last one is the Diagnostics tab's button).
These are independent of the UI layout (which can change freely) and never take `gr.State`,
which `gradio_client` cannot send. Every name is validated against its folder; every failure
comes back as an error message, never as a half-applied state.
"""

from __future__ import annotations

import gradio as gr

from app.engine.generate import SCHEDULERS, GenerateParams
from app.report import jsonable
from app.ui.common import (
    PROGRESS,
    UiContext,
    checked_checkpoint,
    checkpoint_names,
    gallery_items,
    generate_params,
    run_with_progress,
    snapshot_summary,
    specs_from_json,
    user_errors,
)
from app.ui.workflow_api import register_workflow_api


def _change(ctx: UiContext, action: str, call) -> dict:
    """Run one engine change for a script: the error text goes back unescaped (no browser shows it)."""
    with user_errors(action, browser=False):
        run_with_progress(ctx.engine, call, None)
    return snapshot_summary(ctx)


def _state_endpoints(ctx: UiContext) -> None:
    engine = ctx.engine

    @gr.api(api_name="set_loras", concurrency_id="loras")
    def set_loras(loras: list[dict]) -> dict:
        """Apply exactly this list: [{"name", "weight", "unet_weight"?, "te_weight"?}]; [] removes all."""
        return _change(ctx, "set_loras", lambda: engine.set_loras(specs_from_json(loras)))

    @gr.api(api_name="set_offload", concurrency_id="loras")
    def set_offload(mode: str) -> dict:
        """Offload mode: none, model, sequential, balanced or group."""
        return _change(ctx, "set_offload", lambda: engine.set_offload(mode))

    @gr.api(api_name="set_dtype", concurrency_id="loras")
    def set_dtype(dtype: str) -> dict:
        """Weights dtype: auto, fp16, bf16 or fp32 (reloads the checkpoint)."""
        return _change(ctx, "set_dtype", lambda: engine.set_dtype(dtype))

    @gr.api(api_name="load_model", concurrency_id="loras")
    def load_model(name: str) -> dict:
        """Load a checkpoint by the name `list_models` returns."""
        return _change(ctx, "load_model", lambda: engine.load_model(checked_checkpoint(ctx.settings, name)))

    @gr.api(api_name="unload", concurrency_id="loras")
    def unload() -> dict:
        """Drop the model and return its RAM/VRAM."""
        return _change(ctx, "unload", engine.unload)


def _debug_endpoint(ctx: UiContext) -> None:
    @gr.api(api_name="set_debug")
    def set_debug(lora_debug: bool, move_debug: bool, strict: bool) -> dict:
        """LoRA debug, move debug and strict mode; they take effect at once (no tensor is touched)."""
        changed = ctx.engine.set_debug(lora_debug=lora_debug, move_debug=move_debug, strict=strict)
        return {"lora_debug": changed.lora_debug, "move_debug": changed.move_debug, "strict": changed.strict}


def _read_endpoints(ctx: UiContext) -> None:
    @gr.api(api_name="snapshot")
    def snapshot() -> dict:
        """The full engine snapshot: state, placement rows, violations, LoRAs, counters, timers, history."""
        return jsonable(ctx.engine.snapshot())

    @gr.api(api_name="list_models")
    def list_models() -> list[str]:
        """Checkpoint names under models/Stable-diffusion."""
        return checkpoint_names(ctx.settings)

    @gr.api(api_name="list_loras")
    def list_loras() -> list[str]:
        """LoRA names under models/Lora (without .safetensors)."""
        return ctx.engine.library.names()

    @gr.api(api_name="inspect_lora")
    def inspect_lora(name: str) -> dict:
        """Card metadata and the fit check of one LoRA against the loaded model."""
        with user_errors("inspect_lora", browser=False):
            path = ctx.engine.library.path_for(name)
            card = ctx.cards.card(name, path)
            fit = ctx.cards.fit(ctx.engine, name, path, ctx.engine.snapshot().model_hash)
        return {"card": jsonable(card), "fit": jsonable(fit)}


def _generate_endpoint(ctx: UiContext) -> None:
    """Generate needs file outputs, so it is an event on hidden components rather than `gr.api`.

    Numbers are taken as sent (no `precision` rounding) so the shared rules can refuse 1.5 as a
    seed instead of Gradio quietly making it 2."""
    defaults = GenerateParams("")
    with gr.Column(visible=False):
        inputs = [gr.Textbox(label="prompt"), gr.Textbox("", label="negative_prompt"),
                  gr.Dropdown(list(SCHEDULERS), value=defaults.sampler, label="sampler"),
                  *(gr.Number(getattr(defaults, name), label=name)
                    for name in ("steps", "cfg", "seed", "width", "height", "batch"))]
        outputs = [gr.Gallery(label="images", format="png"), gr.Textbox(label="infotext"), gr.JSON(label="details")]
        trigger = gr.Button("generate")

    def generate(prompt, negative_prompt, sampler, steps, cfg, seed, width, height, batch, progress=PROGRESS):
        with user_errors("generate", browser=False):
            params, notes = generate_params(ctx, prompt, negative_prompt, sampler, steps, cfg, seed, width, height,
                                            batch)
            images = run_with_progress(ctx.engine, lambda: ctx.engine.generate(params), progress)
        details = [{"seed": im.seed, "infotext": im.infotext, "file": im.path.name if im.path else None,
                    "notes": list(notes)} for im in images]
        return gallery_items(images), images[0].infotext, details

    trigger.click(generate, inputs, outputs, api_name="generate", concurrency_id="loras",
                  api_description="Generate with the engine's current LoRAs plus any <lora:name:w> prompt tags. "
                                  "Returns (images, infotext of the first image, [{seed, infotext, file, notes}]); "
                                  "notes say what was rounded (sizes go down to the model's multiple of 8).")


def register_api(ctx: UiContext) -> None:
    """Add every named endpoint to the Blocks being built."""
    _state_endpoints(ctx)
    _debug_endpoint(ctx)
    _read_endpoints(ctx)
    _generate_endpoint(ctx)
    register_workflow_api(ctx)
