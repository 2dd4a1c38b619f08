"""`GET /sdapi/v1/progress` from the engine's snapshot, with A1111's fields and arithmetic.

The engine publishes the phase ("denoising, run 2/3"), the step and the live preview of whatever
job it runs, the UI's or the API's. A1111's `state` counts runs as jobs (`job_no` of
`job_count`), so the run numbers are read from the phase; `progress` is A1111's
`0.01 + (job_no + step / steps) / job_count` and `eta_relative` its linear extrapolation from
when the job started (the API's own job: when it entered the engine; a UI job: when this
endpoint first saw it). Idle, everything is 0, which clients such as SillyTavern and `webuiapi`
wait for after switching a checkpoint.
"""

from __future__ import annotations

import base64
import io
import re
import time

from app.a1111.state import ApiState
from app.engine.snapshot import Snapshot

_RUN = re.compile(r"run (\d+)/(\d+)")


def _runs(snap: Snapshot) -> tuple[int, int]:
    """(job_no, job_count) of the current generation: its run (0-based) and how many runs it has."""
    match = _RUN.search(snap.progress.phase) if snap.progress is not None else None
    return (int(match[1]) - 1, int(match[2])) if match else (0, 1)


def _state(state: ApiState, snap: Snapshot, busy: bool) -> dict:
    job_no, job_count = _runs(snap) if busy else (0, 0)
    step, steps = (snap.progress.step, snap.progress.total) if busy and snap.progress is not None else (0, 0)
    record = state.job
    return {"skipped": record.skipped, "interrupted": record.interrupted, "stopping_generation": False,
            "job": record.job or (snap.state.lower() if busy else ""), "job_count": job_count,
            "job_timestamp": record.timestamp, "job_no": job_no, "sampling_step": step, "sampling_steps": steps}


def _preview_png(snap: Snapshot) -> str | None:
    preview = snap.progress.preview if snap.progress is not None else None
    if not preview:
        return None
    buffer = io.BytesIO()
    preview[0].save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def progress(state: ApiState, skip_current_image: bool = False) -> dict:
    """The `ProgressResponse` fields for this moment."""
    snap = state.engine.snapshot()
    busy = snap.generating or snap.progress is not None or state.job.started is not None
    info = _state(state, snap, busy)
    if not busy:
        state.seen_since = None
        return {"progress": 0.0, "eta_relative": 0.0, "state": info, "current_image": None, "textinfo": None}
    started = state.job.started or state.seen_since or time.time()
    state.seen_since = started
    done = 0.01 + info["job_no"] / info["job_count"]
    if info["sampling_steps"]:
        done += info["sampling_step"] / info["sampling_steps"] / info["job_count"]
    elapsed = time.time() - started
    textinfo = snap.progress.phase if snap.progress is not None else f"engine {snap.state}"
    return {"progress": min(done, 1.0), "eta_relative": max(elapsed / done - elapsed, 0.0), "state": info,
            "current_image": None if skip_current_image else _preview_png(snap), "textinfo": textinfo}
