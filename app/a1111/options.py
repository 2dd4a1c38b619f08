"""`GET/POST /sdapi/v1/options`: the settings A1111 clients read and write, in A1111's names.

A1111 has hundreds of options; this app has a handful. GET answers the checkpoint
(`sd_model_checkpoint`, what every client reads), the clip skip API requests use unless they
override it (`CLIP_stop_at_last_layers`, 1–12; the UI has its own per-generation slider), the A1111
options whose value here is fixed (automatic VAE, PNG samples, the live-preview interval) and our own engine settings
under `steady_` keys: `steady_dtype` (auto, fp16, bf16, fp32) and `steady_offload` (the offload
mode). POST accepts any of those keys: a new checkpoint goes through the engine like the UI's choice
and is the account's own from then on (an admin's is also the app's default), and so is its clip
skip; dtype and offload are engine-wide, so a change of them is an admin's only (403 naming that,
nothing changed); a fixed option sent back with its own value is fine (Open WebUI posts the whole
dict back, dtype and offload included: sent back unchanged they are no change); anything else is
refused before any change is made, with the keys named.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from app.a1111 import checkpoints
from app.a1111.errors import ApiError
from app.a1111.state import ApiState, owner_of
from app.accounts import Account, require_admin
from app.engine.generate import LIMITS
from app.settings import Settings

OVERRIDABLE = "sd_model_checkpoint"  # `override_settings` switches the checkpoint for one request …
CLIP_SKIP = "CLIP_stop_at_last_layers"  # … and the clip skip (read by `txt2img.plan`)
STEP_CACHE = "steady_step_cache"  # ours, per request only: the step cache's threshold (read by `txt2img.plan`)
DTYPE, OFFLOAD = "steady_dtype", "steady_offload"
# A1111's "send the seed with Send to" switch (default on). It steers A1111's page only; clients read it and write
# it back (A1111's own API test does), so it is kept per account and answered, and changes nothing here: this
# app's Send to buttons always carry the seed, as A1111's do by default.
SEND_SEED = "send_seed"


def fixed_options(settings: Settings) -> dict[str, Any]:
    """A1111 options whose value cannot change here, as A1111 names them."""
    return {"sd_vae": "Automatic", "samples_format": "png", "samples_save": True,
            "live_previews_enable": settings.preview_every > 0,
            "show_progress_every_n_steps": settings.preview_every or -1}


def current(state: ApiState, account: Account) -> dict[str, Any]:
    own = state.ctx.desired_for(owner_of(account))
    return {OVERRIDABLE: checkpoints.current_title(state, account), CLIP_SKIP: state.clip_skip(account),
            SEND_SEED: state.send_seeds.get(account.name, True), **fixed_options(state.ctx.settings),
            DTYPE: own.dtype, OFFLOAD: own.offload}


def unsupported_overrides(settings: Settings, overrides: Mapping[str, Any]) -> Iterator[str]:
    """A note for each `override_settings` entry other than the checkpoint that asks for a change:
    clients send their clip skip or VAE along with every request, and the picture is still made."""
    fixed = fixed_options(settings)
    for key, value in overrides.items():
        if key not in (OVERRIDABLE, CLIP_SKIP, STEP_CACHE) and fixed.get(key, object()) != value:
            yield f"override_settings {key}={value!r} ignored: this app cannot change it per request"


def _refusals(state: ApiState, changes: Mapping[str, Any], known: Mapping[str, Any]) -> list[str]:
    fixed = fixed_options(state.ctx.settings)
    problems = [f"{key} (unknown here)" for key in changes if key not in known]
    problems += [f"{key}={changes[key]!r} (fixed at {value!r} in this app)" for key, value in fixed.items()
                 if key in changes and changes[key] != value]
    if SEND_SEED in changes and not isinstance(changes[SEND_SEED], bool):
        problems.append(f"{SEND_SEED}={changes[SEND_SEED]!r} (true or false)")
    if CLIP_SKIP in changes:
        try:
            LIMITS["clip_skip"].check(CLIP_SKIP, changes[CLIP_SKIP])
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def apply(state: ApiState, changes: Mapping[str, Any], account: Account) -> None:
    """Blocking (run it in the API's lane): check every key, then change what differs through the engine."""
    known = current(state, account)
    problems = _refusals(state, changes, known)
    if problems:
        raise ApiError(422, f"options not accepted, nothing changed: {'; '.join(problems)}. Settable here: "
                            f"{OVERRIDABLE}, {CLIP_SKIP}, {SEND_SEED}, {DTYPE}, {OFFLOAD}")
    engine_wide = [key for key in (DTYPE, OFFLOAD) if key in changes and changes[key] != known[key]]
    if engine_wide:
        require_admin(account, f"POST /options {', '.join(engine_wide)}")
    engine, snap = state.engine, state.engine.snapshot(wait_for_hash=True)
    name = checkpoints.resolve(state.ctx.settings, snap, changes[OVERRIDABLE]) if OVERRIDABLE in changes else None
    if CLIP_SKIP in changes:
        state.clip_skips[account.name] = int(changes[CLIP_SKIP])
    if SEND_SEED in changes:
        state.send_seeds[account.name] = changes[SEND_SEED]
    dtype, offload = (changes[key] if key in engine_wide else None for key in (DTYPE, OFFLOAD))
    if name is not None and name != snap.model:
        engine.load_model(name, dtype=dtype)
    elif dtype is not None and dtype != snap.requested_dtype:
        engine.set_dtype(dtype)
    if offload is not None and offload != snap.offload:
        engine.set_offload(offload)
    state.ctx.sessions.record(owner_of(account), model=name)  # the account's own, from now on
    if account.admin:
        state.ctx.sessions.set_default_model(name)
