"""The Diagnostics tab: a live view of the engine built only from snapshots, plus the repair tools.

A `gr.Timer` refreshes it every `REFRESH_S` seconds, but only while the tab is visible: the
timer is started by this tab's `select` and stopped by the other tabs' (Gradio 6 timers keep
ticking on hidden tabs otherwise). Each tick also samples process memory, so the timeline
moves between transitions.
"""

from __future__ import annotations

import io
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from app import diagnostics
from app.accounts import require_admin
from app.report import REPORT_PNG, build_bug_report
from app.ui import views
from app.ui.common import PROGRESS, UiContext, run_with_progress, user_errors
from app.ui.model_options import engine_wide

REFRESH_S = 2.0


@dataclass
class DiagnosticsTab:
    """What `build_app` wires from outside the tab: the timer (tab selection starts/stops it), one refresh and
    the engine-wide controls (`admin_controls`)."""

    timer: gr.Timer
    refresh_outputs: list
    refresh_inputs: list
    switches: list[gr.Checkbox]
    unload: gr.Button


def refresh(ctx: UiContext, engine: int | None, component: str, text: str, only_violations: bool,
            only_patched: bool) -> list:
    """Everything the tab shows, from one snapshot of the chosen `engine` (its index with `--devices`; each
    engine has its own plan, verify and history), so the tables agree with each other."""
    ctx.engine.timeline.sample()
    snaps = ctx.engine.snapshots()
    snap = snaps[engine if engine is not None and 0 <= engine < len(snaps) else 0]
    rows, matching = views.module_rows(snap, component, text, only_violations, only_patched)
    gpu, gpu_note = views.gpu_rows(diagnostics.gpu_stats())
    memory = diagnostics.process_memory()
    mem_text = " · ".join(f"{k.replace('_mib', '')} {v:,.0f} MiB" for k, v in memory.items())
    components = ["all", *dict.fromkeys(r.component for r in snap.placement)]
    shown = f"showing {len(rows)} of {matching} matching modules ({len(snap.placement)} total)"
    storage = diagnostics.storage_summary(snap.weights, snap.stored_layers, snap.bytes_saved, snap.dtype,
                                          matmul_layers=snap.matmul_layers, matmul_unfit=snap.matmul_unfit,
                                          stored_as=snap.stored_as, resting_bytes=snap.resting_bytes)
    return [
        f"{views.status_html(snap)}<div class='sd-muted' id='sd-diag-updated'>updated {time.strftime('%H:%M:%S')}"
        f" · {mem_text}</div>",
        views.history_rows(snap),
        views.component_rows(snap),
        gr.Dropdown(choices=components),
        views.lora_rows(snap),
        rows,
        "  \n".join(filter(None, (shown, storage, f"LoRA backups: {snap.lora_backups}" if snap.model else ""))),
        gr.Dataframe(value=gpu, visible=bool(gpu)),
        gpu_note,
        views.timer_rows(snap),
        views.timeline_svg(ctx.engine.timeline.snapshot()),
        views.error_text(snap, ctx.shown_errors.records()),
    ]


def _table(headers: list[str], elem_id: str, label: str, max_height: int = 320,
           widths: list[str] | None = None) -> gr.Dataframe:
    return gr.Dataframe(headers=headers, column_count=len(headers), label=label, interactive=False, wrap=True,
                        max_height=max_height, elem_id=elem_id, column_widths=widths)


def _debug_toggles(ctx: UiContext) -> list[gr.Checkbox]:
    """The debug switches: engine-wide, so an admin's only (`admin_controls` greys them out for others)."""
    s = ctx.settings
    with gr.Row():
        lora = gr.Checkbox(s.lora_debug, label="LoRA debug (log key matching)", elem_id="sd-lora-debug")
        move = gr.Checkbox(s.move_debug, label="Move debug (log every tensor move)", elem_id="sd-move-debug")
        strict = gr.Checkbox(s.strict, label="Strict mode (a placement violation fails the transition)",
                             elem_id="sd-strict")
        forwards = gr.Checkbox(s.strict_forwards, elem_id="sd-strict-forwards",
                               label="Strict forwards (each layer checks its weights' device and dtype as it runs)")

    def toggle(request: gr.Request, lora_on, move_on, strict_on, forwards_on):
        with user_errors("Changing the debug switches", ctx.settings.data_dir):
            require_admin(ctx.account(request), "Changing the debug switches")
        changed = ctx.engine.set_debug(lora_debug=lora_on, move_debug=move_on, strict=strict_on,
                                       strict_forwards=forwards_on)
        gr.Info(f"debug: LoRA {changed.lora_debug}, move {changed.move_debug}, strict {changed.strict}, "
                f"strict forwards {changed.strict_forwards}")

    for box in (lora, move, strict, forwards):
        box.input(toggle, [lora, move, strict, forwards], None, api_visibility="private")
    return [lora, move, strict, forwards]


def _actions(ctx: UiContext) -> gr.Button:
    with gr.Row():
        unload = gr.Button("Unload model / free memory", variant="stop", elem_id="sd-unload")
        report = gr.Button("Export bug report", variant="secondary", elem_id="sd-bug-report")
    unload_note = gr.Markdown()
    with gr.Row():
        bundle = gr.File(label="Bug report (zip)", elem_id="sd-bug-zip", scale=1)
        card = gr.Image(label="Bug report card (paste into the issue)", type="filepath", format="png",
                        elem_id="sd-bug-card", scale=3, height=520, buttons=["download", "fullscreen"])

    def free_memory(request: gr.Request, progress=PROGRESS):
        before = diagnostics.process_memory()
        with user_errors("Unload", ctx.settings.data_dir):
            require_admin(ctx.account(request), "Unload")
            run_with_progress(ctx.engine, ctx.engine.unload, progress)
        after = diagnostics.process_memory()
        return "Freed: " + ", ".join(f"{k.replace('_mib', '')} {before[k]:,.0f} → {after.get(k, 0):,.0f} MiB"
                                     for k in before)

    unload.click(free_memory, None, unload_note, api_visibility="private", concurrency_id="loras")
    report.click(lambda: export_bug_report(ctx), None, [bundle, card], api_name="bug_report",
                 api_description="Bug-report bundle: a zip (report.json + card.png) and the card PNG alone.")
    return unload


def admin_controls(ctx: UiContext, tab: DiagnosticsTab, demo: gr.Blocks) -> None:
    """On page load the debug switches and Unload are usable by an admin only; others see them greyed out."""
    def on_load(request: gr.Request) -> list:
        admin = ctx.account(request).admin
        return [*(gr.Checkbox(**engine_wide(admin)) for _ in tab.switches), gr.Button(interactive=admin)]

    demo.load(on_load, None, [*tab.switches, tab.unload], api_visibility="private", show_progress="hidden")


def export_bug_report(ctx: UiContext) -> tuple[str, str]:
    """Write the zip and its card into a fresh temp folder; Gradio serves both from its cache."""
    data = build_bug_report(ctx.engine, ctx.settings, ctx.log_lines(), ctx.secrets, ctx.shown_errors.records())
    folder = Path(tempfile.mkdtemp(prefix="sd-bug-report-"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    zip_path = folder / f"steady-diffusion-bug-report-{stamp}.zip"
    zip_path.write_bytes(data)
    card_path = folder / f"bug-report-card-{stamp}.png"
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        card_path.write_bytes(bundle.read(REPORT_PNG))
    return str(zip_path), str(card_path)


def build_diagnostics_tab(ctx: UiContext) -> DiagnosticsTab:
    """Lay out the tab; every display is an output of one `refresh` so a tick is a single snapshot."""
    switches = _debug_toggles(ctx)
    snaps = ctx.engine.snapshots()
    which = gr.Dropdown([(f"engine {i} · {snap.device}", i) for i, snap in enumerate(snaps)], value=0,
                        label="Engine", visible=len(snaps) > 1, elem_id="sd-diag-engine")
    state = gr.HTML(elem_id="sd-diag-state")
    history = _table(views.HISTORY_HEADERS, "sd-history", "Engine history (newest first)", 260,
                     ["9%", "11%", "31%", "11%", "9%", "17%", "12%"])
    summary = _table(views.SUMMARY_HEADERS, "sd-components", "Components", 200)
    loras = _table(views.LORA_HEADERS, "sd-lora-counters", "LoRAs: the engine's status and counters", 260,
                   ["13%", "8%", "10%", "8%", "9%", "7%", "8%", "37%"])
    timers = _table(views.TIMER_HEADERS, "sd-timers", "Timers", 220)
    with gr.Row():
        component = gr.Dropdown(["all"], value="all", label="Component", scale=1)
        text = gr.Textbox(label="Module or class contains", scale=2)
        only_bad = gr.Checkbox(False, label="only violations", scale=1)
        only_patched = gr.Checkbox(False, label="only LoRA-patched", scale=1)
    modules_note = gr.Markdown(elem_id="sd-modules-note")
    modules = _table(views.MODULE_HEADERS, "sd-modules", "Modules (every parameter and buffer checked; hooks in "
                     "the order they run)", 420,
                     ["8%", "24%", "10%", "6%", "8%", "6%", "6%", "5%", "8%", "9%", "5%", "5%"])
    gpu_note = gr.Markdown()
    gpu = _table(views.GPU_HEADERS, "sd-gpu", "GPU (NVML)", 160)
    timeline = gr.HTML(label="Memory timeline")
    unload = _actions(ctx)
    error = gr.Code(label="Last error (with traceback)", language=None, lines=8, elem_id="sd-last-error")
    outputs = [state, history, summary, component, loras, modules, modules_note, gpu, gpu_note, timers, timeline,
               error]
    inputs = [which, component, text, only_bad, only_patched]
    timer = gr.Timer(REFRESH_S, active=False)
    tick = dict(fn=lambda *a: refresh(ctx, *a), inputs=inputs, outputs=outputs, api_visibility="private",
                show_progress="hidden")
    timer.tick(**tick)
    for control in (which, component, only_bad, only_patched):
        control.input(**tick)
    text.submit(**tick)
    return DiagnosticsTab(timer, outputs, inputs, switches, unload)
