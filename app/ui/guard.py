"""The checks Gradio does not make, in one ASGI layer in front of the whole app.

Gradio answers any `Host`, lets anyone who can reach the queue call any handler by its
`fn_index` (including the UI's own "free memory" and debug switches, which the API docs hide),
reads request bodies of any size, limits the queue only per app and lets a password be guessed
as fast as the server answers (870 tries a second were measured). This layer, outermost so that
nothing it refuses reaches Gradio's CORS handling:

- in localhost mode answers only to the bound host names (`127.0.0.1:PORT`, `localhost:PORT`,
  `[::1]:PORT`), so a DNS-rebinding page cannot talk to the app under its own name;
- throttles logins per client address (`LoginThrottle`);
- refuses request bodies over `MAX_BODY_BYTES` (uploads are bounded by Gradio's own `max_file_size`);
- lets a UI-only handler run only for a request from the app's own page in a browser
  (`Sec-Fetch-Site: same-origin`, or where browsers send no such header over plain HTTP, an
  `Origin` equal to `Host`); scripts use the documented API, which does the same things;
- caps the requests one session may have pending (Gradio's `max_size` caps the whole queue).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from app.ui.login_throttle import LoginThrottle

log = logging.getLogger(__name__)
API_PREFIX = "/gradio_api"
QUEUE_JOIN = f"{API_PREFIX}/queue/join"
UPLOAD = f"{API_PREFIX}/upload"
# Routes that name the handler they run: /call/<name>, /call/v2/<name>, /run/<name>, /api/<name>.
NAMED_ROUTES = tuple(f"{API_PREFIX}/{route}/" for route in ("call/v2", "call", "run", "api"))
# JSON bodies are small: both prompts at their 16,000-character cap fit in 400 KB even fully \u-escaped.
MAX_BODY_BYTES = 1 << 20
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class GuardPolicy:
    """`allowed_hosts` None means any `Host` (`--listen` and share links, where a login is required)."""

    allowed_hosts: frozenset[str] | None
    session_queue_size: int
    # REST routes outside Gradio that take images in JSON (the A1111 API's png-info): their bodies
    # may reach `large_body_bytes`, and they name no Gradio handler, so only the size is checked.
    large_body_prefixes: tuple[str, ...] = ()
    large_body_bytes: int = MAX_BODY_BYTES


def loopback_hosts(port: int) -> frozenset[str]:
    return frozenset(f"{name}:{port}" for name in LOOPBACK_NAMES)


class RequestGuard:
    """ASGI middleware around the Gradio app of `demo` (see the module docstring)."""

    def __init__(self, app, demo, policy: GuardPolicy, throttle: LoginThrottle | None = None) -> None:
        self.app = app
        self.demo = demo
        self.policy = policy
        self.throttle = throttle or LoginThrottle()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        allowed = self.policy.allowed_hosts
        if allowed is not None and headers.get("host") not in allowed:
            await _refuse(send, 403, f"this server answers only to {', '.join(sorted(allowed))}")
            return
        path = scope["path"]
        if scope["method"] != "POST" or path.startswith(UPLOAD):
            await self.app(scope, receive, send)
        elif path.rstrip("/") == "/login":
            await self._login(scope, receive, send)
        else:
            await self._call(scope, receive, send, headers)

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Each attempt counts as a failure until Gradio answers 200, so parallel guesses are throttled too."""
        client = (scope.get("client") or ("unknown",))[0]
        wait = self.throttle.begin(client, time.monotonic())
        if wait > 0:
            log.warning("login from %s refused: throttled for %.0f s more", client, wait)
            await _refuse(send, 429, f"too many failed logins from {client}; try again in {math.ceil(wait)} s",
                          [(b"retry-after", str(math.ceil(wait)).encode())])
            return
        status = {}

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, receive, watch)
        if status.get("code") == 200:
            self.throttle.succeeded(client)
        else:
            log.warning("failed login from %s", client)

    async def _call(self, scope: Scope, receive: Receive, send: Send, headers: Headers) -> None:
        large = scope["path"].startswith(self.policy.large_body_prefixes)
        limit = self.policy.large_body_bytes if large else MAX_BODY_BYTES
        body = await _read_body(receive, limit)
        if body is None:
            await _refuse(send, 413, f"request body over {limit:,} bytes")
            return
        refusal = None if large else self._refusal(scope["path"], headers, body)
        if refusal is not None:
            await _refuse(send, *refusal)
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, path: str, headers: Headers, body: bytes) -> tuple[int, str] | None:
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return None  # Gradio answers malformed JSON itself
        data = data if isinstance(data, dict) else {}
        fn = self._handler(path, data.get("fn_index"))
        if fn is not None and fn.api_visibility == "private" and not _from_own_page(headers):
            return 403, (f"handler {fn.api_name!r} belongs to the app's page; scripts use the documented API "
                         "(the 'Use via API' link)")
        session = data.get("session_hash")
        if path.rstrip("/") == QUEUE_JOIN and isinstance(session, str):
            pending = len(self.demo._queue.pending_event_ids_session.get(session, ()))  # Gradio's own record
            if pending >= self.policy.session_queue_size:
                return 429, (f"this session already has {pending} requests pending, the most one session may "
                             f"have (--session-queue-size); wait for them to finish")
        return None

    def _handler(self, path: str, fn_index):
        """The handler a request would run: by `fn_index` when given (Gradio prefers it), else by route name."""
        if isinstance(fn_index, int):
            return self.demo.fns.get(fn_index)
        route = next((r for r in NAMED_ROUTES if path.startswith(r)), None)
        if route is None:
            return None
        name = path[len(route):].strip("/").split("/")[0]
        return next((fn for fn in self.demo.fns.values() if fn.api_name == name), None)


def _from_own_page(headers: Headers) -> bool:
    """A request made by the app's own page in a browser (which a cross-site page cannot fake)."""
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    origin = headers.get("origin")
    return origin is not None and urlsplit(origin).netloc == headers.get("host")


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None as soon as it passes `limit` bytes."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then whatever comes next (a disconnect)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Send, status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """A JSON `{"detail": ...}` answer, the shape Gradio's own refusals have."""
    payload = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": payload})


def install(app, demo, policy: GuardPolicy) -> RequestGuard:
    """Wrap the launched app's middleware stack, so the guard runs before Gradio's CORS layer.

    Starlette builds the stack on the first request (Gradio's own readiness probe during
    `launch`), after which `add_middleware` is refused; wrapping the built stack is the one way
    to put a layer outside Gradio's. Requests already in flight finish on the old stack.
    """
    stack = app.middleware_stack or app.build_middleware_stack()
    guard = RequestGuard(stack, demo, policy)
    app.middleware_stack = guard
    return guard
