"""Per-address backoff for logins: a few free tries, then each further one waits twice as long.

Gradio checks passwords as fast as requests arrive (870 wrong passwords a second were measured on
a share link). Here an address gets `FREE_ATTEMPTS` tries; after that each attempt must wait
1, 2, 4 … seconds after the previous one, up to `MAX_DELAY_S`: steady state is 12 guesses an hour,
while a user who mistypes a few times is not slowed at all. Every attempt counts as a failure
until it succeeds (so guesses sent in parallel are throttled too); a success clears the address.

Memory is bounded: at most `MAX_ADDRESSES` are tracked (the least recently seen is forgotten
first) and an address quiet for `FORGET_AFTER_S` starts afresh. Behind a share link the
address is the one Gradio's tunnel forwards; if it forwards none, all share users share one.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

FREE_ATTEMPTS = 5
BASE_DELAY_S = 1.0
MAX_DELAY_S = 300.0
FORGET_AFTER_S = 3600.0
MAX_ADDRESSES = 4096


@dataclass
class _Record:
    failures: int
    last: float


class LoginThrottle:
    """Thread-safe; time is passed in (monotonic seconds) so tests need no clock."""

    def __init__(self) -> None:
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def delay(failures: int) -> float:
        """Seconds an address must wait after its last attempt, given its failures so far."""
        if failures < FREE_ATTEMPTS:
            return 0.0
        return min(BASE_DELAY_S * 2 ** (failures - FREE_ATTEMPTS), MAX_DELAY_S)

    def begin(self, address: str, now: float) -> float:
        """0 and the attempt counted (as a failure until `succeeded`), or the seconds left to wait."""
        with self._lock:
            record = self._records.pop(address, None)
            if record is None or now - record.last > FORGET_AFTER_S:
                record = _Record(0, now)
            wait = record.last + self.delay(record.failures) - now
            if wait <= 0:
                record.failures += 1
                record.last = now
            self._records[address] = record
            while len(self._records) > MAX_ADDRESSES:
                self._records.popitem(last=False)
            return max(wait, 0.0)

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._records.pop(address, None)
