"""The engine's command queue: mutations in order, waiting generations grouped by what they need.

Why grouped: every generation carries the whole `Desired` it needs (model, dtype, offload, weight
storage, LoRAs), and the worker reconciles to it before the job runs. A LoRA re-weight costs
milliseconds on a GPU; a model switch costs seconds. So when several users' jobs wait, the next
one taken is the one whose `Desired` the engine already holds (else one on the same checkpoint,
else the oldest), and jobs asking for the same state run back to back.

Why fair: accounts (logins, `app/ui/login_jobs.py`) take turns: the next job is one of the account
served longest ago (one never served first), so while one login has its whole quota waiting, another
login's job runs right after the job now running, not behind that backlog. Within the account's turn
the grouping above decides, and a job may be passed over at most `MAX_PASSES` times; then it runs
next, whatever it costs. One owner's jobs keep their order (only each owner's oldest waiting job is
a candidate), and only the leading run of generations is regrouped: a mutation, a query or a
generation without a `Desired` is a barrier nothing behind it overtakes. Without accounts (every
job's `account` None) it is the grouping alone.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from app.engine.desired import Desired
from app.engine.snapshot import EngineState

MAX_PASSES = 3  # how many later jobs a waiting job lets go first
TURNS_KEPT = 1024  # accounts remembered by when they were last served (logins are few; a bound all the same)


class EngineBusy(RuntimeError):
    """The command queue is full (`Settings.queue_size`): nothing was queued."""


@dataclass
class Command:
    name: str
    detail: str
    state: EngineState
    body: Callable[[], Any]
    future: Future
    record: bool = True
    owner: str | None = None  # who may cancel it while it waits (generations)
    desired: Desired | None = None  # the state a generation needs; the worker reconciles to it first
    passed: int = 0  # how many later jobs were taken before it
    stage: bool = False  # one stage of a workflow command: the workflow's job outlives it
    account: str | None = None  # the login it counts against: accounts take turns
    queued_at: float = field(default_factory=time.perf_counter)  # for the job's timeline (its queue wait)


class Turns:
    """Accounts by when each was last served, longest ago first (bounded: the oldest are forgotten, and
    a forgotten account counts as never served). Not thread-safe: its owner locks."""

    def __init__(self, kept: int = TURNS_KEPT) -> None:
        self._kept = kept
        self._served: collections.OrderedDict[Any, None] = collections.OrderedDict()

    def next_of(self, accounts: Iterable[Any]) -> Any:
        """Whose turn it is among `accounts` (in arrival order): one never served, else the one served
        longest ago."""
        order = {account: rank for rank, account in enumerate(self._served)}
        return min(accounts, key=lambda account: order.get(account, -1))

    def served(self, account: Any) -> None:
        self._served.pop(account, None)
        self._served[account] = None
        while len(self._served) > self._kept:
            self._served.popitem(last=False)


def _cost(command: Command, held: Desired) -> int:
    """0: nothing to change; 1: LoRAs or offload only; 2: a reload."""
    if command.desired.same_as(held):
        return 0
    return 1 if command.desired.model_key() == held.model_key() else 2


def pick(waiting: Sequence[Command | None], held: Desired, turns: Turns | None = None) -> int:
    """Which waiting command runs next, given the `Desired` the engine holds and the accounts' `turns`
    (see the module docstring). Passes are counted on the candidates of the same account taken over;
    the caller removes the returned index."""
    window = 0
    while window < len(waiting) and waiting[window] is not None and waiting[window].desired is not None:
        window += 1
    if window <= 1:
        return 0
    candidates, owners = [], set()
    for index in range(window):
        owner = waiting[index].owner
        if owner is None or owner not in owners:
            candidates.append(index)
        if owner is not None:
            owners.add(owner)
    account = (turns or Turns()).next_of(waiting[i].account for i in candidates)
    candidates = [i for i in candidates if waiting[i].account == account]
    overdue = [i for i in candidates if waiting[i].passed >= MAX_PASSES]
    chosen = overdue[0] if overdue else min(candidates, key=lambda i: (_cost(waiting[i], held), i))
    for index in candidates:
        if index < chosen:
            waiting[index].passed += 1
    return chosen


class CommandQueue:
    """Bounded, thread-safe; `take` blocks until a command (or the closing `None`) is there."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: collections.deque[Command | None] = collections.deque()
        self._turns = Turns()
        self._wake = threading.Condition()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, command: Command) -> None:
        with self._wake:
            if len(self._items) >= self._size:
                raise EngineBusy(f"the engine already has {len(self._items)} commands waiting; try again when "
                                 "they are done")
            self._items.append(command)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._items.append(None)
            self._wake.notify()

    def take(self, held: Desired, on_take: Callable[[Command], None]) -> Command | None:
        """The next command by `pick`; `on_take` runs under the lock, so a `cancel` never misses it."""
        with self._wake:
            while not self._items:
                self._wake.wait()
            index = pick(self._items, held, self._turns)
            command = self._items[index]
            del self._items[index]
            if command is not None:
                self._turns.served(command.account)
                on_take(command)
            return command

    def cancel(self, owner: str, names: Collection[str]) -> list[Command]:
        """Take `owner`'s waiting commands named in `names` off the queue; returns them."""
        with self._wake:
            mine = [c for c in self._items if c is not None and c.owner == owner and c.name in names]
            for command in mine:
                self._items.remove(command)
        return mine
