"""Running a generation from the page: busy state, live previews, Interrupt and Skip, cancel on leave.

The Generate handler (and the img2img tab's, through `stream_job`) is a generator. While the
engine works it yields every `POLL_S`: the newest live preview of the latents
(`Snapshot.progress.preview`, scaled up to the image size) into the gallery, and the step and the
engine's queue on the run button. Yielding often is also what
makes a job stoppable from outside: Gradio closes a generator handler whose page went away (tab
closed, reload) or whose API client cancelled, and that close interrupts the job in the engine
(`Generation.follow`); `demo.unload` does the same when a page's heartbeat stops.

A job belongs to Gradio's session hash (one per page load, one per `gradio_client.Client`):
Interrupt, Skip and a closed tab stop only what that session started, never another user's job.
It carries that session's whole state (the page's panel: checkpoint and LoRA cards, with the
engine-wide dtype, offload and weight storage; `panel_desired`), which the engine reconciles to before it runs; while
another session's job runs, the run button says it waits and no other session's preview shows.
Each tab has its own Interrupt and Skip, live while any job of the page runs (the status line's
timer keeps them so: an img2img started on its tab can be stopped from the Generate tab too).
The Interrupt button keeps the partial images (A1111's way) unless "drop partial result" is
ticked; a job whose page or client went away is dropped, since nobody is there to see it and a
half-denoised PNG would claim all its steps in History.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr
from PIL import Image

from app.controlnet.units import with_units
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
from app.ui.controlnet_panel import units_from_form
from app.ui.detailer_panel import details_from_form, mask_previews, notes_of
from app.ui.hires_fields import hires_from_form
from app.ui.lora_panel import LoraSlots, panel_unchanged, panel_view, selected_specs, sync_selection

log = logging.getLogger(__name__)
GALLERY_LABEL = "Images"
FAILED_LABEL = "⚠ The last run failed (see its message): these images are from the run before"
STOP_QUEUE = "stop"  # Interrupt and Skip never wait behind the generation they stop


def owner_of(request: gr.Request | None) -> str:
    """The engine owner of a request: its Gradio session. A request without one gets an owner of its
    own, so stopping it can never reach another session's job."""
    return getattr(request, "session_hash", None) or f"anonymous-{uuid.uuid4().hex}"


class Generation:
    """An engine generation (`call(owner)`: txt2img, img2img, inpaint, hires fix, with the state it carries)
    for one owner on a helper thread, followed snapshot by snapshot."""

    def __init__(self, engine: Engine, call: Callable[[str], list[GeneratedImage]], owner: str) -> None:
        self.engine, self.owner = engine, owner
        self._start = lambda: EngineCall(lambda: call(owner))
        self._call: EngineCall | None = None

    def follow(self, progress: gr.Progress | None, every: float = POLL_S) -> Iterator[Snapshot]:
        """A snapshot at once, then every `every` seconds until the engine returns. Closed before that
        (the page or the API client went away), it stops this owner's job.

        The job is handed to the engine only when Gradio resumes the generator after its first yield:
        Gradio registers a generator (so that a client's cancel can close it) only once its first
        yield has been processed, and a job started earlier could run unclosable steps for nobody."""
        finished = False
        try:
            while True:
                snap = self.snapshot()
                report_progress(snap, progress)
                yield snap
                if self._call is None:
                    self._call = self._start()
                if self._call.wait(every):
                    break
            finished = True
        finally:
            if not finished:
                self._abandon()

    def snapshot(self) -> Snapshot:
        """The snapshot of the engine running this owner's job (with `--devices`, any of them), else the first's."""
        snaps = self.engine.snapshots()
        return next((s for s in snaps if self.runs_in(s)), snaps[0])

    def runs_in(self, snap: Snapshot) -> bool:
        """Whether `snap` shows this owner's job running (never another session's latents or step)."""
        return snap.generating and snap.held_for == self.owner

    def _abandon(self) -> None:
        """Drop this owner's job: off the engine's queue if it still waits, stopped if it runs."""
        if self.engine.cancel_queued(self.owner) or self.engine.interrupt(keep_partial=False, owner=self.owner):
            log.info("generation of session %s dropped: its page or client went away", self.owner)

    def images(self) -> list[GeneratedImage]:
        return self._call.result()


@dataclass
class StopControls:
    """Interrupt and Skip of one tab (each tab has them, as in A1111; any of them stops this page's job)."""

    interrupt: gr.Button
    skip: gr.Button
    drop: gr.Checkbox

    @property
    def buttons(self) -> list:
        return [self.interrupt, self.skip]


def build_stop_controls(prefix: str = "sd") -> StopControls:
    with gr.Row(equal_height=True, elem_classes="sd-run-controls"):
        interrupt = gr.Button("■ Interrupt", size="sm", interactive=False, min_width=90, elem_id=f"{prefix}-interrupt")
        skip = gr.Button("⇥ Skip", size="sm", interactive=False, min_width=70, elem_id=f"{prefix}-skip")
        drop = gr.Checkbox(False, label="drop partial result", min_width=150, elem_id=f"{prefix}-drop-partial")
    return StopControls(interrupt, skip, drop)


def stop_buttons(running: bool) -> list:
    """Interrupt and Skip live (while this page's job runs) or idle."""
    return [gr.Button(interactive=running, variant="stop" if running else "secondary"),
            gr.Button(interactive=running)]


def run_buttons(snap: Snapshot | None, label: str, mine: bool = True) -> list:
    """The run button busy (its step and the engine's queue on it) with Interrupt and Skip live; or
    "Waiting for the engine…" while another session's job runs (not `mine`: nothing of this page to
    stop yet); or all idle."""
    if snap is None:
        return [gr.Button(label, interactive=True), *stop_buttons(False)]
    waiting = f" · {snap.queued} waiting in the engine" if snap.queued else ""
    if snap.generating and not mine:
        return [gr.Button(f"Waiting for the engine…{waiting}", interactive=False), *stop_buttons(False)]
    step = f" {snap.progress.step}/{snap.progress.total}" if snap.progress and snap.progress.total else ""
    return [gr.Button(f"Generating…{step}{waiting}", interactive=False), *stop_buttons(True)]


def _preview(snap: Snapshot, size: tuple[int, int]) -> gr.Gallery:
    """The latent preview, one picture per image of the batch, scaled to the image size and labelled as
    a preview (the gallery's label goes back to "Images" with the result)."""
    caption = f"preview · step {snap.progress.preview_step}/{snap.progress.total}"
    items = [(picture.resize(size, Image.Resampling.BILINEAR), caption) for picture in snap.progress.preview]
    return gr.Gallery(items, label=f"Live preview (latents) · step {snap.progress.preview_step}/{snap.progress.total}")


def stream_job(job: Generation, size: tuple[int, int], action: str, frame: Callable[[Any, Snapshot | None], list],
               last: list) -> Generator[list, None, list[GeneratedImage]]:
    """Follow `job`, yielding `frame(gallery, snap)` (a fresh live preview of this job, never another
    session's, else `gr.skip()`) until it returns its images; `frame(…, None)` is the idle frame. A
    failure is one toast and leaves the gallery as it was: the `last` result comes back where a preview
    had replaced it. No progress bar while denoising: Gradio draws it over the gallery, which would hide
    the previews; the step shows on the run button and in the status line instead."""
    shown = None
    with contextlib.closing(job.follow(None)) as snapshots:
        for snap in snapshots:
            preview = snap.progress.preview if snap.progress and job.runs_in(snap) else None
            fresh = preview is not None and preview is not shown
            shown = preview if fresh else shown
            yield frame(_preview(snap, size) if fresh else gr.skip(), snap)
    try:
        with user_errors(action, job.engine.settings.data_dir):
            return job.images()
    except gr.Error:
        yield frame(failed_gallery(last), None)
        raise


def failed_gallery(last: list) -> gr.Gallery:
    """The gallery after a failed run: the `last` result, labelled as the run before's, so it is never
    taken for this run's answer (the failure itself is the toast)."""
    return gr.Gallery(last, label=FAILED_LABEL if last else GALLERY_LABEL)


def result_gallery(images: list[GeneratedImage], steps: int, extra: list | None = None) -> gr.Gallery:
    """The images, labelled with the step an Interrupt or Skip stopped them at; `extra` (captioned
    pictures: the Detailer's mask previews) after them."""
    cut = sorted({im.stopped_at for im in images if not im.complete})
    label = GALLERY_LABEL + (f" — stopped early at step {', '.join(map(str, cut))} of {steps}" if cut else "")
    return gr.Gallery([*gallery_items(images), *(extra or [])], label=label)


def _stop_note(images: list[GeneratedImage], params: GenerateParams) -> str:
    cut = [im for im in images if not im.complete]
    if not images:
        return "■ Interrupted: the partial result was dropped."
    if not cut:
        return ""
    steps = ", ".join(sorted({str(im.stopped_at) for im in cut}))
    return (f"■ {len(cut)} of {len(images)} image(s) stopped early, at step {steps} of {params.steps} "
            "(kept as they were).")


def _generate(ctx: UiContext, request: gr.Request, progress, settings: tuple, hires_values: tuple,
              detail_values: tuple, infos: list, state: tuple, controlnet: tuple = ()):
    """Check the settings, hand the engine the LoRA selection if it differs from its wanted list, then
    generate (with the hires fix and the Detailer when ticked) with this tab's whole state (`state`: the
    values of `GenerateTab.state_inputs`), streaming previews; the size fields then show the size used, with
    the notes (the Detailer's too). `infos`: the last result's (its gallery comes back after a failure)."""
    slot_names = state[1]
    last = [info["item"] for info in infos or [] if "item" in info]
    try:
        with user_errors("Generation", ctx.settings.data_dir):
            params, notes = generate_params(ctx, *settings, book=ctx.styles_for(ctx.account(request)))
            params = with_units(params, units_from_form(ctx.settings, controlnet, needs_image=True))
            hires = hires_from_form(*hires_values)
            details = details_from_form(ctx, *detail_values)
            desired = desired_from_panel(ctx, state)
            sync_selection(ctx, desired.loras, progress)
    except gr.Error:  # refused before it ran: the last result is not this run's either
        yield [failed_gallery(last), *[gr.skip()] * 6, *run_buttons(None, "Generate"), *panel_unchanged()]
        raise
    job = Generation(ctx.engine, lambda owner: ctx.engine.generate(params, owner=owner, hires=hires, desired=desired,
                                                                    details=details), owner_of(request))
    keep = [gr.skip()] * 6

    def frame(gallery, snap):
        view = panel_unchanged() if snap is not None else panel_view(ctx, list(slot_names))
        return [gallery, *keep, *run_buttons(snap, "Generate", snap is not None and job.runs_in(snap)), *view]

    images = yield from stream_job(job, (params.width, params.height), "Generation", frame, last)
    shown = gallery_items(images)
    infos = [{"seed": im.seed, "infotext": im.infotext, "item": item} for im, item in zip(images, shown, strict=True)]
    note = "\n\n".join(filter(None, [*(f"ℹ️ {n}" for n in (*notes, *notes_of(images))), _stop_note(images, params)]))
    first = infos[0] if infos else {"seed": None, "infotext": ""}
    masks = mask_previews(images) if detail_values[2] else []
    yield [result_gallery(images, params.steps, masks), first["infotext"], infos, first["seed"], params.width,
           params.height, note, *run_buttons(None, "Generate"), *panel_view(ctx, list(slot_names))]


def panel_desired(ctx: UiContext, model, specs) -> Desired:
    """The tab's whole state from its panel: the checkpoint (none picked yet: the app's default) and the LoRA
    cards; dtype, offload and weight storage are engine-wide, as the engine holds them."""
    held = ctx.engine.snapshot().desired
    chosen = checked_checkpoint(ctx.settings, model) if model else ctx.sessions.default_model(held)
    return held.replace(model=chosen, loras=tuple(specs))


def desired_from_panel(ctx: UiContext, values) -> Desired:
    """`panel_desired` from the values of `GenerateTab.state_inputs`: checkpoint, the LoRA slots' names and
    their sliders."""
    model, slot_names, *sliders = values
    return panel_desired(ctx, model, selected_specs(list(slot_names), tuple(sliders)))


def wire_stop(ctx: UiContext, stops: StopControls) -> None:
    """Interrupt and Skip (in a lane of their own, so they run while the job does): this page's job,
    whichever tab started it."""
    engine = ctx.engine

    def ui_interrupt(drop: bool, request: gr.Request) -> None:
        if not engine.interrupt(keep_partial=not drop, owner=owner_of(request)):
            gr.Info("Nothing of this page is running: nothing to interrupt.")

    def ui_skip(request: gr.Request) -> None:
        if not engine.skip(owner=owner_of(request)):
            gr.Info("Nothing of this page is running: nothing to skip.")

    stop = dict(api_visibility="private", concurrency_id=STOP_QUEUE, concurrency_limit=None, show_progress="hidden")
    stops.interrupt.click(ui_interrupt, stops.drop, None, **stop)
    stops.skip.click(ui_skip, None, None, **stop)


def wire_generate(ctx: UiContext, go: gr.Button, stops: StopControls, fields: tuple[list, list, list, list, list],
                  slots: LoraSlots, results: list) -> None:
    """Generate (in the generation lane) and its Interrupt and Skip. `fields`: the settings, the hires
    fix's fields, the Detailer's, the tab's state (`GenerateTab.state_inputs`) and the ControlNet units' fields;
    `results`: gallery, infotext, the images' infos, the chosen seed, width, height and the settings note."""
    settings, hires, detailer, state, controlnet = fields
    split = (len(settings), len(settings) + len(hires), len(settings) + len(hires) + len(detailer),
             len(settings) + len(hires) + len(detailer) + 1 + len(state))

    def ui_generate(request: gr.Request, progress=PROGRESS, *args):
        infos, *values = args[split[2]:split[3]]
        yield from _generate(ctx, request, progress, args[:split[0]], args[split[0]:split[1]],
                             args[split[1]:split[2]], infos, tuple(values), args[split[3]:])

    go.click(ui_generate, [*settings, *hires, *detailer, results[2], *state, *controlnet],
             [*results, go, *stops.buttons, *slots.view], api_visibility="private", **generation_lane(),
             show_progress_on=[results[0]])
    wire_stop(ctx, stops)


def wire_cancel_on_leave(ctx: UiContext, demo: gr.Blocks) -> None:
    """A page that closes or reloads stops (and drops) what it was generating."""
    def leave(request: gr.Request) -> None:
        owner = owner_of(request)
        ctx.sessions.forget(owner)
        if ctx.engine.cancel_queued(owner) or ctx.engine.interrupt(keep_partial=False, owner=owner):
            log.info("generation of session %s dropped: its page closed", owner)

    demo.unload(leave)
