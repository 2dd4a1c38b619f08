"""Running a generation from the page: busy state, live previews, Interrupt and Skip, cancel on leave.

The Generate handler is a generator. While the engine works it yields every `POLL_S`: the newest
live preview of the latents (`Snapshot.progress.preview`, scaled up to the image size) into the
gallery, and the step and the engine's queue on the Generate button. Yielding often is also what
makes a job stoppable from outside: Gradio closes a generator handler whose page went away (tab
closed, reload) or whose API client cancelled, and that close interrupts the job in the engine
(`Generation.follow`); `demo.unload` does the same when a page's heartbeat stops.

A job belongs to Gradio's session hash (one per page load, one per `gradio_client.Client`):
Interrupt, Skip and a closed tab stop only what that session started, never another user's job.
The Interrupt button keeps the partial images (A1111's way) unless "drop partial result" is
ticked; a job whose page or client went away is dropped, since nobody is there to see it and a
half-denoised PNG would claim all its steps in History.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import gradio as gr
from PIL import Image

from app.engine.desired import Desired
from app.engine.generate import GeneratedImage, GenerateParams
from app.engine.snapshot import Snapshot
from app.engine.worker import Engine
from app.ui.common import (
    POLL_S,
    PROGRESS,
    EngineCall,
    UiContext,
    checked_checkpoint,
    gallery_items,
    generate_params,
    generation_lane,
    report_progress,
    user_errors,
)
from app.ui.lora_panel import LoraSlots, panel_unchanged, panel_view, selected_specs, sync_selection
from app.ui.sessions import checked

log = logging.getLogger(__name__)
GALLERY_LABEL = "Images"
STOP_QUEUE = "stop"  # Interrupt and Skip never wait behind the generation they stop


def owner_of(request: gr.Request | None) -> str:
    """The engine owner of a request: its Gradio session. A request without one gets an owner of its
    own, so stopping it can never reach another session's job."""
    return getattr(request, "session_hash", None) or f"anonymous-{uuid.uuid4().hex}"


class Generation:
    """`engine.generate` for one owner, with the state it carries, on a helper thread, followed snapshot by
    snapshot."""

    def __init__(self, engine: Engine, params: GenerateParams, owner: str, desired: Desired | None = None) -> None:
        self.engine, self.owner = engine, owner
        self._call = EngineCall(lambda: engine.generate(params, owner=owner, desired=desired))

    def follow(self, progress: gr.Progress | None, every: float = POLL_S) -> Iterator[Snapshot]:
        """A snapshot at once, then every `every` seconds until the engine returns. Closed before that
        (the page or the API client went away), it stops this owner's job. The first yield comes
        before any wait: Gradio can close a generator only once it has yielded, so a cancel that
        arrives during the first step must find one to close."""
        finished = False
        try:
            while True:
                snap = self.snapshot()
                report_progress(snap, progress)
                yield snap
                if self._call.wait(every):
                    break
            finished = True
        finally:
            if not finished:
                self._abandon()

    def snapshot(self) -> Snapshot:
        """The snapshot of the engine running this owner's job (with `--devices`, any of them), else the first's."""
        snaps = self.engine.snapshots()
        return next((s for s in snaps if s.generating and s.held_for == self.owner), snaps[0])

    def _abandon(self) -> None:
        """Drop this owner's job: off the engine's queue if it still waits, stopped if it runs."""
        if self.engine.cancel_queued(self.owner) or self.engine.interrupt(keep_partial=False, owner=self.owner):
            log.info("generation of session %s dropped: its page or client went away", self.owner)

    def images(self) -> list[GeneratedImage]:
        return self._call.result()


@dataclass
class RunControls:
    """Generate and the buttons that stop it."""

    go: gr.Button
    interrupt: gr.Button
    skip: gr.Button
    drop: gr.Checkbox

    @property
    def buttons(self) -> list:
        return [self.go, self.interrupt, self.skip]


def build_run_controls() -> RunControls:
    go = gr.Button("Generate", variant="primary", elem_id="sd-generate")
    with gr.Row(equal_height=True, elem_classes="sd-run-controls"):
        interrupt = gr.Button("■ Interrupt", size="sm", interactive=False, min_width=90, elem_id="sd-interrupt")
        skip = gr.Button("⇥ Skip", size="sm", interactive=False, min_width=70, elem_id="sd-skip")
        drop = gr.Checkbox(False, label="drop partial result", min_width=150, elem_id="sd-drop-partial")
    return RunControls(go, interrupt, skip, drop)


def _buttons(snap: Snapshot | None, owner: str | None = None) -> list:
    """Generate busy (its step and the engine's queue on it, or "Waiting…" while another session's job
    runs) with Interrupt and Skip live; or all idle."""
    if snap is None:
        return [gr.Button("Generate", interactive=True), gr.Button(interactive=False, variant="secondary"),
                gr.Button(interactive=False)]
    waiting = f" · {snap.queued} waiting in the engine" if snap.queued else ""
    if snap.generating and snap.held_for != owner:
        label = f"Waiting for the engine…{waiting}"
    else:
        step = f" {snap.progress.step}/{snap.progress.total}" if snap.progress and snap.progress.total else ""
        label = f"Generating…{step}{waiting}"
    return [gr.Button(label, interactive=False), gr.Button(interactive=True, variant="stop"),
            gr.Button(interactive=True)]


def _preview(snap: Snapshot, params: GenerateParams) -> gr.Gallery:
    """The latent preview, one picture per image of the batch, scaled to the image size and labelled as
    a preview (the gallery's label goes back to "Images" with the result)."""
    caption = f"preview · step {snap.progress.step}/{snap.progress.total}"
    items = [(picture.resize((params.width, params.height), Image.Resampling.BILINEAR), caption)
             for picture in snap.progress.preview]
    return gr.Gallery(items, label=f"Live preview (latents) · step {snap.progress.step}/{snap.progress.total}")


def _stop_note(images: list[GeneratedImage], params: GenerateParams) -> str:
    cut = [im for im in images if not im.complete]
    if not images:
        return "■ Interrupted: the partial result was dropped."
    if not cut:
        return ""
    steps = ", ".join(sorted({str(im.stopped_at) for im in cut}))
    return (f"■ {len(cut)} of {len(images)} image(s) stopped early, at step {steps} of {params.steps} "
            "(kept as they were).")


def _generate(ctx: UiContext, request: gr.Request, progress=PROGRESS, *args):
    """Check the settings, hand the engine the LoRA selection if it differs from its wanted list, then
    generate with this tab's whole state (its panel), streaming previews; the size fields then show the
    size used, with the notes."""
    settings, slot_names = args[:10], args[14]
    with user_errors("Generation"):
        params, notes = generate_params(ctx, *settings)
        desired = desired_from_panel(ctx, args[10:])
        sync_selection(ctx, desired.loras, progress)
    job, shown, keep = Generation(ctx.engine, params, owner_of(request), desired), None, gr.skip()
    # No progress bar while denoising: Gradio draws it over the gallery, which would hide the previews;
    # the step shows on the Generate button and in the status line instead.
    with contextlib.closing(job.follow(None)) as snapshots:
        for snap in snapshots:
            mine = snap.generating and snap.held_for == job.owner  # never another session's latents
            preview = snap.progress.preview if snap.progress and mine else None
            fresh = preview is not None and preview is not shown
            shown = preview if fresh else shown
            yield [_preview(snap, params) if fresh else keep, *[keep] * 6, *_buttons(snap, job.owner),
                   *panel_unchanged()]
    try:
        with user_errors("Generation"):
            images = job.images()
    except gr.Error:
        yield [gr.Gallery([], label=GALLERY_LABEL), *[keep] * 6, *_buttons(None), *panel_view(ctx, list(slot_names))]
        raise
    infos = [{"seed": im.seed, "infotext": im.infotext} for im in images]
    note = "\n\n".join(filter(None, [*(f"ℹ️ {n}" for n in notes), _stop_note(images, params)]))
    first = infos[0] if infos else {"seed": None, "infotext": ""}
    cut = sorted({im.stopped_at for im in images if not im.complete})
    label = GALLERY_LABEL + (f" — stopped early at step {', '.join(map(str, cut))} of {params.steps}" if cut else "")
    gallery = gr.Gallery(gallery_items(images), label=label)
    yield [gallery, first["infotext"], infos, first["seed"], params.width, params.height, note, *_buttons(None),
           *panel_view(ctx, list(slot_names))]


def panel_desired(ctx: UiContext, model, dtype, offload, weights, specs) -> Desired:
    """The tab's whole state from its panel (checkpoint, dtype, offload, weight storage, the LoRA cards);
    a field the page has no value for yet follows what the engine holds."""
    held = ctx.engine.snapshot().desired
    return checked(held.replace(model=checked_checkpoint(ctx.settings, model) if model else held.model,
                                dtype=dtype or held.dtype, offload=offload or held.offload,
                                weights=weights or held.weights, loras=tuple(specs)))


def desired_from_panel(ctx: UiContext, values) -> Desired:
    """`panel_desired` from the values of `GenerateTab.state_inputs`: checkpoint, dtype, offload, weight
    storage, the LoRA slots' names and their sliders."""
    model, dtype, offload, weights, slot_names, *sliders = values
    return panel_desired(ctx, model, dtype, offload, weights, selected_specs(list(slot_names), tuple(sliders)))


def wire_generate(ctx: UiContext, controls: RunControls, settings: list, state: list, slots: LoraSlots,
                  results: list) -> None:
    """Generate (in the generation lane, with the tab's `state`: `GenerateTab.state_inputs`) and its
    Interrupt and Skip (in a lane of their own, so they run while it does). `results`: gallery, infotext,
    the images' infos, the chosen seed, width, height and the settings note."""
    engine = ctx.engine

    def ui_generate(request: gr.Request, progress=PROGRESS, *args):
        yield from _generate(ctx, request, progress, *args)

    def ui_interrupt(drop: bool, request: gr.Request) -> None:
        if not engine.interrupt(keep_partial=not drop, owner=owner_of(request)):
            gr.Info("Nothing of this page is running: nothing to interrupt.")

    def ui_skip(request: gr.Request) -> None:
        if not engine.skip(owner=owner_of(request)):
            gr.Info("Nothing of this page is running: nothing to skip.")

    controls.go.click(ui_generate, [*settings, *state],
                      [*results, *controls.buttons, *slots.view], api_visibility="private", **generation_lane(ctx),
                      show_progress_on=[results[0]])
    stop = dict(api_visibility="private", concurrency_id=STOP_QUEUE, concurrency_limit=None, show_progress="hidden")
    controls.interrupt.click(ui_interrupt, controls.drop, None, **stop)
    controls.skip.click(ui_skip, None, None, **stop)


def wire_cancel_on_leave(ctx: UiContext, demo: gr.Blocks) -> None:
    """A page that closes or reloads stops (and drops) what it was generating."""
    def leave(request: gr.Request) -> None:
        owner = owner_of(request)
        ctx.sessions.forget(owner)
        if ctx.engine.cancel_queued(owner) or ctx.engine.interrupt(keep_partial=False, owner=owner):
            log.info("generation of session %s dropped: its page closed", owner)

    demo.unload(leave)
