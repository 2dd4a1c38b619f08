"""The timeline of one job: where the time between asking for an image and having it went, as named phases
(queue wait, the verify before, text encode, denoise, decode, image save, the verify after, publishing)
with the wall and the thread-CPU time of each.

Why: the denoiser runs at diffusers' speed, yet a whole generation was up to 2x slower (issue 41), and
nothing said where the rest went. A phase is entered with `phase(name)` wherever the work happens
(generate.py, decoding, the worker); the worker opens one `JobClock` per job it serves, and only there do
the marks cost anything: outside a job `phase` is one context-variable read. Phases nest without double
counting: an inner phase's time is taken out of the one around it, so the phases and "other" (time in the
job no phase claimed) add up to the job's total. Thread-CPU time is the worker's own (`time.thread_time`):
on a GPU what the host spends, on the CPU with one thread the compute itself.

The clock is a context variable rather than an argument: the marks sit in code several calls below the
worker (a decode inside a lifecycle step inside a workflow stage) that has no reason to carry it.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass

OTHER = "other"  # the job's time that no phase claimed
QUEUE_WAIT = "queue wait"


@dataclass(frozen=True)
class Phase:
    """One named phase of a job: its wall and thread-CPU time summed over `count` entries, in ms."""

    name: str
    wall_ms: float
    cpu_ms: float
    count: int = 1

    def line(self) -> str:
        times = f"{self.count}× " if self.count > 1 else ""
        return f"{self.name}: {times}{self.wall_ms:.1f} ms wall, {self.cpu_ms:.1f} ms CPU"


@dataclass(frozen=True)
class JobTimeline:
    """Where one job's time went: its phases in the order first entered, then "other"; `wall_ms` and
    `cpu_ms` are the whole job's, from leaving the queue to its answer (the queue wait is apart)."""

    command: str
    detail: str
    phases: tuple[Phase, ...]
    wall_ms: float
    cpu_ms: float

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    def lines(self) -> list[str]:
        """One line per phase, as Diagnostics shows them."""
        head = f"{self.command} ({self.detail}): {self.wall_ms:.1f} ms wall, {self.cpu_ms:.1f} ms CPU"
        return [head, *(f"  {p.line()}" for p in self.phases)]

    def as_dict(self) -> dict:
        """For JSON (the bug report, the bench's rows)."""
        return {"command": self.command, "detail": self.detail, "wall_ms": round(self.wall_ms, 3),
                "cpu_ms": round(self.cpu_ms, 3),
                "phases": [{"name": p.name, "wall_ms": round(p.wall_ms, 3), "cpu_ms": round(p.cpu_ms, 3),
                            "count": p.count} for p in self.phases]}


class JobClock:
    """Records the phases of the job running on this thread (one at a time: the worker's)."""

    def __init__(self, command: str, detail: str, queued_s: float = 0.0) -> None:
        self.command, self.detail = command, detail
        self._wall: dict[str, float] = {}
        self._cpu: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._open: list[tuple[str, float, float]] = []  # the phases entered and not left, innermost last
        self._queued_ms = queued_s * 1e3
        self._started = (time.perf_counter(), time.thread_time())

    def _add(self, name: str, wall: float, cpu: float) -> None:
        self._wall[name] = self._wall.get(name, 0.0) + wall
        self._cpu[name] = self._cpu.get(name, 0.0) + cpu

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = (time.perf_counter(), time.thread_time())
        if self._open:  # the phase around this one stops counting until this one ends
            outer, wall0, cpu0 = self._open[-1]
            self._add(outer, now[0] - wall0, now[1] - cpu0)
        self._count[name] = self._count.get(name, 0) + 1
        self._open.append((name, *now))
        try:
            yield
        finally:
            _name, wall0, cpu0 = self._open.pop()
            end = (time.perf_counter(), time.thread_time())
            self._add(name, end[0] - wall0, end[1] - cpu0)
            if self._open:
                outer, _wall, _cpu = self._open.pop()
                self._open.append((outer, *end))

    def finish(self) -> JobTimeline:
        """The timeline so far (the job's total up to now)."""
        wall = (time.perf_counter() - self._started[0]) * 1e3
        cpu = (time.thread_time() - self._started[1]) * 1e3
        phases = [Phase(n, self._wall[n] * 1e3, self._cpu[n] * 1e3, self._count[n]) for n in self._wall]
        phases.append(Phase(OTHER, max(0.0, wall - sum(p.wall_ms for p in phases)),
                            max(0.0, cpu - sum(p.cpu_ms for p in phases))))
        queue = (Phase(QUEUE_WAIT, self._queued_ms, 0.0),) if self._queued_ms else ()
        return JobTimeline(self.command, self.detail, (*queue, *phases), wall, cpu)


_current: contextvars.ContextVar[JobClock | None] = contextvars.ContextVar("job_clock", default=None)


@contextlib.contextmanager
def clocked(clock: JobClock) -> Iterator[JobClock]:
    """Within the block, `phase` marks record into `clock` (on this thread)."""
    token = _current.set(clock)
    try:
        yield clock
    finally:
        _current.reset(token)


def current() -> JobClock | None:
    """The clock of the job running on this thread, if any."""
    return _current.get()


def phase(name: str) -> contextlib.AbstractContextManager:
    """Mark the block as the phase `name` of the job running now (nothing outside a job)."""
    clock = _current.get()
    return contextlib.nullcontext() if clock is None else clock.phase(name)
