"""What the A1111 API keeps between requests: its one-at-a-time lane to the engine and its job record.

Why a lane: a txt2img with `override_settings` is three engine calls (load the asked checkpoint,
generate, load the previous one back), and two API requests interleaving those would generate
with each other's checkpoint. A1111 holds one lock over the whole request; here one lane
(`AccountLane`, logins served in turn) does the same for the API's engine calls, while the engine's
own queue keeps the UI's calls and ours in order, the logins in turn there too. A request counts
against its login's quota (`LoginJobs.job`: `--account-queue-size` jobs waiting or running, the
UI's included) from when it arrives; past it, it is refused (429) rather than queued.

The job record (`JobRecord`) is what `/progress` reports beside the engine's own progress: when
the current API job started (for the ETA), what it was asked to do and whether an Interrupt or
Skip was sent, the fields of A1111's `shared.state`.

Each API account (its basic-auth login; the local user without one, `app/accounts.py`) has its own
state: the checkpoint its `POST /options` chose, kept under `api_owner(account)` beside the Gradio
sessions' (`UiContext.sessions`), and its clip skip. Every API generation carries its account's
state, with no LoRA but its prompt tags (`txt2img.desired_for`), so neither a browser tab's LoRA
panel nor another API login's checkpoint reaches its images. Its generations are that owner's:
an Interrupt or Skip from a login that is not an admin stops only its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

import anyio
from starlette.requests import Request

from app.a1111.auth import basic_user
from app.a1111.errors import ApiError
from app.a1111.lane import AccountLane
from app.accounts import LOCAL_ACCOUNT, Account
from app.ui.common import UiContext
from app.ui.login_jobs import Quota, QuotaFull
from app.ui.sessions import api_owner

T = TypeVar("T")


def owner_of(account: Account) -> str:
    """The owner of `account`'s API state and generations (`app/ui/sessions.py`)."""
    return api_owner(account.name)


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
    (`login_jobs.quota`)."""

    ctx: UiContext
    quota: Quota
    lane: AccountLane = field(default_factory=AccountLane)
    job: JobRecord = field(default_factory=JobRecord)
    last_model: str | None = None  # the checkpoint to load back after an unload (A1111 reloads on demand)
    seen_since: float | None = None  # when `/progress` first saw the engine busy with a job not the API's
    clip_skips: dict[str, int] = field(default_factory=dict)  # account -> A1111's `CLIP_stop_at_last_layers`
    send_seeds: dict[str, bool] = field(default_factory=dict)  # account -> A1111's `send_seed` (app/a1111/options.py)

    @property
    def engine(self):
        return self.ctx.engine

    def account(self, request: Request) -> Account:
        """The account of an API request: its basic-auth login, or the local user when the API asks for none."""
        return self.ctx.accounts.api(basic_user(request.headers))

    def clip_skip(self, account: Account) -> int:
        """The clip skip `account`'s requests use unless they override it (1 until its `POST /options`)."""
        return self.clip_skips.get(account.name, 1)

    async def run(self, job: str, call: Callable[[], T], account: Account = LOCAL_ACCOUNT) -> T:
        """Run a blocking engine call in the API's lane as `account`'s job, recorded as `job` while it runs."""
        try:
            with self.ctx.login_jobs.job(account.name, self.quota):
                async with self.lane.turn(account.name):
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
