"""The Generate tab's styles row: pick saved styles (A1111's `styles.csv`) and save the prompts as one.

The picked styles are applied when Generate runs (`common.generate_params`, the API's rule too), so
the prompt fields keep what the user typed and the saved infotext carries the styled prompt, as in
A1111. Each account sees the shared styles and its own (`app.styles.StyleBook`): an admin's save
goes to the shared `styles.csv`, anyone else's to a file of their own, so nobody overwrites another
account's style. The list is read from the files on page load, every refresh and after every save: a
style the user added by hand, or from another tab, shows up without a restart.
"""

from __future__ import annotations

import gradio as gr

from app.styles import PromptStyle
from app.ui.common import UiContext, user_errors


def style_names(ctx: UiContext, request: gr.Request | None) -> list[str]:
    with user_errors("Reading the styles", ctx.settings.data_dir):
        return list(ctx.styles_for(ctx.account(request)).read())


def refresh_styles(ctx: UiContext, picked: gr.Dropdown) -> dict:
    """Event arguments that list the styles the page's account sees, keeping the picks that still exist."""
    def ui_refresh(chosen: list[str], request: gr.Request):
        names = style_names(ctx, request)
        return gr.Dropdown(choices=names, value=[c for c in chosen or [] if c in names])

    return dict(fn=ui_refresh, inputs=picked, outputs=picked, api_visibility="private")


def build_styles_row(ctx: UiContext, prompt: gr.Textbox, negative: gr.Textbox) -> gr.Dropdown:
    """Lay out the row (picker, refresh, name, save) and wire it; returns the picker (a generation input)."""
    with gr.Row(equal_height=True):
        picked = gr.Dropdown([], value=[], multiselect=True, label="Styles", scale=4, elem_id="sd-styles",
                             info=f"the shared {ctx.settings.styles_file.name} and your own; "
                                  "{prompt} in a style marks where your prompt goes")
        refresh = gr.Button("↻", scale=0, min_width=44, elem_id="sd-styles-refresh")
        name = gr.Textbox(label="Style name", scale=2, elem_id="sd-style-name", placeholder="name to save as")
        save = gr.Button("💾 Save as style", scale=1, elem_id="sd-style-save")

    def ui_save(style_name: str, prompt_text: str, negative_text: str, chosen: list[str], request: gr.Request):
        book = ctx.styles_for(ctx.account(request))
        with user_errors("Saving the style", ctx.settings.data_dir):
            saved = book.save(PromptStyle(style_name or "", prompt_text or "", negative_text or ""))
        where = ctx.settings.styles_file.name if book.own is None else "your own styles"
        gr.Info(f"Style {style_name.strip()!r} saved to {where}.")
        return gr.Dropdown(choices=list(saved), value=[c for c in chosen or [] if c in saved])

    save.click(ui_save, [name, prompt, negative, picked], picked, api_visibility="private")
    refresh.click(**refresh_styles(ctx, picked))
    return picked
