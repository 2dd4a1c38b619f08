"""`/steady/v1/...`: what this app knows beyond A1111's API, for scripts and dashboards.

- `GET /steady/v1/snapshot`: the engine's whole snapshot (state, model, dtype, offload, LoRAs with
  their status, counters, timers, history, last error), as the Gradio `/snapshot` endpoint gives it;
- `GET /steady/v1/placement`: the placement rows (every module's device, dtype, offload, LoRAs,
  violation flag) that the Diagnostics tab draws;
- `GET /steady/v1/lora-counters`: per-LoRA matched layers, unmatched keys, errors, disabled flag;
- `GET /steady/v1/bug-report`: the redacted bug-report zip (`app.report`), as the Diagnostics button.

Same login and error shape as `/sdapi/v1`.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Response

from app.a1111.errors import A1111Route
from app.a1111.state import ApiState
from app.report import build_bug_report, jsonable
from app.shown_paths import without_folders


def steady_router(state: ApiState) -> APIRouter:
    router = APIRouter(prefix="/steady/v1", route_class=A1111Route)
    ctx = state.ctx

    def shown(value) -> object:
        """An answer's folders as a stranger may read them (`app.shown_paths`)."""
        return without_folders(jsonable(value), ctx.settings.data_dir)

    def snapshot():
        """The snapshot without the live preview pictures (images are not JSON; `/progress` has them)."""
        snap = state.engine.snapshot()
        live = None if snap.progress is None else dataclasses.replace(snap.progress, preview=None)
        return dataclasses.replace(snap, progress=live)

    @router.get("/snapshot")
    def get_snapshot() -> dict:
        return shown(snapshot())

    @router.get("/placement")
    def placement() -> list[dict]:
        return shown(state.engine.snapshot().placement)

    @router.get("/lora-counters")
    def lora_counters() -> dict:
        return shown(state.engine.snapshot().lora_counters)

    @router.get("/bug-report")
    def bug_report() -> Response:
        bundle = build_bug_report(ctx.engine, ctx.settings, ctx.log_lines(), ctx.secrets, ctx.shown_errors.records())
        return Response(bundle, media_type="application/zip",
                        headers={"Content-Disposition": 'attachment; filename="steady-bug-report.zip"'})

    return router
