"""The PNG Info tab: drop a PNG (or paste infotext) from A1111, Forge or this app, read what made it,
and send it to Generate, or with the PNG as the init image to img2img.

The image component hands over the uploaded file as it came (`type="filepath"`, no colour-mode
conversion), because a re-encoded copy would lose the `parameters` text chunk. The text box is
editable, so parameters copied from a web page can be pasted and sent the same way.
"""

from __future__ import annotations

import html

import gradio as gr

from app.infotext import Infotext, parse_infotext, read_parameters
from app.ui.common import UiContext
from app.ui.send_to import Senders, add_send_buttons

NO_TEXT = ("This image carries no generation parameters. A1111, Forge and this app write them into the "
           "PNG's `parameters` text; other tools, screenshots and re-saved copies drop them.")


def summary_markdown(info: Infotext) -> str:
    """The parsed infotext as the user reads it: prompts, LoRAs with both weights, then every setting."""
    def row(key: str, value: str) -> str:
        return f"| {html.escape(key)} | {html.escape(value).replace('|', '&#124;') or '—'} |"

    loras = ", ".join(f"{s.name} (UNet {s.schedule_text or format(s.unet_strength, 'g')} / TE {s.te_strength:g})"
                      for s in info.loras)
    rows = [row("Prompt", info.prompt), row("Negative prompt", info.negative_prompt), row("LoRAs", loras or "none")]
    rows += [row(key, value) for key, value in info.settings.items() if key != "Lora weights"]
    origin = "this app" if info.ours else f"another tool ({info.settings.get('Version', 'version not recorded')})"
    return f"Written by {html.escape(origin)}.\n\n| | |\n|---|---|\n" + "\n".join(rows)


def read_text(text: str) -> str:
    """The summary of an infotext, or why there is none to show."""
    if not (text or "").strip():
        return NO_TEXT
    try:
        return summary_markdown(parse_infotext(text))
    except ValueError as exc:
        return f"⚠ {html.escape(str(exc))}"


def build_pnginfo_tab(ctx: UiContext, sends: Senders) -> None:
    with gr.Row():
        with gr.Column(scale=2):
            image = gr.Image(type="filepath", image_mode=None, sources=["upload", "clipboard"], height=380,
                             label="Drop a PNG made by A1111, Forge or this app", elem_id="sd-pnginfo-image")
        with gr.Column(scale=3):
            text = gr.Textbox(label="Infotext (parameters) — or paste one here", lines=7, buttons=["copy"],
                              elem_id="sd-pnginfo-text")
            # drawn below the buttons, which show a send's progress on it
            summary = gr.Markdown(elem_id="sd-pnginfo-summary", render=False)
            with gr.Row():
                add_send_buttons(ctx, sends, text, image, summary, "sd-pnginfo-send")
            summary.render()

    def on_image(path):
        if not path:
            return "", ""
        try:
            found = read_parameters(path) or ""
        except (OSError, ValueError) as exc:  # unreadable, or text over the caps of `app.png_text`
            return "", f"⚠ {html.escape(str(exc))}"
        return found, read_text(found)

    image.change(on_image, image, [text, summary], api_visibility="private")
    text.input(read_text, text, summary, api_visibility="private", trigger_mode="always_last",
               show_progress="hidden")
