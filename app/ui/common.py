"""What every tab and the API share: the context object, engine-call helpers, input validation.

Engine calls block until the worker has run them. Handlers run them in a helper thread
(`EngineCall`) and poll `engine.snapshot().progress` meanwhile, so a Gradio progress bar follows
the real phases (loading, placing, applying LoRAs, denoising steps) and the page stays responsive.
"""

from __future__ import annotations

import contextlib
import html
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

from app.accounts import Account, Accounts
from app.adapters.prompt import missing_lora_note, without_missing_loras
from app.adapters.specs import LoraSpec
from app.adapters.strength_schedule import parse_schedule
from app.diagnostics import SHOWN_ERRORS_LOGGER, ShownErrors
from app.engine import checkpoint_files
from app.engine.generate import GeneratedImage, GenerateParams, params_from_form
from app.engine.snapshot import Snapshot
from app.engine.worker import Engine
from app.paths import UnsafePathError, resolve_under
from app.safetensors_files import file_sha256
from app.settings import Settings
from app.shown_paths import without_folders
from app.styles import StyleBook, account_file
from app.ui.login_jobs import LoginJobs
from app.ui.lora_cards import CardCache
from app.ui.sessions import SessionStates

log = logging.getLogger(__name__)
shown_log = logging.getLogger(SHOWN_ERRORS_LOGGER)
POLL_S = 0.15
GENERATION_LANE = "generate"  # the Gradio lane of every generation
MAX_LORAS = 8  # slots on the Generate tab; the API takes any number
# Gradio finds a progress tracker by a parameter *default* that is a `gr.Progress`, and only among
# positional parameters; handlers with `*values` therefore put `progress=PROGRESS` first.
PROGRESS = gr.Progress()
NO_REFINER = "None"  # the refiner choice meaning none (A1111 spells it so too)


class FileHashes:
    """Short sha256 prefixes by file identity (path, mtime, size), so a checkpoint of several GB is
    hashed once per change of the file, not on every "send to Generate"."""

    def __init__(self) -> None:
        self._known: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def short(self, path: Path, length: int = 10) -> str:
        stat = path.stat()
        key = (str(path), stat.st_mtime_ns, stat.st_size)
        with self._lock:
            known = self._known.get(key)
        if known is None:
            known = file_sha256(path)
            with self._lock:
                self._known[key] = known
        return known[:length]


@dataclass
class UiContext:
    """The engine (or an `EnginePool`) plus what the UI keeps beside it: log capture for reports, secrets
    to redact, file caches, when the session started (the History tab's "this session"), start-up notes
    (why the first checkpoint was not the one loaded), each session's own desired state, the accounts
    (who is an admin; the default, no login, makes every request the local admin) and the logins
    sessions and jobs belong to (`login_jobs`)."""

    engine: Engine
    settings: Settings
    log_lines: Callable[[], list[str]] = list
    secrets: tuple[str, ...] = ()
    cards: CardCache = field(default_factory=CardCache)
    hashes: FileHashes = field(default_factory=FileHashes)
    started: float = field(default_factory=time.time)
    startup_notes: list[str] = field(default_factory=list)
    sessions: SessionStates | None = None  # None: the app's own, remembering its default in the data folder
    accounts: Accounts = field(default_factory=Accounts)
    login_jobs: LoginJobs = field(default_factory=LoginJobs)
    shown_errors: ShownErrors = field(default_factory=lambda: ShownErrors().attach())  # detached by the server's close

    def __post_init__(self) -> None:
        if self.sessions is None:
            self.sessions = SessionStates(store=self.settings.default_checkpoint_file)

    def desired_for(self, owner: str):
        """The whole state `owner`'s next generation carries (`app/ui/sessions.py`)."""
        return self.sessions.desired(owner, self.engine.snapshot().desired)

    def account(self, request: gr.Request | None) -> Account:
        """The account of a Gradio request (its login, else the local user)."""
        return self.accounts.ui(getattr(request, "username", None))

    def styles_for(self, account: Account) -> StyleBook:
        """The styles `account` sees and saves to: the shared file for an admin, its own beside it otherwise."""
        shared = self.settings.styles_file
        return StyleBook(shared, None if account.admin else account_file(self.settings.data_dir, account.name))


class EngineCallError(Exception):
    """An engine call failed; the engine has logged it (with its traceback, for failed transitions)."""


@contextlib.contextmanager
def user_errors(action: str, data_dir: Path, browser: bool = True) -> Iterator[None]:
    """Turn a failure into one `gr.Error` carrying the whole message, and one log entry.

    Refused input and engine failures get a one-line log entry (the engine already logged a
    failed transition's traceback); anything else is a bug in the UI and gets its traceback here.
    Gradio's own traceback print is off, so each error is in the log once. The message names files
    relative to `data_dir` (the app's data folder), and no install or home folder: whoever the app
    serves reads it, a stranger on a share link too. Toasts render HTML, so for the browser the
    message is escaped: a `<lora:…>` in it would otherwise cut it short. The log entry goes to
    `SHOWN_ERRORS_LOGGER`, where `ShownErrors` keeps it for Diagnostics and the bug report."""
    try:
        yield
    except gr.Error:
        raise
    except Exception as exc:
        message = without_folders(f"{action} failed: {exc}", data_dir)
        if isinstance(exc, (ValueError, OSError, EngineCallError)):
            shown_log.info("%s", message)
        else:
            shown_log.exception("%s", message)
        raise gr.Error(html.escape(message) if browser else message, duration=None, print_exception=False) from exc


class EngineCall:
    """A blocking engine call on a helper thread, so the handler that asked can report progress, yield
    live previews and notice that its client went away while the worker runs it."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._future: Future = Future()
        threading.Thread(target=self._run, args=(call,), name="ui-engine-call", daemon=True).start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting handler
            self._future.set_exception(exc)

    def wait(self, timeout: float) -> bool:
        """Whether the call has returned (or failed), waiting at most `timeout` seconds."""
        return bool(wait([self._future], timeout).done)

    def result(self) -> Any:
        """The call's value; its failure as an `EngineCallError` (the engine logged it already)."""
        try:
            return self._future.result()
        except Exception as exc:
            raise EngineCallError(str(exc)) from exc


def report_progress(snap: Snapshot, progress: gr.Progress | None) -> None:
    """The engine's phase and step on a Gradio progress bar (its state while no step is counted)."""
    if progress is None:
        return
    if snap.progress is not None and snap.progress.total:
        progress((snap.progress.step, snap.progress.total), desc=snap.progress.phase, unit="steps")
    else:
        progress(None, desc=f"engine {snap.state}")


def run_with_progress(engine: Engine, call: Callable[[], Any], progress: gr.Progress | None) -> Any:
    """Run a blocking engine call in a helper thread; report the engine's phase/step until it returns."""
    running = EngineCall(call)
    while not running.wait(POLL_S):
        report_progress(engine.snapshot(), progress)
    return running.result()


def generation_lane() -> dict:
    """Event arguments of the lane every generation shares: no limit, so every job waits in the engine's
    queue, which serves the logins in turn and groups jobs by the state they carry (each carries its
    own, so their order cannot mix them). Gradio's own lane is first come, first served: with a limit,
    one login's backlog kept another's job out of the engine for minutes. Each login's quota
    (`--account-queue-size`, checked by the request guard) bounds how many there are."""
    return dict(concurrency_id=GENERATION_LANE, concurrency_limit=None)


def checkpoint_names(settings: Settings) -> list[str]:
    """Checkpoints the user may pick: only what discovery finds under the checkpoints folder."""
    return [info.name for info in checkpoint_files.discover_checkpoints(settings.checkpoints_dir)]


def checked_checkpoint(settings: Settings, name: str) -> str:
    """Accept only a discovered checkpoint name (never a path) so the API cannot load arbitrary files."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError("checkpoint name is empty")
    resolve_under(settings.checkpoints_dir, name, "checkpoint")
    known = checkpoint_names(settings)
    if name not in known:
        raise ValueError(f"checkpoint {name!r} is not in {settings.checkpoints_dir}; available: {', '.join(known)}")
    return name


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def specs_from_json(items: Any) -> list[LoraSpec]:
    """`[{"name": str, "weight": 1.0, "unet_weight"?: x, "te_weight"?: y, "schedule"?: "1@0,0@0.3"}, ...]` (or
    `[name, weight]` pairs); a `schedule` (the UNet's strength by step, loractl's syntax) stands for `unet_weight`."""
    if not isinstance(items, list):
        raise ValueError("loras must be a list of {name, weight[, unet_weight, te_weight]} objects")
    specs = []
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            item = {"name": item[0], "weight": item[1]}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"each LoRA needs a string 'name'; got {item!r}")
        unknown = set(item) - {"name", "weight", "unet_weight", "te_weight", "schedule"}
        if unknown:
            raise ValueError(f"LoRA {item['name']!r}: unknown fields {sorted(unknown)}")
        optional = {k: _finite(item[k], f"{item['name']}.{k}") for k in ("unet_weight", "te_weight")
                    if item.get(k) is not None}
        spec = LoraSpec(item["name"], _finite(item.get("weight", 1.0), f"{item['name']}.weight"), **optional)
        specs.append(_with_schedule(spec, item.get("schedule")))
    return specs


def _with_schedule(spec: LoraSpec, text: Any) -> LoraSpec:
    """`spec` with the UNet strength by step `text` asks for (None or "": unchanged)."""
    if text is None or text == "":
        return spec
    if not isinstance(text, str):
        raise ValueError(f"LoRA {spec.name!r}: schedule must be a string like '1@0,0@0.3', got {text!r}")
    parsed = parse_schedule(text, spec.name, f"LoRA {spec.name!r} schedule")
    if isinstance(parsed, float):
        return LoraSpec(spec.name, spec.weight, parsed, spec.te_strength)
    return LoraSpec(spec.name, spec.weight, None, spec.te_strength, parsed)


def generate_params(ctx: UiContext, prompt, negative, sampler, steps, cfg, seed, width, height, batch,
                    n_iter=1, clip_skip=1, subseed=-1, subseed_strength=0, seed_resize_from_w=0,
                    seed_resize_from_h=0, styles=(), refiner_checkpoint=NO_REFINER,
                    refiner_switch_at=0.8, step_cache=0, *, book: StyleBook) -> tuple[GenerateParams, tuple[str, ...]]:
    """Form/API values -> (parameters, notes: rounding, a cut prompt) by the one rule set in
    `generate.LIMITS`; sizes round to the loaded model family's multiple. The chosen `styles` (names
    in the asking account's `book`) are applied to the prompts first, as A1111 applies them
    (`app.styles`); a refiner must be one of the checkpoints (never a path)."""
    refiner = "" if refiner_checkpoint in (None, "", NO_REFINER) else checked_checkpoint(ctx.settings,
                                                                                        refiner_checkpoint)
    prompt, negative = book.apply(list(styles or ()), str(prompt or ""), str(negative or ""))
    values = dict(prompt=prompt, negative_prompt=negative, sampler=sampler, steps=steps, cfg=cfg, seed=seed,
                  width=width, height=height, batch=batch, n_iter=n_iter, clip_skip=clip_skip, subseed=subseed,
                  subseed_strength=subseed_strength, seed_resize_from_w=seed_resize_from_w,
                  seed_resize_from_h=seed_resize_from_h, refiner_checkpoint=refiner,
                  refiner_switch_at=refiner_switch_at, step_cache=step_cache)
    params, notes = params_from_form(values, ctx.engine.snapshot().family)
    return params, (*notes, *missing_lora_notes(ctx, params))


def missing_lora_notes(ctx: UiContext, params: GenerateParams) -> tuple[str, ...]:
    """The note for the prompt's tags naming a LoRA the folder lacks, which the engine leaves out."""
    missing = without_missing_loras(params, ctx.engine.library.found)[1]
    folder = ctx.settings.lora_dir.relative_to(ctx.settings.data_dir).as_posix()
    return tuple(filter(None, [missing_lora_note(missing, folder)]))


def gallery_items(images: list[GeneratedImage]) -> list[tuple]:
    """The saved PNGs (infotext inside, so a download keeps it), captioned with their seeds and, for
    an image an Interrupt or Skip cut short, the step it stopped at."""
    return [(str(im.path) if im.path else im.image,
             f"seed {im.seed}" + ("" if im.complete else f" · stopped at step {im.stopped_at}")) for im in images]


def snapshot_summary(ctx: UiContext) -> dict:
    """A short JSON answer for mutating endpoints: state, model, placement policy, LoRAs (applied, and every
    wanted one with its status and the reason it was set aside) and counters."""
    snap = ctx.engine.snapshot()
    return {
        "state": snap.state, "model": snap.model, "family": snap.family, "device": snap.device, "dtype": snap.dtype,
        "offload": snap.offload,
        "loras": [{"name": s.name, "unet_weight": s.unet_strength, "te_weight": s.te_strength,
                   "schedule": s.schedule_text} for s in snap.loras],
        "lora_states": [{"name": s.name, "unet_weight": s.unet_strength, "te_weight": s.te_strength,
                         "schedule": s.schedule.text if s.schedule else "", "status": s.status, "reason": s.reason}
                        for s in snap.lora_states],
        "lora_counters": {k: {"matched_layers": v.matched_layers, "unmatched_keys": v.unmatched_keys,
                              "apply_errors": v.apply_errors, "runtime_errors": v.runtime_errors,
                              "message": v.message} for k, v in snap.lora_counters.items()},
        "patched_modules": sum(1 for row in snap.placement if row.loras),
        "violations": len(snap.violations),
    }
