"""The A1111 API's lane to the engine: one request at a time, the logins waiting in turn.

Why one at a time: see `app.a1111.state` (a request with `override_settings` is several engine calls,
A1111's `shared.state` describes one job). Why in turn: a FIFO lane let one login's 8 slow requests
hold everyone else back for minutes. Here the next request is the oldest of the login served longest
ago (one never served first, `app.engine.queue.Turns`, the engine's own rule), so another login waits
for the request now running at most. One login's requests keep their order.

Waiting requests are coroutines on the event loop, not threads, so a backlog cannot starve the thread
pool the UI's handlers run in; everything here runs on that loop, so it needs no lock.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator

import anyio

from app.engine.queue import Turns


class AccountLane:
    """`async with lane.turn(account):` holds the lane; waiters are served by account in turn."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: dict[str, collections.deque[anyio.Event]] = {}  # in order of their first waiter
        self._turns = Turns()

    @contextlib.asynccontextmanager
    async def turn(self, account: str) -> AsyncIterator[None]:
        if self._busy:
            await self._wait(account)
        self._busy = True
        self._turns.served(account)
        try:
            yield
        finally:
            self._hand_on()

    async def _wait(self, account: str) -> None:
        """Until the lane is handed to this waiter; a waiter cancelled after it was handed the lane hands it on."""
        ticket = anyio.Event()
        self._waiting.setdefault(account, collections.deque()).append(ticket)
        try:
            await ticket.wait()
        except BaseException:
            if ticket.is_set():
                self._hand_on()
            else:
                queue = self._waiting[account]
                queue.remove(ticket)
                if not queue:
                    del self._waiting[account]
            raise

    def _hand_on(self) -> None:
        """Give the lane to the first waiter of the account whose turn it is, or free it."""
        if not self._waiting:
            self._busy = False
            return
        account = self._turns.next_of(self._waiting)
        queue = self._waiting[account]
        ticket = queue.popleft()
        if not queue:
            del self._waiting[account]
        ticket.set()  # the lane stays busy: it is that waiter's now
