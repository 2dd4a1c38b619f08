"""Checkpoints under A1111's names, and switching them for one request.

A1111 titles a checkpoint `name.safetensors [shorthash]` once it has been hashed, and plain
`name.safetensors` before; clients store whichever title they were shown and send it back in
`sd_model_checkpoint`. So a checkpoint answers to its title with or without the hash, its name
with or without `.safetensors`, and its short hash. Only the loaded checkpoint's hash is known
here (the engine hashes what it loads); hashing every file for a listing would read gigabytes.

`override_settings: {"sd_model_checkpoint": …}` loads that checkpoint for one txt2img and, as
A1111's `override_settings_restore_afterwards` does by default, loads the previous one back
afterwards, unless another client changed the model in between (then its choice stands).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TypeVar

from app.a1111.errors import ApiError
from app.a1111.state import ApiState, owner_of
from app.accounts import Account
from app.engine import checkpoint_files, models
from app.engine.snapshot import Snapshot
from app.settings import Settings
from app.shown_paths import without_folders

log = logging.getLogger(__name__)
T = TypeVar("T")
_TITLE = re.compile(r"^(?P<name>.*?)\s*\[(?P<hash>[0-9a-fA-F]{8,64})\]$")
SUFFIX = ".safetensors"


def title(name: str, short_hash: str | None) -> str:
    return f"{name} [{short_hash}]" if short_hash else name


def model_name(name: str) -> str:
    """A1111's `model_name`: the file name without extension, folders joined by `_`."""
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    return stem.replace("/", "_")


def sd_models(settings: Settings, snap: Snapshot) -> list[dict]:
    """`GET /sdapi/v1/sd-models`: every discovered checkpoint, the loaded one with its hash; `filename`
    relative to the data folder (as the other listings)."""
    out = []
    for info in checkpoint_files.discover_checkpoints(settings.checkpoints_dir):
        short = snap.model_hash if info.name == snap.model else None
        out.append({"title": title(info.name, short), "model_name": model_name(info.name), "hash": short,
                    "sha256": None, "filename": str(info.path), "config": None})
    return without_folders(out, settings.data_dir)


def resolve(settings: Settings, snap: Snapshot, asked: object) -> str:
    """The checkpoint name for any of the names a client may send (see the module docstring); 404 if none."""
    if not isinstance(asked, str) or not asked.strip():
        raise ApiError(422, f"sd_model_checkpoint must be a checkpoint title or name, got {asked!r}")
    text = asked.strip()
    match = _TITLE.match(text)
    name, short = (match["name"], match["hash"].lower()) if match else (text, None)
    names = [info.name for info in checkpoint_files.discover_checkpoints(settings.checkpoints_dir)]
    for candidate in names:
        if name in (candidate, model_name(candidate), candidate.removesuffix(SUFFIX)):
            return candidate
    loaded_hash = (snap.model_hash or "").lower()
    if snap.model and loaded_hash and (short or text.lower()) in (loaded_hash, loaded_hash[:8]):
        return snap.model
    raise ApiError(404, f"Model not found: {asked!r}; available: {', '.join(names) or 'none'} "
                        "(GET /sdapi/v1/sd-models lists their titles)")


def current_title(state: ApiState, account: Account) -> str | None:
    """`sd_model_checkpoint`: the account's checkpoint (its `POST /options`, else the app's default), else
    the one the next txt2img would load."""
    snap = state.engine.snapshot(wait_for_hash=True)
    model = state.ctx.desired_for(owner_of(account)).model
    if model:
        return title(model, snap.model_hash if model == snap.model else None)
    return next_model(state)


def next_model(state: ApiState) -> str | None:
    """What a request loads when nothing is loaded: the last checkpoint seen, else the first found."""
    if state.last_model is not None:
        return state.last_model
    found = checkpoint_files.discover_checkpoints(state.ctx.settings.checkpoints_dir)
    return found[0].name if found else None


def target_model(state: ApiState, wanted: str | None, account: Account) -> str:
    """The checkpoint a request runs on: `wanted`, else the account's own (`POST /options`, else the app's
    default), else `next_model`, as A1111 loads on demand; 409 when there is none at all."""
    target = wanted or state.ctx.desired_for(owner_of(account)).model or next_model(state)
    if target is None:
        raise ApiError(409, f"no checkpoint loaded and none found in {state.ctx.settings.checkpoints_dir}")
    return target


def family_of_model(state: ApiState, model: str) -> str | None:
    """The family a request for `model` is planned for (its sizes, sampler, defaults): the loaded model's,
    else read from the checkpoint's header, as the job's reconcile loads it only after the planning.
    None when it cannot be read: the load then says why."""
    snap = state.engine.snapshot()
    return snap.family if model == snap.model else models.planned_family(state.ctx.settings.checkpoints_dir, model)


def ensure_model(state: ApiState, wanted: str | None, account: Account) -> None:
    """Load `target_model` now (`/reload-checkpoint`); a generation needs no such step, its job loads it."""
    target = target_model(state, wanted, account)
    if target != state.engine.snapshot().model:
        state.engine.load_model(target)


def with_checkpoint(state: ApiState, wanted: str | None, restore: bool, call: Callable[[str], T],
                    account: Account) -> tuple[T, list[str]]:
    """Run `call(checkpoint)` for `wanted` (or the account's checkpoint; the job carries it and the engine
    loads it before the job); afterwards load the previous checkpoint back when `restore`.

    Returns the call's result and notes for the client. A failed restore does not throw the
    images away: the engine has recorded it (history, last error) and the note says so."""
    before = state.engine.snapshot().model
    target = target_model(state, wanted, account)
    notes: list[str] = []
    try:
        result = call(target)
    finally:
        switched = wanted is not None and before is not None and before != wanted
        if restore and switched and state.engine.snapshot().model == wanted:
            notes += _restore(state, before)
    return result, notes


def _restore(state: ApiState, before: str) -> list[str]:
    try:
        state.engine.load_model(before)
    except Exception as exc:  # noqa: BLE001 - reported to the client in the answer's info, logged by the engine
        log.warning("override_settings: could not load %s back: %s", before, exc)
        return [f"the previous checkpoint {before} could not be loaded back: {exc}"]
    return []
