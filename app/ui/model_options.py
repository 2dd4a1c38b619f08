"""The model options beside the checkpoint: weight storage (full / fp8 / int8) and, for families that
assemble a checkpoint from separate files (Flux), which text-encoder and VAE files it uses.

The engine decides and remembers (`Engine.set_weights`, `Engine.set_model_parts`, the choices file
per checkpoint); these controls only show the snapshot's truth and ask for changes, and they hide
when the loaded family has no separate parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app.accounts import require_admin
from app.engine import part_choices
from app.engine.storage import WEIGHTS_CHOICES
from app.families import FAMILIES, family
from app.ui.common import PROGRESS, UiContext, run_with_progress, user_errors

# One picker per component any family reads from a file of its own; its label is the loaded family's
# (`ComponentFile.label`: "T5-XXL text encoder (t5xxl_fp16.safetensors)").
_PICKED = tuple(dict.fromkeys(p.component for fam in FAMILIES.values() for p in fam.files.parts if p.folder))
AUTO = "(the one file in its folder)"
ADMIN_ONLY = "engine-wide: set by an admin login for every user"


def engine_wide(admin: bool | None) -> dict:
    """Arguments of an engine-wide control's update: usable by an admin only, and saying so to others (None:
    leave it as it is)."""
    if admin is None:
        return {}
    return {"interactive": admin} | ({} if admin else {"info": ADMIN_ONLY})


@dataclass
class ModelOptions:
    weights: gr.Radio
    parts_box: gr.Accordion
    parts: dict[str, gr.Dropdown]

    @property
    def outputs(self) -> list:
        return [self.weights, self.parts_box, *self.parts.values()]


def build_model_options(ctx: UiContext) -> ModelOptions:
    weights = gr.Radio(list(WEIGHTS_CHOICES), value=ctx.settings.weights, label="Weights", elem_id="sd-weights",
                       info="fp8: large weights rest in 8 bits (about half the memory); LoRAs stay exact. "
                            "fp8-compute: the same, and Linear layers run as fp8 matmuls (faster on sm89+ GPUs; "
                            "the image changes a little)")
    with gr.Accordion("Model parts (text encoders, VAE)", open=False, visible=False) as box:
        parts = {c: gr.Dropdown([], label=c, elem_id=f"sd-part-{c}", interactive=True) for c in _PICKED}
    return ModelOptions(weights, box, parts)


def option_updates(ctx: UiContext, admin: bool | None = None) -> list:
    """The controls as the engine has them: storage asked for, and the part pickers of the loaded
    family (hidden when it has none) with the files its folders offer and the one chosen; with `admin`
    given, usable or not (`engine_wide`)."""
    snap = ctx.engine.snapshot()
    has_parts = snap.family is not None and bool(family(snap.family).files.parts)
    offered = part_choices.available(ctx.settings, snap.family) if has_parts else {}
    chosen = part_choices.chosen(ctx.settings, snap.model) if offered else {}
    labels = {p.component: p.label for p in family(snap.family).files.parts} if offered else {}
    pickers = [gr.Dropdown(choices=[AUTO, *offered[c]], value=chosen.get(c, AUTO), label=labels[c], visible=True,
                           **engine_wide(admin))
               if c in offered else gr.Dropdown(visible=False) for c in _PICKED]
    return [gr.Radio(value=snap.weights, **engine_wide(admin)), gr.Accordion(visible=bool(offered)), *pickers]


def _part_label(engine, component: str) -> str:
    family_name = engine.snapshot().family
    if not family_name:
        return component
    return next((p.label for p in family(family_name).files.parts if p.component == component), component)


def wire_model_options(ctx: UiContext, options: ModelOptions, status: gr.Markdown, **private) -> None:
    engine = ctx.engine

    def ui_set_weights(weights, request: gr.Request, progress=PROGRESS):
        with user_errors("Changing the weight storage", ctx.settings.data_dir):
            require_admin(ctx.account(request), "Changing the weight storage")
            snap = run_with_progress(engine, lambda: engine.set_weights(weights), progress)
        held = ", ".join(snap.stored_as)
        saved = f"; {snap.stored_layers} layers stored ({held}) save {snap.bytes_saved / 2**20:.0f} MiB"
        return f"weights now **{snap.weights}**{saved if snap.stored_layers else ''}"

    def picker(component: str):
        def ui_choose(name, request: gr.Request, progress=PROGRESS):
            with user_errors("Choosing the model parts", ctx.settings.data_dir):
                require_admin(ctx.account(request), "Choosing the model parts")
                run_with_progress(engine, lambda: engine.set_model_parts({component: None if name == AUTO else name}),
                                  progress)
            return f"{_part_label(engine, component)} now **{name}**"
        return ui_choose

    options.weights.input(ui_set_weights, options.weights, status, **private)
    for component, dropdown in options.parts.items():
        dropdown.select(picker(component), dropdown, status, **private).failure(
            lambda: option_updates(ctx), None, options.outputs, api_visibility="private")
