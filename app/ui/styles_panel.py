"""The Generate tab's styles row: pick saved styles (A1111's `styles.csv`) and save the prompts as one.

The picked styles are applied when Generate runs (`common.generate_params`, the API's rule too), so
the prompt fields keep what the user typed and the saved infotext carries the styled prompt, as in
A1111. The list is read from the file on every refresh and after every save: a style the user added
by hand, or from another tab, shows up without a restart.
"""

from __future__ import annotations

import gradio as gr

from app.styles import PromptStyle, read_styles, save_style
from app.ui.common import UiContext, user_errors


def style_names(ctx: UiContext) -> list[str]:
    with user_errors("Reading the styles", ctx.settings.data_dir):
        return list(read_styles(ctx.settings.styles_file))


def build_styles_row(ctx: UiContext, prompt: gr.Textbox, negative: gr.Textbox) -> gr.Dropdown:
    """Lay out the row (picker, refresh, name, save) and wire it; returns the picker (a generation input)."""
    with gr.Row(equal_height=True):
        picked = gr.Dropdown(style_names(ctx), value=[], multiselect=True, label="Styles", scale=4,
                             elem_id="sd-styles", info=f"saved in {ctx.settings.styles_file.name}; "
                                                       "{prompt} in a style marks where your prompt goes")
        refresh = gr.Button("↻", scale=0, min_width=44, elem_id="sd-styles-refresh")
        name = gr.Textbox(label="Style name", scale=2, elem_id="sd-style-name", placeholder="name to save as")
        save = gr.Button("💾 Save as style", scale=1, elem_id="sd-style-save")

    def ui_save(style_name: str, prompt_text: str, negative_text: str, chosen: list[str]):
        with user_errors("Saving the style", ctx.settings.data_dir):
            saved = save_style(ctx.settings.styles_file, PromptStyle(style_name or "", prompt_text or "",
                                                                     negative_text or ""))
        gr.Info(f"Style {style_name.strip()!r} saved to {ctx.settings.styles_file.name}.")
        return gr.Dropdown(choices=list(saved), value=[c for c in chosen or [] if c in saved])

    def ui_refresh(chosen: list[str]):
        names = style_names(ctx)
        return gr.Dropdown(choices=names, value=[c for c in chosen or [] if c in names])

    private = dict(api_visibility="private")
    save.click(ui_save, [name, prompt, negative, picked], picked, **private)
    refresh.click(ui_refresh, picked, picked, **private)
    return picked
