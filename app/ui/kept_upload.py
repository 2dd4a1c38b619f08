"""An image field that keeps its picture when an upload into it is refused.

The upload route refuses a file that is not an image the app takes (`guard.refused_upload`: the reason
is the page's toast). Gradio's image field has by then let its picture go, so a refused upload threw
away the good image already there, and the next run had no init image. Here the field remembers the
last picture it held (uploaded, or put in by a send) and takes it back when it empties without the
user's clear (the × button).

The × sends two events, the clear and the change it causes, as two requests: one lane runs them one at a time,
but in the order they reach the server, which under load is either. So the clear empties the field itself: a
change that ran first and put the picture back is undone, and one that runs after it finds nothing held.
"""

from __future__ import annotations

import gradio as gr

REFUSED = "⚠ The upload was refused (its reason is the message above): the picture before it is kept."
LANE = "kept-upload"  # one lane: a clear and the change it causes never run at once


def keep_on_refusal(image: gr.Image, note: gr.Markdown | gr.Textbox) -> None:
    """Wire `image` so an upload the server refuses leaves its previous picture, with `note` saying why."""
    kept = gr.State((None, False))  # (the last picture, None after the user's clear; whether it was just put back)
    private = dict(api_visibility="private", show_progress="hidden", concurrency_id=LANE)

    def changed(picture, last, said):
        held, put_back = last
        if picture is not None:  # a new picture ends a refusal's note; the one put back keeps it
            return gr.skip(), (picture, False), "" if said == REFUSED and not put_back else gr.skip()
        if held is None:  # cleared by the user, or never held one
            return gr.skip(), (None, False), gr.skip()
        return held, (held, True), REFUSED

    image.clear(lambda: (None, (None, False)), None, [image, kept], **private)
    image.change(changed, [image, kept, note], [image, kept, note], **private)
