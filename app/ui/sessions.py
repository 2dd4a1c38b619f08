"""Each session's own `Desired`: a browser tab's panel, a `gradio_client` script's `set_*` calls.

Why: the engine holds one state at a time, but a shared server has many users, and the state one
tab chose (model, dtype, offload, weight storage, LoRAs with both weights) must never reach
another tab's or script's image. Every change a session makes is recorded here under its Gradio
session hash (one per page load, one per `gradio_client.Client`) and tried on the engine at once,
so the panel shows the engine's answer; every generation the session starts then carries the whole
of it (`Engine.generate(..., desired=...)`), and the engine reconciles to it before the job runs.

A field a session never chose follows what the engine holds (a script that only sets LoRAs keeps
today's behaviour). The store is bounded: past `limit` sessions the one unheard of longest is
forgotten and falls back to the engine's state; a closed tab is forgotten at once.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from app.engine.desired import Desired
from app.engine.storage import WEIGHTS_CHOICES
from app.settings import DTYPE_CHOICES, OFFLOAD_CHOICES

FIELDS = ("model", "dtype", "offload", "weights", "loras")
API_OWNER = "a1111-api"  # the A1111 API's key here, and its generations' owner in the engine


def checked(desired: Desired) -> Desired:
    """Refuse a state no engine can take (before it is queued), naming the field and its choices; the
    model is checked by the caller against the checkpoint folder."""
    for value, choices, what in ((desired.dtype, DTYPE_CHOICES, "dtype"), (desired.offload, OFFLOAD_CHOICES, "offload"),
                                 (desired.weights, WEIGHTS_CHOICES, "weights")):
        if value not in choices:
            raise ValueError(f"{what} must be one of {', '.join(choices)}; got {value!r}")
    return desired


class SessionStates:
    """Thread-safe map session -> the `Desired` fields it chose."""

    def __init__(self, limit: int = 512) -> None:
        self._limit = limit
        self._chosen: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(self, owner: str, **chosen: Any) -> None:
        """Remember what `owner` chose (any of `FIELDS`; a model of None is not a choice)."""
        unknown = set(chosen) - set(FIELDS)
        if unknown:
            raise ValueError(f"not a field of the desired state: {sorted(unknown)}")
        if "loras" in chosen:
            chosen["loras"] = tuple(chosen["loras"])
        chosen = {k: v for k, v in chosen.items() if v is not None}
        with self._lock:
            self._chosen.setdefault(owner, {}).update(chosen)
            self._chosen.move_to_end(owner)
            while len(self._chosen) > self._limit:
                self._chosen.popitem(last=False)

    def desired(self, owner: str, held: Desired) -> Desired:
        """`owner`'s whole state: what it chose, the rest as the engine holds it (`held`)."""
        with self._lock:
            chosen = dict(self._chosen.get(owner, {}))
        return held.replace(**chosen)

    def forget(self, owner: str) -> None:
        with self._lock:
            self._chosen.pop(owner, None)
