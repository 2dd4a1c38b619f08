"""The banner over the tabs while the loaded model is a demo (random weights, `app.demo`): its images
are noise by design, and a newcomer who is not told so takes the app for broken. It says where real
checkpoints go, in the data folder's A1111 layout, and is hidden for any other model."""

from __future__ import annotations

import gradio as gr

from app.demo import is_demo_checkpoint
from app.ui.common import UiContext


def banner_text(ctx: UiContext) -> str:
    """The banner's text for the model loaded now ("" when it is not a demo)."""
    name = ctx.engine.snapshot().model
    if name is None or not is_demo_checkpoint(ctx.settings.checkpoints_dir / name):
        return ""
    settings = ctx.settings

    def shown(folder) -> str:
        return f"`{folder.relative_to(settings.data_dir).as_posix()}/`"

    return (f"⚠ **{name} is a demo model with random weights**: its images are noise, by design, so the app "
            f"can be tried without a download. Put real checkpoints in {shown(settings.checkpoints_dir)} (LoRAs "
            f"in {shown(settings.lora_dir)}, embeddings in {shown(settings.embeddings_dir)}) under the data "
            "folder, then press ↻ beside Checkpoint.")


def build_demo_banner() -> gr.Markdown:
    return gr.Markdown(visible=False, elem_id="sd-demo-banner", elem_classes="sd-demo-banner")


def banner_update(ctx: UiContext) -> gr.Markdown:
    text = banner_text(ctx)
    return gr.Markdown(text, visible=bool(text))
