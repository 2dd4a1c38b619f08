"""The checks Gradio does not make, in one ASGI layer in front of the whole app.

Gradio answers any `Host`, lets anyone who can reach the queue call any handler by its
`fn_index` (including the UI's own "free memory" and debug switches, which the API docs hide),
reads and parses request bodies before it checks the login, echoes a request's `Origin` in its
CORS headers and lets a password be guessed as fast as the server answers (870 tries a second were
measured). This layer, outermost so that nothing it refuses reaches Gradio, in this order:

- in localhost mode answers only to the bound host names (`127.0.0.1:PORT`, `localhost:PORT`,
  `[::1]:PORT`), so a DNS-rebinding page cannot talk to the app under its own name;
- refuses a state-changing request (any method but GET/HEAD/OPTIONS) that a browser made for
  another site's page, whatever its content type: `Sec-Fetch-Site` other than `same-origin`/`none`,
  or, where a browser sends no such header (plain HTTP), an `Origin` other than `Host`;
- checks the login before a single byte of the body is read: the A1111 API's and FastAPI's schema
  through `gate`, every other POST but `/login` through the UI's session cookie;
- throttles logins per client address (`LoginThrottle`): the socket's peer, or the address a proxy
  named with `--forwarded-allow-ips` forwards (see `trust_proxies`);
- caps request bodies per route (`body_limits`, `Content-Length` refused up front), and an upload's
  bytes, files and account quota as it streams, chunked bodies included (`upload_quota.py`);
- lets a UI-only handler run only for a request from the app's own page in a browser
  (`ui_only.py`); scripts use the documented API, which does the same things;
- caps the requests one session may have pending (Gradio's `max_size` caps the whole queue), and
  the jobs one login may have waiting or running (`--account-queue-size`, `_job_login`);
- when the app has a login: refuses every GET but the few the login form needs (`_open_route`), and
  lets a request name a Gradio session hash, or a queued event, only of its own login
  (`_ownership_refusal`; `app/ui/login_jobs.py`);
- drops every `Access-Control-*` header from answers: the app's page is its own origin and needs
  none, so no other origin is ever allowed to read an answer with the user's cookie.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import anyio
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, cookie_parser

from app.accounts import LOCAL
from app.image_inputs import ImageInputError, open_checked
from app.ui.common import GENERATION_LANE
from app.ui.login_jobs import SESSION_HASH_CHARS, LoginJobs, Quota, QuotaFull
from app.ui.login_throttle import LoginThrottle
from app.ui.ui_only import API_PREFIX, from_own_page, private_handler_refusal
from app.ui.upload_quota import StreamedUpload, UploadQuota, dicts_in, referenced, remove_ended

log = logging.getLogger(__name__)
QUEUE_JOIN = f"{API_PREFIX}/queue/join"
UPLOAD = f"{API_PREFIX}/upload"  # multipart, streamed to disk by Gradio within its `max_file_size`
# JSON bodies are small: both prompts at their 16,000-character cap fit in 400 KB even fully \u-escaped.
MAX_BODY_BYTES = 1 << 20
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# FastAPI's schema of every route, the A1111 API's included: behind the API's login like the API.
SCHEMA_PATHS = ("/openapi.json", "/docs", "/redoc")
HEARTBEAT = f"{API_PREFIX}/heartbeat/"  # + a session hash: closing it runs the page-closed handlers
STREAM = f"{API_PREFIX}/stream/"  # GET: + a session hash and a media stream of it; POST: + an event id
QUEUE_DATA = f"{API_PREFIX}/queue/data"  # ?session_hash=: the session's results, as they come
CALL = f"{API_PREFIX}/call/"  # GET + name + event id: that event's results
CANCEL = f"{API_PREFIX}/cancel"
# What a GET may fetch before the login (`RequestGuard._open_route` says why these).
OPEN_PATHS = frozenset({"/", "/favicon.ico", "/robots.txt", "/manifest.json", "/theme.css", f"{API_PREFIX}/theme.css",
                        f"{API_PREFIX}/login_check", f"{API_PREFIX}/login_check/"})
OPEN_PREFIXES = ("/assets/", "/static/", "/svelte/", "/pwa_icon")
# Gradio lanes whose events wait for the engine: what counts as a login's jobs. "loras" is the lane of
# every engine change and of the img2img and Extras tabs (`lora_panel.LORA_QUEUE`).
JOB_LANES = frozenset({GENERATION_LANE, "loras"})

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class GuardPolicy:
    """`allowed_hosts` None means any `Host` (`--listen` and share links, where a login is required).

    `gated_prefixes` are routes with their own login (the A1111 API): `gate(scope)` answers for
    them before the body is read, with a refusal to send or None to let the request on.
    `body_limits` caps bodies by path prefix (first match wins; other routes `MAX_BODY_BYTES`), an
    upload's too, counted as it streams; one upload carries at most `max_upload_files` files, and one
    account's uploads hold at most `account_upload_quota` bytes on disk."""

    allowed_hosts: frozenset[str] | None
    session_queue_size: int
    account_quota: Quota = Quota(8, "--account-queue-size")
    gated_prefixes: tuple[str, ...] = ()
    gate: Callable[[Scope], ASGIApp | None] | None = None
    body_limits: tuple[tuple[str, int], ...] = ()
    max_upload_files: int = 16
    account_upload_quota: int = 256 << 20

    def body_limit(self, path: str) -> int:
        return next((limit for prefix, limit in self.body_limits if path.startswith(prefix)), MAX_BODY_BYTES)


def loopback_hosts(port: int) -> frozenset[str]:
    return frozenset(f"{name}:{port}" for name in LOOPBACK_NAMES)


class RequestGuard:
    """ASGI middleware around the Gradio app of `demo` (see the module docstring). `gradio_app`
    holds the UI's logins and session tokens (Gradio's `auth`, `tokens`, `cookie_id`)."""

    def __init__(self, app: ASGIApp, demo, policy: GuardPolicy, gradio_app=None,
                 throttle: LoginThrottle | None = None, login_jobs: LoginJobs | None = None) -> None:
        self.app = app
        self.demo = demo
        self.policy = policy
        self.gradio_app = gradio_app
        self.throttle = throttle or LoginThrottle()
        self.uploads = UploadQuota(policy.account_upload_quota,  # Gradio's queue keeps an event until it ends
                                   live=lambda event: event in demo._queue.event_ids_to_events)
        self._sweeper: asyncio.Task | None = None
        self.login_jobs = login_jobs or LoginJobs()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self._guarded(scope, receive, send)
        except ClientDisconnect:  # the page was closed or the client gave up: nothing is wrong with the app
            log.info("client went away during %s %s; its request was dropped", scope["method"], scope["path"])

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope)
        refusal = self._refusal_before_body(scope, headers) or self._named_in_route(scope, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        send = _without_cors(send)
        path = scope["path"]
        if scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
        elif path.startswith(UPLOAD):
            await self._upload(scope, receive, send)
        elif path.rstrip("/") == "/login":
            await self._login(scope, receive, send)
        else:
            await self._call(scope, receive, send)

    def _refusal_before_body(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        """Host, cross-site, login and declared size: everything decided from the request line and headers."""
        allowed = self.policy.allowed_hosts
        if allowed is not None and headers.get("host") not in allowed:
            return _refused(403, f"this server answers only to {', '.join(sorted(allowed))}")
        path, method = scope["path"], scope["method"]
        if self.policy.gate is not None and (path.startswith(self.policy.gated_prefixes) or path in SCHEMA_PATHS):
            answer = self.policy.gate(scope)  # the API's login, and its own cross-site rule
            if answer is not None:
                return answer
        elif method not in SAFE_METHODS:
            if cross_site(headers):
                return _refused(403, "a web page of another site cannot send requests that change anything here")
            if path.rstrip("/") != "/login" and not self._ui_session(headers):
                return _refused(401, "Not authenticated: log in first")
        elif not self._open_route(path) and not self._ui_session(headers):
            return _refused(401, "Not authenticated: log in first")
        declared = headers.get("content-length", "")
        limit = self.policy.body_limit(path)
        if declared.isdigit() and int(declared) > limit:
            return _refused(413, f"request body over {limit:,} bytes")
        return None

    def _ui_session(self, headers: Headers) -> bool:
        """Whether the request carries a logged-in UI session (or the UI has no login): Gradio's own
        check, made here so that nothing is read or parsed for a client that has not logged in."""
        return self._login_of(headers) is not None

    def _has_login(self) -> bool:
        return self.gradio_app is not None and self.gradio_app.auth is not None

    def _login_of(self, headers: Headers) -> str | None:
        """The UI login of the request's session cookie (Gradio's `app.tokens`), None when it has none;
        `LOCAL` when the UI has no login."""
        app = self.gradio_app
        if not self._has_login():
            return LOCAL
        token = self._token(headers)
        return app.tokens.get(token) if token is not None else None

    def _open_route(self, path: str) -> bool:
        """Whether a GET (HEAD, OPTIONS) of `path` is answered without a login. Open: the page itself
        (Gradio answers its login form there), the login check the form makes, and the page's code,
        styles and icons (`/assets/`, `/static/`, `/svelte/`, theme, favicon, manifest, robots.txt), the
        same files for everyone. Everything else waits for the login: the heartbeat (closing it runs the
        page-closed handlers), the queue's results, media streams, `/config`, `/info`, files, the user
        and token routes, the startup events, monitoring."""
        return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)

    def _named_in_route(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        """The ownership check for the session hash or event id a route's path or query names."""
        path = scope["path"]
        if not self._has_login() or not path.startswith(API_PREFIX):
            return None
        sessions, events = [], []
        if path.startswith(HEARTBEAT):
            sessions.append(path[len(HEARTBEAT):])
        elif path.startswith(STREAM):
            head = path[len(STREAM):].split("/", 1)[0]
            (sessions if scope["method"] in SAFE_METHODS else events).append(head)
        elif path.rstrip("/") == QUEUE_DATA:
            sessions += parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash", [])
        elif path.startswith(CALL) and scope["method"] in SAFE_METHODS:
            events.append(path.rstrip("/").rsplit("/", 1)[-1])
        refusal = self._ownership_refusal(headers, sessions, events)
        return None if refusal is None else _refused(*refusal)

    def _ownership_refusal(self, headers: Headers, sessions: list, events: list) -> tuple[int, str] | None:
        """A session hash belongs to the login that used it first (`LoginJobs.claim`); a queued event to the
        login that joined it (Gradio's `Event.username`). Naming another login's is refused (403), so
        nobody can close another's page, cancel or read its jobs; a client that has not logged in never
        gets here (401), so it records nothing."""
        if not self._has_login() or not (sessions or events):
            return None
        login = self._login_of(headers)
        if login is None:
            return 401, "Not authenticated: log in first"
        for session in sessions:
            if not isinstance(session, str) or not 0 < len(session) <= SESSION_HASH_CHARS:
                return 400, f"a session hash is a string of 1 to {SESSION_HASH_CHARS} characters"
            if not self.login_jobs.claim(session, login):
                return 403, "this session belongs to another login"
        known = self.demo._queue.event_ids_to_events  # Gradio's own record of queued and running events
        for event_id in events:
            event = known.get(event_id) if isinstance(event_id, str) else None
            if event is not None and event.username != login:
                return 403, "this event belongs to another login"
        return None

    def _token(self, headers: Headers) -> str | None:
        """The session token of the request's login cookie (Gradio's `access-token` cookies)."""
        cookies = cookie_parser(headers.get("cookie", ""))
        cookie_id = self.gradio_app.cookie_id
        return cookies.get(f"access-token-{cookie_id}") or cookies.get(f"access-token-unsecure-{cookie_id}")

    def _account(self, headers: Headers) -> str:
        """Whose quota a request counts in: the logged-in user, or one local account without a login."""
        return self._login_of(headers) or LOCAL

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Each attempt counts as a failure until Gradio answers 200, so parallel guesses are throttled too."""
        client = (scope.get("client") or ("unknown",))[0]
        wait = self.throttle.begin(client, time.monotonic())
        if wait > 0:
            log.warning("login from %s refused: throttled for %.0f s more", client, wait)
            await _refused(429, f"too many failed logins from {client}; try again in {math.ceil(wait)} s",
                           [(b"retry-after", str(math.ceil(wait)).encode())])(scope, receive, send)
            return
        status = {}

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self._call(scope, receive, watch)
        if status.get("code") == 200:
            self.throttle.succeeded(client)
        else:
            log.warning("failed login from %s", client)

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Gradio streams an upload to disk and answers with the saved paths; its components then decode
        the files with Pillow's own limits (179 M pixels). Every file this app takes is an input image, so
        each saved file is checked here as the A1111 API's images are (`app.image_inputs`: PNG, JPEG or
        WebP, within the pixel cap, PNG text within its caps) before anyone can use it; a refused upload's
        files are deleted and it is answered 400 with the reason, as text. Its bytes, files and the
        account's quota are counted as they arrive (`StreamedUpload`): past a cap it is answered 413,
        naming the flag, and Gradio has deleted what it wrote. The kept files count in the account's
        quota until the jobs that use them end (`UploadQuota`)."""
        headers = Headers(scope=scope)
        account = self._account(headers)
        streamed = StreamedUpload(receive, headers, account, self.uploads, self.policy.body_limit(scope["path"]),
                                  self.policy.max_upload_files)
        start, chunks = {}, []

        async def hold(message: dict) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.app(scope, streamed.receive, hold)
        except BaseException:
            self.uploads.settle(account, streamed.streamed, ())
            raise
        body = b"".join(chunks)
        saved = saved_paths(body) if start.get("status") == 200 and streamed.refusal is None else []
        self.uploads.settle(account, streamed.streamed, saved)  # counted from here on, the check included
        if streamed.refusal is not None:
            log.info("upload of %s refused: %s", account, streamed.refusal)
            await _refused(413, streamed.refusal, plain=True)(scope, receive, send)
            return
        # the check reads and decodes files: off the event loop, which serves every other client meanwhile
        problem = await anyio.to_thread.run_sync(refused_upload, saved) if saved else None
        if problem is not None:
            self.uploads.forget(saved)
            log.info("upload refused: %s", problem)
            await _refused(400, problem, plain=True)(scope, receive, send)
            return
        if self.uploads.files and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(
                remove_ended(self.uploads, self.demo.upload_file_set))
        await send(start)
        await send({"type": "http.response.body", "body": body})

    async def _join(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """Run a queue join; when it names uploaded files, they belong to the job it queued (the
        event id Gradio answers) and are removed when that job ends (`UploadQuota.use`)."""
        try:
            data = json.loads(body).get("data")
        except (ValueError, AttributeError):
            data = None
        paths = referenced(data, self.uploads.files) if self.uploads.files else []
        if not paths:
            await self._forward(scope, receive, send, body)
            return
        answer = []

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.body":
                answer.append(message.get("body", b""))
            await send(message)

        await self.app(scope, _replay(body, receive), watch)
        try:
            event = json.loads(b"".join(answer)).get("event_id")
        except (ValueError, AttributeError):
            event = None
        if isinstance(event, str):
            self.uploads.use(paths, event, page=from_own_page(Headers(scope=scope)))

    async def _call(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.policy.body_limit(scope["path"])
        body = await _read_body(receive, limit)
        if body is None:
            await _refused(413, f"request body over {limit:,} bytes")(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope["path"], headers, body)
        if refusal is not None:
            await _refused(*refusal)(scope, receive, send)
            return
        run = self._join if scope["path"].rstrip("/") == QUEUE_JOIN else self._forward
        login = self._job_login(scope["path"], headers, body)
        if login is None:
            await run(scope, receive, send, body)
            return
        try:
            with self.login_jobs.job(login, self.policy.account_quota):  # until Gradio's record counts it
                await run(scope, receive, send, body)
        except QuotaFull as exc:
            await _refused(429, str(exc))(scope, receive, send)

    async def _forward(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """Hand the request, its body already read, to Gradio."""
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, path: str, headers: Headers, body: bytes) -> tuple[int, str] | None:
        if not path.startswith(API_PREFIX):
            return None
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return None  # Gradio answers malformed JSON itself
        data = data if isinstance(data, dict) else {}
        refusal = private_handler_refusal(self.demo, path, data, headers)
        if refusal is not None:
            return 403, refusal
        if fetches_a_file(data.get("data")):
            return 400, "files must be uploaded first (gradio_client's handle_file does), not sent as a URL"
        named = [data["session_hash"]] if data.get("session_hash") is not None else []
        events = [data["event_id"]] if path.rstrip("/") == CANCEL and "event_id" in data else []
        refusal = self._ownership_refusal(headers, named, events)
        session = data.get("session_hash")
        if refusal is None and path.rstrip("/") == QUEUE_JOIN and isinstance(session, str):
            pending = len(self.demo._queue.pending_event_ids_session.get(session, ()))  # Gradio's own record
            if pending >= self.policy.session_queue_size:
                return 429, (f"this session already has {pending} requests pending, the most one session may "
                             f"have (--session-queue-size); wait for them to finish")
        return refusal

    def _job_login(self, path: str, headers: Headers, body: bytes) -> str | None:
        """The login a join of a job (an event of `JOB_LANES`) counts against (`--account-queue-size`, the
        A1111 API's requests included), or None for any other request."""
        if path.rstrip("/") != QUEUE_JOIN:
            return None
        try:
            fn_index = json.loads(body).get("fn_index")
        except (ValueError, AttributeError):
            return None
        fn = self.demo.fns.get(fn_index) if isinstance(fn_index, int) else None
        if fn is None or fn.concurrency_id not in JOB_LANES:
            return None
        return self._login_of(headers) or LOCAL


def gradio_jobs(demo, account: str) -> int:
    """`account`'s jobs in Gradio's queue: its events of `JOB_LANES` waiting or running (Gradio's own record)."""
    return sum(1 for event in list(demo._queue.event_ids_to_events.values())
               if (event.username or LOCAL) == account and event.concurrency_id in JOB_LANES)


def saved_paths(answer: bytes) -> list[str]:
    """The files a Gradio upload `answer` (a JSON list of saved paths) names; none for any other answer."""
    try:
        paths = json.loads(answer)
    except ValueError:
        return []
    return paths if isinstance(paths, list) and all(isinstance(p, str) for p in paths) else []


def refused_upload(saved: list[str]) -> str | None:
    """Why the `saved` files of an upload are refused (they are then deleted), or None when each is an
    image the app takes."""
    paths = [Path(p) for p in saved]
    for path in paths:
        try:
            open_checked(path.read_bytes(), f"the uploaded file {path.name}").close()
        except (ImageInputError, OSError) as exc:
            for kept in paths:
                kept.unlink(missing_ok=True)
            return str(exc)
    return None


def fetches_a_file(value) -> bool:
    """Whether a request's data holds a file Gradio would fetch itself (a `url` without a `path`: a
    `data:` URL or another server's address) rather than one uploaded here, which the upload check saw."""
    return any(isinstance(item.get("url"), str) and not item.get("path") for item in dicts_in(value))


def cross_site(headers: Headers) -> bool:
    """Whether a browser sent this for another site's page. `Sec-Fetch-Site` cannot be set by a page;
    over plain HTTP (where browsers omit it) the `Origin` a browser adds to every POST must name this
    host. Scripts and API clients send neither, and pass."""
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site not in ("same-origin", "none")
    origin = headers.get("origin")
    return origin is not None and urlsplit(origin).netloc != headers.get("host")


def _without_cors(send: Send) -> Send:
    """`send` minus any `Access-Control-*` header Gradio's CORS layer added (see the module docstring)."""
    async def filtered(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                              if not k.lower().startswith(b"access-control-")]}
        await send(message)

    return filtered


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


def _refused(status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None,
             plain: bool = False) -> ASGIApp:
    """A JSON `{"detail": ...}` answer, the shape Gradio's own refusals have; `plain`: the text alone, as
    Gradio answers a refused upload (its page shows an upload's answer as it is, in a toast). A body
    left unread is discarded by the server as it arrives (nothing of it is kept), so the client still
    reads the answer."""
    payload = (detail if plain else json.dumps({"detail": detail})).encode()
    kind = b"text/plain; charset=utf-8" if plain else b"application/json"
    headers = [(b"content-type", kind), (b"content-length", str(len(payload)).encode())]

    async def answer(_scope: Scope, _receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
        await send({"type": "http.response.body", "body": payload})

    return answer


def install(app, demo, policy: GuardPolicy, login_jobs: LoginJobs | None = None) -> RequestGuard:
    """Wrap the launched app's middleware stack, so the guard runs before Gradio's CORS layer.

    Starlette builds the stack on the first request (Gradio's own readiness probe during
    `launch`), after which `add_middleware` is refused; wrapping the built stack is the one way
    to put a layer outside Gradio's. Requests already in flight finish on the old stack.
    """
    stack = app.middleware_stack or app.build_middleware_stack()
    guard = RequestGuard(stack, demo, policy, gradio_app=app, login_jobs=login_jobs)
    app.middleware_stack = guard
    return guard
