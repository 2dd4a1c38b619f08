"""The History tab: the images of this session, or every image in the outputs folder, newest first.

Images are listed from the outputs folder itself (the one folder Gradio may serve), so the list
holds API and other-tab generations too and survives a page reload; "this session" means written
since the app started. Selecting an image shows its infotext, which can be sent to Generate, or
sent with the image itself to img2img.
"""

from __future__ import annotations

import html
from pathlib import Path

import gradio as gr

from app.infotext import read_parameters
from app.ui.common import UiContext
from app.ui.send_to import Senders, add_send_buttons

SCOPES = ("this session", "all outputs")
LIMIT = 200  # newest images shown; the count says how many exist


def list_outputs(outputs_dir: Path, since: float | None) -> list[Path]:
    """PNGs under `outputs_dir` modified at or after `since` (all when None), newest first."""
    if not outputs_dir.is_dir():
        return []
    found = [(p.stat().st_mtime, p) for p in outputs_dir.rglob("*.png") if p.is_file()]
    return [p for mtime, p in sorted(found, key=lambda item: item[0], reverse=True) if since is None or mtime >= since]


def build_history_tab(ctx: UiContext, sends: Senders) -> dict:
    """Lay out and wire the tab; returns the event arguments that refresh it (run when the tab is selected)."""
    with gr.Row(equal_height=True):
        scope = gr.Radio(list(SCOPES), value=SCOPES[0], show_label=False, scale=3, elem_id="sd-history-scope")
        refresh = gr.Button("↻ refresh", scale=0, min_width=100, elem_id="sd-history-refresh")
    count = gr.Markdown(elem_id="sd-history-count")
    gallery = gr.Gallery(show_label=False, columns=6, height=420, object_fit="contain", elem_id="sd-history-gallery",
                         buttons=["download", "fullscreen"])
    paths, selected = gr.State([]), gr.State(None)  # the listed files, the selected one
    with gr.Row():
        text = gr.Textbox(label="Infotext of the selected image", lines=5, buttons=["copy"], scale=4,
                          elem_id="sd-history-infotext")
        with gr.Column(scale=1, min_width=160):
            add_send_buttons(ctx, sends, text, selected, count, "sd-history-send")

    def fill(chosen: str, open_path: str | None):
        """The list for `chosen`. An image open in the gallery stays open, with its infotext, where the
        new list holds it (switching the source must not lose it); otherwise nothing is selected."""
        found = list_outputs(ctx.settings.outputs_dir, ctx.started if chosen == SCOPES[0] else None)
        shown = [str(p) for p in found[:LIMIT]]
        where = html.escape(str(ctx.settings.outputs_dir))
        cut = f", showing the newest {LIMIT}" if len(found) > LIMIT else ""
        note = f"{len(found)} image(s) {'since the app started' if chosen == SCOPES[0] else 'in'} `{where}`{cut}"
        items = [(p, Path(p).parent.name + "/" + Path(p).name) for p in shown]
        if open_path in shown:
            return gr.Gallery(items, selected_index=shown.index(open_path)), shown, note, gr.skip(), open_path
        return gr.Gallery(items, selected_index=None), shown, note, gr.Textbox(value="", placeholder=""), None

    def pick(shown: list[str], evt: gr.SelectData):
        """(infotext, path): a missing infotext is said in the placeholder, never as text a send would read."""
        if evt.index is None or evt.index >= len(shown):
            return "", None
        try:
            found, why = read_parameters(Path(shown[evt.index])), "(this PNG carries no infotext)"
        except (OSError, ValueError) as exc:  # deleted since the list was drawn (a send says so in a toast)
            found, why = "", f"(cannot read it: {exc})"
        return gr.Textbox(value=found or "", placeholder=why), shown[evt.index]

    refresh_args = dict(fn=fill, inputs=[scope, selected], outputs=[gallery, paths, count, text, selected],
                        api_visibility="private", show_progress="hidden")
    scope.input(**refresh_args)
    refresh.click(**refresh_args)
    gallery.select(pick, paths, [text, selected], api_visibility="private")
    return refresh_args
