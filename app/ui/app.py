"""`build_app`: the Blocks with the engine status line, the tabs and the named API.

The status line above the tabs is refreshed every second from `engine.snapshot()` (cheap: an
immutable object plus the live state), so whatever the engine is doing — loading, patching,
generating, stuck in ERROR — is visible while any handler waits on it.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from app.ui import views
from app.ui.api import register_api
from app.ui.common import UiContext
from app.ui.demo_banner import banner_update, build_demo_banner
from app.ui.diagnostics_tab import admin_controls, build_diagnostics_tab, refresh
from app.ui.extras_tab import build_extras_tab
from app.ui.generate_run import owner_of, stop_buttons, wire_cancel_on_leave
from app.ui.generate_tab import build_generate_tab, wire_page_load
from app.ui.history_tab import build_history_tab
from app.ui.img2img_tab import build_img2img_tab, family_fields
from app.ui.pnginfo_tab import build_pnginfo_tab
from app.ui.send_to import senders

CSS_PATH = Path(__file__).resolve().parents[2] / "assets" / "ui.css"
JS_PATH = CSS_PATH.with_name("ui.js")  # keyboard habits: Ctrl+Enter runs a prompt, Enter applies a LoRA weight
STATUS_REFRESH_S = 1.0


def theme() -> gr.themes.Base:
    """The default theme on system font stacks: no font file is fetched from anywhere."""
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "Segoe UI", "Roboto", "sans-serif"],
                             font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"])


def launch_kwargs() -> dict:
    """Look-and-feel arguments Gradio 6 takes at `launch()`, not in `Blocks()`."""
    return {"theme": theme(), "css_paths": [CSS_PATH] if CSS_PATH.is_file() else None,
            "js": JS_PATH.read_text(encoding="utf-8") if JS_PATH.is_file() else None}


def build_app(ctx: UiContext) -> gr.Blocks:
    """The whole app; theme and CSS are applied by `launch(**launch_kwargs())` (Gradio 6)."""
    with gr.Blocks(title="Steady Diffusion", analytics_enabled=False) as demo:
        register_api(ctx)  # first, so the documented endpoint names are never taken by a UI handler
        with gr.Row(elem_classes="sd-header"):
            gr.Markdown("## Steady Diffusion")
            status = gr.HTML(elem_id="sd-status-line")
        banner = build_demo_banner()
        with gr.Tabs() as tabs:
            with gr.Tab("Generate", id="generate") as generate_tab:
                tab = build_generate_tab(ctx)
            with gr.Tab("img2img", id="img2img") as img2img_tab:
                i2i = build_img2img_tab(ctx, tab.state_inputs)
                sends = senders(tab, i2i, tabs)
            with gr.Tab("Extras", id="extras") as extras_tab:
                extras = build_extras_tab(ctx)
            with gr.Tab("PNG Info", id="pnginfo") as pnginfo_tab:
                build_pnginfo_tab(ctx, sends)
            with gr.Tab("History", id="history") as history_tab:
                refresh_history = build_history_tab(ctx, sends)
            with gr.Tab("Diagnostics", id="diagnostics") as diagnostics_tab:
                diag = build_diagnostics_tab(ctx)
        ticker = gr.Timer(STATUS_REFRESH_S)
        stops = [*tab.stops.buttons, *i2i.stops.buttons]

        def tick(request: gr.Request) -> list:
            """Every engine's status line, and every tab's Interrupt and Skip live while this page's job runs."""
            running = ctx.engine.runs_for(owner_of(request))
            return [views.engines_html(ctx.engine.snapshots()), *stop_buttons(running) * 2]

        ticker.tick(tick, None, [status, *stops], api_visibility="private", show_progress="hidden")
        refresh_diagnostics = dict(fn=lambda *filters: refresh(ctx, *filters), inputs=diag.refresh_inputs,
                                   outputs=diag.refresh_outputs, api_visibility="private", show_progress="hidden")
        diagnostics_tab.select(lambda: gr.Timer(active=True), None, diag.timer, api_visibility="private")
        diagnostics_tab.select(**refresh_diagnostics)
        history_tab.select(**refresh_history)
        extras_tab.select(extras.refresh, None, extras.dropdowns, api_visibility="private", show_progress="hidden")
        # The img2img tab's sampler, steps, guidance and size: the loaded model's on page load, and again
        # when the tab opens after a switch (in this page, another tab or an API client).
        fill_img2img = dict(fn=lambda shown: family_fields(ctx, shown), inputs=i2i.shown,
                            outputs=[*i2i.family_components, i2i.shown], api_visibility="private",
                            show_progress="hidden")
        img2img_tab.select(**fill_img2img)
        img2img_tab.select(**i2i.show_references)
        demo.load(**fill_img2img)
        for other in (generate_tab, img2img_tab, extras_tab, pnginfo_tab, history_tab):
            other.select(lambda: gr.Timer(active=False), None, diag.timer, api_visibility="private")
        wire_page_load(ctx, tab, demo)
        admin_controls(ctx, diag, demo)
        wire_cancel_on_leave(ctx, demo)
        # the status line and the demo banner on page load (one event: a page's load events count against its
        # --session-queue-size), the banner again after every load of this page's (its model line changes)
        demo.load(lambda: [views.engines_html(ctx.engine.snapshots()), banner_update(ctx)], None, [status, banner],
                  api_visibility="private")
        tab.model_status.change(lambda: banner_update(ctx), None, banner, api_visibility="private",
                                show_progress="hidden")
        tab.model_status.change(**i2i.show_references)
    return demo
