"""What the A1111 API keeps between requests: its one-at-a-time lane to the engine and its job record.

Why a lane: a txt2img with `override_settings` is three engine calls (load the asked checkpoint,
generate, load the previous one back), and two API requests interleaving those would generate
with each other's checkpoint. A1111 holds one lock over the whole request; here one lane
(`AccountLane`, logins served in turn) does the same for the API's engine calls, while the engine's
own queue keeps the UI's calls and ours in order, the logins in turn there too. A request counts
against its login's quota (`Accounts.job`: `--account-queue-size` jobs waiting or running, the
UI's included) from when it arrives; past it, it is refused (429) rather than queued.

The job record (`JobRecord`) is what `/progress` reports beside the engine's own progress: when
the current API job started (for the ETA), what it was asked to do and whether an Interrupt or
Skip was sent, the fields of A1111's `shared.state`.

The API's own state (what `POST /options` chose: checkpoint, `steady_dtype`, `steady_offload`) is
kept under `API_OWNER` beside the Gradio sessions' (`UiContext.sessions`): every API generation
carries it, with no LoRA but its prompt tags (`txt2img.desired_for`), so a browser tab's LoRA panel
never reaches an API image and a UI user's model switch does not move a checkpoint the API chose.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

import anyio
from starlette.requests import Request

from app.a1111.auth import basic_credentials
from app.a1111.errors import ApiError
from app.a1111.lane import AccountLane
from app.ui.accounts import LOCAL_ACCOUNT, Quota, QuotaFull
from app.ui.common import UiContext
from app.ui.sessions import API_OWNER

__all__ = ["API_OWNER", "ApiState", "JobRecord"]

T = TypeVar("T")


@dataclass
class JobRecord:
    """One API job (A1111's `shared.state`): its name, start, and the stop requests sent to it."""

    job: str = ""
    started: float | None = None
    timestamp: str = "0"
    interrupted: bool = False
    skipped: bool = False

    def begin(self, job: str) -> None:
        self.job, self.started = job, time.time()
        self.timestamp = datetime.now().strftime("%Y%m%d%H%M%S")
        self.interrupted = self.skipped = False

    def end(self) -> None:
        self.job, self.started = "", None


@dataclass
class ApiState:
    """Shared by every route of one served app. `quota`: the jobs one login may have waiting or running
    (`accounts.quota`); `logins`: whether the API has logins (without, everyone is one account)."""

    ctx: UiContext
    quota: Quota
    logins: bool = False
    lane: AccountLane = field(default_factory=AccountLane)
    job: JobRecord = field(default_factory=JobRecord)
    last_model: str | None = None  # the checkpoint to load back after an unload (A1111 reloads on demand)
    seen_since: float | None = None  # when `/progress` first saw the engine busy with a job not the API's
    clip_skip: int = 1  # A1111's `CLIP_stop_at_last_layers` for API requests that do not override it

    @property
    def engine(self):
        return self.ctx.engine

    def account(self, request: Request) -> str:
        """The login `request` counts against (a route dependency): its basic-auth user, which the request
        guard has checked before the route runs; `LOCAL_ACCOUNT` when the API has no logins."""
        if not self.logins:
            return LOCAL_ACCOUNT
        credentials = basic_credentials(request.headers.get("authorization", ""))
        return credentials[0] if credentials else LOCAL_ACCOUNT

    async def run(self, job: str, call: Callable[[], T], account: str = LOCAL_ACCOUNT) -> T:
        """Run a blocking engine call in the API's lane as `account`'s job, recorded as `job` while it runs."""
        try:
            with self.ctx.accounts.job(account, self.quota):
                async with self.lane.turn(account):
                    with self.ctx.accounts.api_lane_held_by(account):
                        return await anyio.to_thread.run_sync(self._recorded, job, call)
        except QuotaFull as exc:
            raise ApiError(429, str(exc), {"Retry-After": "5"}) from None

    def _recorded(self, job: str, call: Callable[[], T]) -> T:
        self.job.begin(job)
        try:
            return call()
        finally:
            self.job.end()
            self.remember_model()

    def remember_model(self) -> None:
        """Note the loaded checkpoint, so `reload-checkpoint` and the next txt2img after an unload know it."""
        model = self.engine.snapshot().model
        if model is not None:
            self.last_model = model
