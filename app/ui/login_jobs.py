"""Login jobs: the login each session, job and request counts against, and how many jobs each has.

Why: Gradio keys everything by a session hash the client makes up. Closing a heartbeat with a
victim's hash cancelled the victim's job, and a per-session queue cap was no cap at all (8 made-up
sessions x 8 joins filled the whole queue). A login cannot be made up, so ownership, quotas and turns
are the login's ("account"): the Gradio cookie's user, or the A1111 API's basic-auth user. With no
login at all everyone is one account, `LOCAL`.

- A session hash belongs to the login that used it first (`claim`, made by the request guard on every
  route that names one); another login naming it is refused. The record is bounded per account: past
  `sessions_per_account` an account's least recently used session is forgotten (only that account's:
  one login cannot push another's sessions out), and a client that has not logged in records nothing.
- An account may have `--account-queue-size` jobs waiting or running, the UI's and the API's together
  (`job`; with no login, the one account everyone shares may fill the whole queue, `--queue-size`:
  `quota`): the UI's are counted from Gradio's own queue (`gradio_jobs`, wired by `serve`), the API's
  requests here while they wait and run, and a UI job here while Gradio queues it (checked and counted
  at once, so parallel joins cannot all pass the check).
- The engine serves accounts in turn (`app/engine/queue.py`); `of_owner` tells it whose a job is.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from app.accounts import LOCAL
from app.settings import Settings
from app.ui.sessions import API_PREFIX

SESSION_HASH_CHARS = 128  # Gradio's page makes 11-character hashes, gradio_client a 36-character UUID


class QuotaFull(Exception):
    """An account already has as many jobs waiting or running as it may: nothing was queued."""


@dataclass(frozen=True)
class Quota:
    """How many jobs one account may have waiting or running, and the flag that sets it."""

    jobs: int
    flag: str


def quota(settings: Settings, logins: bool) -> Quota:
    """`--account-queue-size` per login; with no login everyone is one account, and a cap on it would let
    one local script or anonymous visitor lock everyone out, so it may fill the whole queue."""
    if logins:
        return Quota(settings.account_queue_size, "--account-queue-size")
    return Quota(settings.queue_size, "--queue-size")


@dataclass(eq=False)
class LoginJobs:
    """Thread-safe: the guard claims sessions on the event loop, the engine's callers ask from their threads."""

    sessions_per_account: int = 256
    gradio_jobs: Callable[[str], int] = lambda _account: 0  # the account's jobs in Gradio's queue (`serve`)
    _owner_of: dict[str, str] = field(default_factory=dict)  # session hash -> account
    _sessions: dict[str, collections.OrderedDict[str, None]] = field(default_factory=dict)  # account -> its, LRU
    _pending: collections.Counter[str] = field(default_factory=collections.Counter)  # jobs counted here
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self, session: str, account: str) -> bool:
        """Whether `account` may use `session`: it already holds it, or nobody did (it holds it from now on)."""
        with self._lock:
            holder = self._owner_of.get(session)
            if holder is not None and holder != account:
                return False
            mine = self._sessions.setdefault(account, collections.OrderedDict())
            mine[session] = None
            mine.move_to_end(session)
            self._owner_of[session] = account
            while len(mine) > self.sessions_per_account:
                forgotten, _ = mine.popitem(last=False)
                del self._owner_of[forgotten]
            return True

    def of_owner(self, owner: str | None) -> str:
        """The account an engine job of `owner` counts against: an A1111 API owner names its login
        (`sessions.api_owner`), a session hash the login that claimed it; `LOCAL` when no login claimed
        it (with no login, that is every job)."""
        if owner and owner.startswith(API_PREFIX):
            return owner[len(API_PREFIX):]
        with self._lock:
            return self._owner_of.get(owner or "") or LOCAL

    def sessions(self) -> int:
        """How many session hashes are bound, all accounts together."""
        with self._lock:
            return len(self._owner_of)

    def held(self, account: str) -> int:
        """The jobs `account` has waiting or running: the API's counted here and the UI's in Gradio's queue."""
        return self._pending[account] + self.gradio_jobs(account)

    @contextlib.contextmanager
    def job(self, account: str, limit: Quota) -> Iterator[None]:
        """Count one job of `account` while the block runs; `QuotaFull` (nothing counted) when it may not
        have one more. Asked on the event loop, which is where Gradio's queue changes."""
        with self._lock:
            held = self.held(account)
            if held >= limit.jobs:
                raise QuotaFull(f"this login already has {held} jobs waiting or running, the most one login may "
                                f"have ({limit.flag} {limit.jobs}); wait for one to finish")
            self._pending[account] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pending[account] -= 1
                if not self._pending[account]:
                    del self._pending[account]
