"""What the worker does around every transition's body: verify and repair the placement of every
model the engine holds (the diffusion model, a held refiner, the upscaler) before and after it,
repair and record a body that failed, and publish the snapshot the UI and the API read.

Why apart from the queue plumbing (app/engine/worker.py): this is the product's promise made
checkable, one place that says what "verified" means for a transition and what a failure leaves
behind (rolled back, or ERROR when even the repair fails); the worker only orders the commands.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable

from app.engine import placement
from app.engine.lora_counters import capped
from app.engine.placing import RollbackFailed
from app.engine.snapshot import EngineState, ErrorRecord, build_snapshot
from app.shown_paths import folder_redactor

log = logging.getLogger("app.engine.worker")  # the engine's one log of transitions and failures


class Verifying:
    """The checks and the publishing of `Engine` (see the module docstring); the engine holds the state."""

    def shown_folders(self) -> Callable[[str], str]:
        """How the engine's records (errors, history) name folders: relative to the data folder, no
        install or home folder (`app.shown_paths`)."""
        return folder_redactor(None, str(self.settings.data_dir))

    def _fail(self, command, exc: BaseException, before: EngineState) -> str:
        """Repair what a failed body may have left, record the error; returns the outcome."""
        rollback_failed = (isinstance(exc, RollbackFailed) or before == EngineState.ERROR
                           or not self._repair_after_failure(command.name))
        if rollback_failed:
            self._state = EngineState.ERROR
        # The UI, the APIs and the bug report show the record: folders as a stranger may read them.
        shown, trace = self.shown_folders(), traceback.format_exc()
        self._last_error = ErrorRecord(command.name, shown(capped(f"{type(exc).__name__}: {exc}")), shown(trace),
                                       time.time())
        if isinstance(exc, ValueError) and not rollback_failed:
            # Refused input (every refusal is a ValueError: a sampler the family lacks, an empty mask, a
            # LoRA that does not fit): the caller shows and logs the message in one line; a traceback
            # is for bugs. Diagnostics and the bug report keep it all the same (`last_error`).
            log.debug("%s (%s) refused: %s", command.name, command.detail, capped(str(exc)))
        else:
            # The traceback goes to the log as text: a live exc_info would keep its frames (and the
            # pipelines they reference) alive in any handler that keeps records.
            log.error("%s (%s) failed: %s\n%s", command.name, command.detail, capped(str(exc)), trace)
        return "failed, engine in ERROR" if rollback_failed else "failed, rolled back"

    def _repair_after_failure(self, command: str) -> bool:
        """A failed body may have been cut off mid-move: verify and repair once more, never raising.
        Returns False when even that fails (the engine then enters ERROR)."""
        try:
            self._verify_and_repair(f"after failed {command}", strict=False)
            return True
        except Exception:  # noqa: BLE001 - reported through the ERROR state and the log
            log.exception("placement could not be repaired after failed %s", command)
            return False

    def _verify_and_repair(self, when: str, strict: bool | None = None,
                           after_lora_change: bool = False) -> tuple[int, int]:
        """Find and repair placement violations; strict mode turns any finding into a failure.
        `after_lora_change`: see `ModelLifecycle.verify_and_repair` (the layers written, not every tensor)."""
        t0 = time.perf_counter()
        found, repaired = self._lifecycle.verify_and_repair(when, after_lora_change)
        refiner_found, refiner_repaired = self._verify_refiner(when)
        upscaler_found, upscaler_repaired = self._upscaler.verify_and_repair(when)
        faces_found, faces_repaired = self._face_restorer.verify_and_repair(when)
        found = found + refiner_found + upscaler_found + faces_found
        repaired += refiner_repaired + upscaler_repaired + faces_repaired
        self._timers.record("verify", time.perf_counter() - t0)
        self._last_violations += tuple(found)
        self._found_total += len(found)
        self._repaired_total += repaired
        if found:
            log.warning("%d placement violations %s, %d repaired; first: %s", len(found), when, repaired, found[0])
            if self.settings.strict if strict is None else strict:
                raise placement.PlacementError(
                    f"strict mode: {len(found)} placement violations {when} (repaired), first: {found[0]}")
        return len(found), repaired

    def _publish(self) -> None:
        self._published = (build_snapshot(
            state=self._state.value, device=str(self.device), desired=self._desired, facts=self._lifecycle.facts(),
            rows=self._lifecycle.rows(self._last_violations) + self._upscaler.rows(self._last_violations)
            + self._face_restorer.rows(self._last_violations),
            upscaler=self._upscaler.facts(), violations=self._last_violations,
            found_total=self._found_total, repaired_total=self._repaired_total,
            counters=self._counters.snapshot(), timers=self._timers.snapshot(), history=tuple(self._history),
            last_error=self._last_error, held_for=self._held_for), self._lifecycle.scan)
