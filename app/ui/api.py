"""The scripting API: stable endpoint names with plain JSON-able arguments, for `gradio_client`.

    from gradio_client import Client
    c = Client("http://127.0.0.1:7860/", auth=("user", "pass"))
    c.predict([{"name": "style", "weight": 0.8}, {"name": "detail", "weight": 1.5, "te_weight": 0.5}],
              api_name="/set_loras")
    images, infotext, details = c.predict("a fox", "", "Euler a", 20, 7.0, 42, 512, 512, 1, api_name="/generate")
    job = c.submit("a fox", "", "Euler a", 150, 7.0, 42, 1024, 1024, 1, 4, api_name="/generate")
    c.predict(True, False, api_name="/interrupt")  # stops it between two steps; job.result() has the partial image

Endpoints: generate, interrupt, skip, img2img, inpaint, txt2img_hires (app/ui/workflow_api.py), set_loras,
set_lora_partial, set_offload, set_dtype, load_model, unload, set_debug,
list_models, list_loras, inspect_lora, snapshot, bug_report (the last one is the Diagnostics tab's button).
These are independent of the UI layout (which can change freely) and never take `gr.State`,
which `gradio_client` cannot send. Every name is validated against its folder; every failure
comes back as an error message, never as a half-applied state.

A generation belongs to the client that asked for it (its Gradio session): `/interrupt` and
`/skip` stop that client's job unless `any_owner` is set (an admin's only), and a client that
cancels its job (`job.cancel()`) or disconnects stops it in the engine too, dropping what it reached.

Each client has its own state (`app/ui/sessions.py`): what its `/set_loras` and `/load_model` chose
is applied at once and remembered for it, and its `/generate`, `/img2img`, `/inpaint` and
`/txt2img_hires` carry that whole state, so another client's choices never reach its images. What
it never chose is the app's default: no LoRA, the default checkpoint.

Engine-wide switches are for an admin login (`app/accounts.py`) and refused to others with a message
naming that: `/unload`, `/set_debug`, `/set_dtype`, `/set_offload`, `/set_weights`, `/set_model_parts`,
`/set_lora_partial` (remembered for everyone), and `any_owner` on `/interrupt` and `/skip`.
"""

from __future__ import annotations

import contextlib

import gradio as gr

from app.accounts import require_admin
from app.engine.generate import SCHEDULERS, GenerateParams
from app.report import jsonable
from app.shown_paths import without_folders
from app.ui.common import (
    PROGRESS,
    UiContext,
    checked_checkpoint,
    checkpoint_names,
    gallery_items,
    generate_params,
    generation_lane,
    run_with_progress,
    snapshot_summary,
    specs_from_json,
    user_errors,
)
from app.ui.generate_run import STOP_QUEUE, Generation, owner_of
from app.ui.workflow_api import register_workflow_api

API_POLL_S = 0.5  # how often a running /generate looks for a cancelled client


def _change(ctx: UiContext, action: str, call, request: gr.Request | None = None, admin: bool = False,
            **chosen) -> dict:
    """Run one engine change for a script: the error text goes back unescaped (no browser shows it). An
    `admin` change (engine-wide: every user draws with it) is refused to other accounts before anything
    runs. Once it succeeded, `chosen` is remembered as that client's state."""
    with user_errors(action, ctx.settings.data_dir, browser=False):
        if admin:
            require_admin(ctx.account(request), action)
        run_with_progress(ctx.engine, call, None)
    if chosen:
        ctx.sessions.record(owner_of(request), **chosen)
    return snapshot_summary(ctx)


def _state_endpoints(ctx: UiContext) -> None:
    engine = ctx.engine

    @gr.api(api_name="set_loras", concurrency_id="loras")
    def set_loras(loras: list[dict], set_aside_unfit: bool = False, request: gr.Request = None) -> dict:
        """Apply exactly this list: [{"name", "weight", "unet_weight"?, "te_weight"?}]; [] removes all. A LoRA
        that does not fit the loaded model refuses the whole list, or with `set_aside_unfit` (the page's
        way) is set aside with its reason in `lora_states` while the others apply."""
        with user_errors("set_loras", ctx.settings.data_dir, browser=False):
            specs = specs_from_json(loras)
        return _change(ctx, "set_loras", lambda: engine.set_loras(specs, set_aside_unfit=bool(set_aside_unfit)),
                       request, loras=specs)

    @gr.api(api_name="set_lora_partial", concurrency_id="loras")
    def set_lora_partial(name: str, allowed: bool, request: gr.Request = None) -> dict:
        """Admin only: allow (true) or no longer allow (false) the LoRA `name` to apply when less than half of
        its tensors match the loaded model; remembered per LoRA for everyone. The wanted list is applied again."""
        return _change(ctx, "set_lora_partial", lambda: engine.set_lora_partial(name, bool(allowed)), request,
                       admin=True)

    @gr.api(api_name="set_offload", concurrency_id="loras")
    def set_offload(mode: str, request: gr.Request = None) -> dict:
        """Admin only (engine-wide): offload mode none, model, sequential, balanced or group."""
        return _change(ctx, "set_offload", lambda: engine.set_offload(mode), request, admin=True)

    @gr.api(api_name="set_dtype", concurrency_id="loras")
    def set_dtype(dtype: str, request: gr.Request = None) -> dict:
        """Admin only (engine-wide): weights dtype auto, fp16, bf16 or fp32 (reloads the checkpoint)."""
        return _change(ctx, "set_dtype", lambda: engine.set_dtype(dtype), request, admin=True)

    @gr.api(api_name="set_weights", concurrency_id="loras")
    def set_weights(weights: str, request: gr.Request = None) -> dict:
        """Admin only (engine-wide): weight storage full, fp8 (large weights rest in 8 bits), fp8-compute (and
        Linear layers run as fp8 matmuls, CUDA sm89+ or CPU) or int8 (int8 rows, a scale each); reloads."""
        return _change(ctx, "set_weights", lambda: engine.set_weights(weights), request, admin=True)

    @gr.api(api_name="set_model_parts", concurrency_id="loras")
    def set_model_parts(parts: dict, request: gr.Request = None) -> dict:
        """Admin only (remembered per checkpoint for everyone): separate files for the loaded checkpoint's parts
        (Flux): {"text_encoder_2": "t5xxl_fp16.safetensors", "vae": null, …}, names in models/text_encoder and
        models/VAE; null forgets a choice. Reloads."""
        if not isinstance(parts, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str))
                                                  for k, v in parts.items()):
            raise gr.Error("parts must map component names to file names (or null)")
        return _change(ctx, "set_model_parts", lambda: engine.set_model_parts(parts), request, admin=True)

    @gr.api(api_name="load_model", concurrency_id="loras")
    def load_model(name: str, request: gr.Request = None) -> dict:
        """Load a checkpoint by the name `list_models` returns and keep it for this client's generations (an
        admin's choice is also the default of every session that chose none)."""
        answer = _change(ctx, "load_model", lambda: engine.load_model(checked_checkpoint(ctx.settings, name)),
                         request, model=name)
        if ctx.account(request).admin:
            ctx.sessions.set_default_model(name)
        return answer

    @gr.api(api_name="unload", concurrency_id="loras")
    def unload(request: gr.Request = None) -> dict:
        """Admin only: drop the model and return its RAM/VRAM (every user's next job loads it again)."""
        return _change(ctx, "unload", engine.unload, request, admin=True)


def _debug_endpoint(ctx: UiContext) -> None:
    @gr.api(api_name="set_debug")
    def set_debug(lora_debug: bool, move_debug: bool, strict: bool, request: gr.Request = None) -> dict:
        """Admin only: LoRA debug, move debug and strict mode; they take effect at once (no tensor is touched)."""
        with user_errors("set_debug", ctx.settings.data_dir, browser=False):
            require_admin(ctx.account(request), "set_debug")
        changed = ctx.engine.set_debug(lora_debug=lora_debug, move_debug=move_debug, strict=strict)
        return {"lora_debug": changed.lora_debug, "move_debug": changed.move_debug, "strict": changed.strict}


def _read_endpoints(ctx: UiContext) -> None:
    @gr.api(api_name="snapshot")
    def snapshot() -> dict:
        """The full engine snapshot: state, placement rows, violations, LoRAs, counters, timers, history
        (files named relative to the data folder, tracebacks without install or home folders)."""
        return without_folders(jsonable(ctx.engine.snapshot()), ctx.settings.data_dir)

    @gr.api(api_name="list_models")
    def list_models() -> list[str]:
        """Checkpoint names under models/Stable-diffusion."""
        return checkpoint_names(ctx.settings)

    @gr.api(api_name="list_loras")
    def list_loras() -> list[str]:
        """LoRA names under models/Lora (without .safetensors)."""
        return ctx.engine.library.names()

    @gr.api(api_name="inspect_lora")
    def inspect_lora(name: str) -> dict:
        """Card metadata and the fit check of one LoRA against the loaded model."""
        with user_errors("inspect_lora", ctx.settings.data_dir, browser=False):
            path = ctx.engine.library.path_for(name)
            card = ctx.cards.card(name, path)
            fit = ctx.cards.fit(ctx.engine, name, path, ctx.engine.snapshot().model_key)
        return without_folders(jsonable({"card": card, "fit": fit}), ctx.settings.data_dir)


def _stop_endpoints(ctx: UiContext) -> None:
    """Interrupt and Skip run in a lane of their own, so they never wait behind the job they stop."""
    engine = ctx.engine
    lane = dict(concurrency_id=STOP_QUEUE, concurrency_limit=None)

    def whose(any_owner: bool, request: gr.Request | None, action: str) -> str | None:
        """This client's jobs, or with `any_owner` (an admin's only) whoever's runs."""
        if not any_owner:
            return owner_of(request)
        with user_errors(action, ctx.settings.data_dir, browser=False):
            require_admin(ctx.account(request), f"{action} with any_owner")
        return None

    @gr.api(api_name="interrupt", **lane)
    def interrupt(keep_partial: bool = True, any_owner: bool = False, request: gr.Request = None) -> dict:
        """Stop this client's running generation between two steps (`any_owner`, admin only: whoever started
        it); the images reached so far are returned to its /generate and saved unless `keep_partial` is false."""
        stopped = engine.interrupt(keep_partial=keep_partial, owner=whose(any_owner, request, "interrupt"))
        return {"stopped": stopped, "state": engine.snapshot().state}

    @gr.api(api_name="skip", **lane)
    def skip(any_owner: bool = False, request: gr.Request = None) -> dict:
        """End the current run of this client's batch count (`any_owner`, admin only: whoever started it)."""
        stopped = engine.skip(owner=whose(any_owner, request, "skip"))
        return {"stopped": stopped, "state": engine.snapshot().state}


def _generate_endpoint(ctx: UiContext) -> None:
    """Generate needs file outputs, so it is an event on hidden components rather than `gr.api`.

    Numbers are taken as sent (no `precision` rounding) so the shared rules can refuse 1.5 as a
    seed instead of Gradio quietly making it 2. The handler is a generator that yields nothing new
    (`gr.skip()`) every `API_POLL_S` until the images are ready: Gradio closes a generator whose
    client cancelled or went away, and that close stops the job in the engine."""
    defaults = GenerateParams("")
    with gr.Column(visible=False):
        inputs = [gr.Textbox(label="prompt"), gr.Textbox("", label="negative_prompt"),
                  gr.Dropdown(list(SCHEDULERS), value=defaults.sampler, label="sampler"),
                  *(gr.Number(getattr(defaults, name), label=name)
                    for name in ("steps", "cfg", "seed", "width", "height", "batch", "n_iter", "clip_skip"))]
        outputs = [gr.Gallery(label="images", format="png"), gr.Textbox(label="infotext"), gr.JSON(label="details")]
        trigger = gr.Button("generate")

    def generate(prompt, negative_prompt, sampler, steps, cfg, seed, width, height, batch, n_iter, clip_skip,
                 request: gr.Request, progress=PROGRESS):
        with user_errors("generate", ctx.settings.data_dir, browser=False):
            params, notes = generate_params(ctx, prompt, negative_prompt, sampler, steps, cfg, seed, width, height,
                                            batch, n_iter, clip_skip, book=ctx.styles_for(ctx.account(request)))
        owner = owner_of(request)
        desired = ctx.desired_for(owner)
        job = Generation(ctx.engine, lambda owner: ctx.engine.generate(params, owner=owner, desired=desired), owner)
        with contextlib.closing(job.follow(progress, API_POLL_S)) as snapshots:
            for _snap in snapshots:
                yield gr.skip(), gr.skip(), gr.skip()
        with user_errors("generate", ctx.settings.data_dir, browser=False):
            images = job.images()
        details = [{"seed": im.seed, "infotext": im.infotext, "file": im.path.name if im.path else None,
                    "complete": im.complete, "stopped_at": im.stopped_at, "notes": list(notes)} for im in images]
        yield gallery_items(images), images[0].infotext if images else "", details

    trigger.click(generate, inputs, outputs, api_name="generate", **generation_lane(),
                  api_description="Generate with this client's state (what its set_loras and load_model "
                                  "chose, else no LoRA and the default checkpoint) plus any <lora:name:w> prompt tags; "
                                  "n_iter runs (A1111's batch count) of `batch` images each; A1111's emphasis "
                                  "syntax and BREAK; clip_skip 1-12. Returns (images, "
                                  "infotext of the first image, [{seed, infotext, file, complete, stopped_at, "
                                  "notes}]); notes say what was rounded (sizes go down to the model's multiple of "
                                  "8) or cut (a prompt longer than a T5 encoder reads); an interrupted image has "
                                  "complete false and the step it stopped at.")


def register_api(ctx: UiContext) -> None:
    """Add every named endpoint to the Blocks being built."""
    _state_endpoints(ctx)
    _debug_endpoint(ctx)
    _read_endpoints(ctx)
    _stop_endpoints(ctx)
    _generate_endpoint(ctx)
    register_workflow_api(ctx)
