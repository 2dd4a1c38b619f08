"""Errors as A1111 answers them: an HTTP status and `{"error", "detail", "body", "errors"}`, never a traceback.

A1111 turns every exception of its API into that JSON shape (`error` is the exception's class
name, `detail` the message a client shows). Clients (Open WebUI, SillyTavern, `webuiapi`) read
the status and show `detail` or the whole text, so the shape matters more than the class names.

Gradio builds its exception handlers into the middleware stack when it launches, before our
routes exist, so the handling lives in the route class instead: every route of this API is an
`A1111Route`, whose handler turns refusals (`ApiError`, FastAPI's request validation) and engine
failures into that JSON. A refusal gets one log line; an unexpected failure gets its traceback in
the server log only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.accounts import AdminRequired
from app.adapters.errors import AdapterError
from app.engine.checkpoint_files import CheckpointNotFoundError, ModelLoadError
from app.engine.worker import EngineBusy
from app.shown_paths import without_folders

log = logging.getLogger(__name__)
MAX_ERRORS = 10  # validation errors shown per refusal
MAX_TEXT = 200  # characters of each part of one
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

# The first entry whose type matches decides the status; `ValueError` is refused input (limits,
# names), anything unlisted is a server-side failure. A broken checkpoint is a ValueError subclass
# but the request was fine, so it comes before ValueError.
STATUS_BY_TYPE: tuple[tuple[type[BaseException], int], ...] = (
    (AdminRequired, 403),
    (EngineBusy, 503),
    (CheckpointNotFoundError, 404),
    (ModelLoadError, 500),
    (AdapterError, 422),
    (ValueError, 422),
)


class ApiError(HTTPException):
    """A deliberate refusal with its status and a message that says what to change."""

    def __init__(self, status_code: int, detail: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status_code=status_code, detail=detail, headers=dict(headers) if headers else None)


def error_response(status: int, error: str, detail: Any, errors: str, headers: Mapping[str, str] | None = None,
                   body: Any = "", data_dir: Path | None = None) -> JSONResponse:
    """The JSON body A1111's API middleware returns for any failure (heap addresses taken out; with
    `data_dir`, paths relative to it and no install or home folder: see `without_folders`)."""
    content = {"error": error, "detail": _no_addresses(detail), "body": body, "errors": _no_addresses(errors)}
    if data_dir is not None:
        content = without_folders(content, data_dir)
    return JSONResponse(jsonable_encoder(content), status_code=status, headers=dict(headers) if headers else None)


def _no_addresses(value: Any) -> Any:
    """`value` with `<... at 0x7f…>` addresses removed from its text: they help an attacker defeat ASLR."""
    return _ADDRESS.sub("", value) if isinstance(value, str) else value


def status_for(exc: BaseException) -> int:
    return next((status for kind, status in STATUS_BY_TYPE if isinstance(exc, kind)), 500)


def validation_detail(errors: list[dict]) -> tuple[list[dict], str]:
    """FastAPI's validation errors as a small answer and one bounded line: at most `MAX_ERRORS`
    entries, each its place, message and type only. The offending input is never echoed (a
    million empty objects once came back as a 159 MB answer and a 114 MB log line), nor anything
    not JSON (NaN in an integer field once made the answer itself fail with a 500)."""
    shown = [{"loc": [str(part)[:MAX_TEXT] for part in e["loc"][:8]], "msg": str(e["msg"])[:MAX_TEXT],
              "type": str(e["type"])[:MAX_TEXT]} for e in errors[:MAX_ERRORS]]
    summary = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in shown)
    more = len(errors) - len(shown)
    return shown, summary + (f"; and {more} more" if more > 0 else "")


def _answer(request: Request, exc: Exception, data_dir: Path | None) -> JSONResponse:
    if isinstance(exc, RequestValidationError):
        detail, summary = validation_detail(exc.errors())
        log.info("A1111 API %s %s refused: %s", request.method, request.url.path, summary)
        return error_response(422, "RequestValidationError", detail, summary, data_dir=data_dir)
    if isinstance(exc, StarletteHTTPException):  # FastAPI's own and Starlette's (a body that does not parse)
        if exc.status_code != 401:  # a missing login is routine for clients that wait for the challenge
            log.info("A1111 API %s %s refused (%d): %s", request.method, request.url.path, exc.status_code, exc.detail)
        return error_response(exc.status_code, "HTTPException", exc.detail, f"{exc.status_code}: {exc.detail}",
                              exc.headers, data_dir=data_dir)
    status = status_for(exc)
    if status == 500:
        log.exception("A1111 API %s %s failed", request.method, request.url.path)
    else:
        log.info("A1111 API %s %s refused (%d): %s", request.method, request.url.path, status, exc)
    return error_response(status, type(exc).__name__, str(exc), str(exc), data_dir=data_dir)


class A1111Route(APIRoute):
    """An `APIRoute` whose failures come back in A1111's error shape (see the module docstring); a
    route served from a data folder (`data_dir`, set once its router is built) names files relative
    to it: an engine message says where a file belongs, and a stranger on a share link must not learn
    the disk's layout from it."""

    data_dir: Path | None = None

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def answer_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON answer; 500s are logged
                return _answer(request, exc, self.data_dir)

        return answer_errors
