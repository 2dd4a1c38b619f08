"""The most this process's RSS rose while an action ran: the memory tests' one measure (issue 43)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psutil

T = TypeVar("T")


def peak_rss_while(action: Callable[[], T]) -> tuple[T, int]:
    """`action()`'s result and the most this process's RSS rose above its start while it ran, in bytes
    (sampled every 10 ms from another thread: a spike shorter than that can be missed)."""
    process, peak, done = psutil.Process(), [0], threading.Event()
    start = process.memory_info().rss

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss - start)
            time.sleep(0.01)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return action(), peak[0]
    finally:
        done.set()
        sampler.join()
