"""`/adetailer/v1/...`: the routes ADetailer adds to A1111, which its clients probe.

- `GET /adetailer/v1/version`: `{"version": "25.3.0"}`, the ADetailer whose arguments and infotext
  this app reads and writes (`app.detailer.units.ADETAILER_VERSION`);
- `GET /adetailer/v1/ad_model`: `{"ad_model": [...]}`, the detectors a unit's `ad_model` may name:
  the built-in face detector, then the ONNX files in `models/adetailer/`.

Same login and error shape as `/sdapi/v1`.
"""

from __future__ import annotations

from fastapi import APIRouter

from app.a1111.errors import A1111Route
from app.a1111.state import ApiState
from app.detailer.detect import DetectorLibrary
from app.detailer.units import ADETAILER_VERSION


def adetailer_router(state: ApiState) -> APIRouter:
    router = APIRouter(prefix="/adetailer/v1", route_class=A1111Route)

    @router.get("/version")
    def version() -> dict:
        return {"version": ADETAILER_VERSION}

    @router.get("/ad_model")
    def ad_model() -> dict:
        """Listed afresh on every call, so a file dropped into the folder shows without a refresh."""
        return {"ad_model": DetectorLibrary(state.ctx.settings.adetailer_dir).names()}

    return router
