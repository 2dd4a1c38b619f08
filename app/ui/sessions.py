"""Each session's own `Desired`: a browser tab's panel, a `gradio_client` script's `set_*` calls.

Why: the engine holds one state at a time, but a shared server has many users, and the state one
tab chose (checkpoint, LoRAs with both weights) must never reach
another tab's or script's image. Every change a session makes is recorded here under its Gradio
session hash (one per page load, one per `gradio_client.Client`) and tried on the engine at once,
so the panel shows the engine's answer; every generation the session starts then carries the whole
of it (`Engine.generate(..., desired=...)`), and the engine reconciles to it before the job runs.

A session starts from the app's defaults, never from what another session left in the engine: a
session that chose no LoRA draws with none, one that chose no checkpoint with the app's default
checkpoint (the one loaded at start; an admin's choice of checkpoint replaces it, `set_default_model`).
Dtype, offload and weight storage are engine-wide (an admin sets them, `app/accounts.py`): every
session follows the engine's. The store is bounded: past `limit` sessions the one unheard of longest
is forgotten and starts from the defaults again; a closed tab is forgotten at once.

The A1111 API keeps one state per account (`api_owner`): one API login's checkpoint never reaches
another's images.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

from app.engine.desired import Desired
from app.ui import default_checkpoint

FIELDS = ("model", "loras")  # what a session chooses for itself; the rest of `Desired` is engine-wide
API_PREFIX = "a1111-api:"  # an A1111 API account's key here, and its generations' owner in the engine


def api_owner(account: str) -> str:
    """The owner of an A1111 API account's state and generations."""
    return API_PREFIX + account


class SessionStates:
    """Thread-safe map session -> the `Desired` fields it chose, and the app's default checkpoint."""

    def __init__(self, limit: int = 512, store: Path | None = None) -> None:
        self._limit = limit
        self._store = store  # where the default checkpoint is remembered across restarts (None: not kept)
        self._chosen: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._default_model: str | None = None
        self._lock = threading.Lock()

    def set_default_model(self, name: str | None) -> None:
        """The checkpoint a session that chose none draws with: the one loaded at start, then an admin's choice;
        remembered in `store` for the next start (`app/ui/default_checkpoint.py`)."""
        if name is None:
            return
        with self._lock:
            changed, self._default_model = name != self._default_model, name
            if changed and self._store is not None:
                default_checkpoint.remember(self._store, name)

    def default_model(self, held: Desired) -> str | None:
        """The default checkpoint; until one is set (nothing loaded at start), the first the engine held."""
        with self._lock:
            if self._default_model is None:
                self._default_model = held.model
            return self._default_model

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
        """`owner`'s whole state: its checkpoint (else the default) and LoRAs (else none); dtype, offload and
        weight storage as the engine holds them (`held`)."""
        with self._lock:
            chosen = dict(self._chosen.get(owner, {}))
        return held.replace(**{"model": self.default_model(held), "loras": (), **chosen})

    def forget(self, owner: str) -> None:
        with self._lock:
            self._chosen.pop(owner, None)
