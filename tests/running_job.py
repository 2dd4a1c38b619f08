"""A generation on a thread of its own, so a test can stop it part-way as a user's Interrupt does."""

from __future__ import annotations

import threading
import time

from app.engine.generate import GenerateParams


class Running:
    """A generation on a thread of its own, watched through the engine's progress."""

    def __init__(self, engine, params: GenerateParams, owner: str | None = "tab-1") -> None:
        self.engine, self.result, self.error = engine, None, None
        self.thread = threading.Thread(target=self._run, args=(params, owner), daemon=True)
        self.thread.start()

    def _run(self, params, owner) -> None:
        try:
            self.result = self.engine.generate(params, owner=owner)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc

    def wait_for_step(self, step: int, run: int = 1, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            progress = self.engine.snapshot().progress
            if progress is not None and f"run {run}/" in progress.phase and progress.step >= step:
                return progress.step
            time.sleep(0.01)
        raise AssertionError(f"never reached step {step} of run {run}")

    def join(self) -> None:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive() and self.error is None, self.error
