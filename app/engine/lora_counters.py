"""Per-LoRA counters: matched layers, unmatched tensors, apply and runtime errors, disabling.

Why a class of its own: the counters are what Diagnostics and a bug report show per LoRA, and
the engine decides from them whether a LoRA is disabled after repeated runtime errors. Only
LoRAs that exist in the library get a counter (a request naming a made-up LoRA is refused
without leaving state behind: on a shared server, names are attacker-controlled), and every
message kept is capped in length.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

log = logging.getLogger(__name__)
MESSAGE_CHARS = 500  # a kept or echoed message is cut here: enough for any real reason


def capped(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` cut to `limit` characters, marked when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class LoraCounters:
    matched_layers: int = 0
    unmatched_keys: int = 0
    apply_errors: int = 0
    runtime_errors: int = 0
    disabled: bool = False
    message: str = ""


class LoraCounterBook:
    """The counters of every LoRA in the library that something happened to."""

    def __init__(self, in_library: Callable[[str], bool], max_runtime_errors: int) -> None:
        self._in_library = in_library
        self._max_runtime_errors = max_runtime_errors
        self._counters: dict[str, LoraCounters] = {}

    def _update(self, name: str, **changes) -> None:
        if name not in self._counters and not self._in_library(name):
            return
        if "message" in changes:
            changes["message"] = capped(changes["message"])
        self._counters[name] = dataclasses.replace(self._counters.get(name, LoraCounters()), **changes)

    def apply_failed(self, name: str, message: str) -> None:
        old = self._counters.get(name, LoraCounters())
        self._update(name, apply_errors=old.apply_errors + 1, message=message)

    def set_aside(self, name: str, reason: str) -> None:
        """A LoRA that does not fit the loaded model is set aside, not failed: its reason is kept, no
        apply error is counted (it applies again on a model it fits, and a count would stay behind)."""
        self._update(name, message=reason)

    def matched(self, reports: Mapping[str, object]) -> None:
        """Record each applied LoRA's match report (`matched_layers`, `unmatched_keys`, `message`)."""
        for name, report in reports.items():
            self._update(name, matched_layers=report.matched_layers, unmatched_keys=report.unmatched_keys,
                         message=report.message)

    def runtime_error(self, names: Iterable[str], error: BaseException, *, strict: bool) -> frozenset[str]:
        """Count an error raised inside layers these LoRAs patch; returns the ones now disabled
        (past `max_runtime_errors`, never in strict mode, where every error must surface as is)."""
        disabled = set()
        for name in names:
            errors = self._counters.get(name, LoraCounters()).runtime_errors + 1
            disable = not strict and errors >= self._max_runtime_errors
            message = (f"disabled after {errors} runtime errors; last: {error}" if disable
                       else f"runtime error {errors}/{self._max_runtime_errors}: {error}")
            self._update(name, runtime_errors=errors, disabled=disable, message=message)
            log.error("LoRA %s: %s", name, capped(message))
            if disable:
                disabled.add(name)
        return frozenset(disabled)

    def enable_all(self) -> None:
        """An explicit LoRA change or a model load gives disabled LoRAs another chance."""
        for name, counters in list(self._counters.items()):
            if counters.disabled:
                self._update(name, disabled=False, runtime_errors=0, message="")

    def disabled(self) -> frozenset[str]:
        return frozenset(name for name, c in self._counters.items() if c.disabled)

    def snapshot(self) -> MappingProxyType:
        return MappingProxyType(dict(self._counters))
