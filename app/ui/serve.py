"""Serving: auth policy, launch, share-link fallback, readiness, and `serve()` for `launch.py`.

Policy: a server reachable by others (`--listen` on all interfaces, or a `--share` link) never
runs without a login unless the user says `--no-auth`. Without `--auth`, a random password is
generated and printed once on the console (stdout, never the log, so it cannot end up in a bug
report). Offline, Gradio cannot create a share link; we say so plainly and keep serving locally.

Only the outputs folder is added to Gradio's `allowed_paths`: generated images are served from
there; models and LoRAs are only ever addressed by name through the engine. The queue is bounded
(`--queue-size` for the app, `--session-queue-size` per session, `--account-queue-size` jobs per
login, the logins served in turn), REST routes cannot bypass it (`api_open=False`), uploads are
capped (`--max-upload-mib`, `--max-upload-files`, `--account-upload-quota-mib`), and `guard.py` adds what Gradio
lacks: the Host check in localhost mode, the login before any body is read, login backoff keyed on
the socket's peer (`trust_proxies`), body caps, UI-only handlers kept to the UI, no CORS.
"""

from __future__ import annotations

import functools
import html
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import gradio as gr
import psutil
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from app.a1111 import GATED_PREFIXES, api_gate, body_limits, install_api
from app.a1111.auth import api_logins
from app.accounts import Accounts
from app.diagnostics import RecentLogHandler
from app.engine.pool import make_engine
from app.engine.worker import Engine
from app.settings import Settings
from app.shown_paths import without_folders
from app.ui import default_checkpoint
from app.ui.app import build_app, launch_kwargs
from app.ui.common import UiContext, checkpoint_names
from app.ui.guard import UPLOAD, GuardPolicy, gradio_jobs, install, loopback_hosts
from app.ui.login_jobs import quota

log = logging.getLogger(__name__)
GENERATED_USER = "steady"
# Gradio keeps each session's copy of the page's config (about 0.57 MiB here) until it has this many,
# the least recently used first out (its default, 10,000, let one logged-in client make up sessions
# worth 5.6 GB); live pages stay recent through their status ticks. As many as `SessionStates` keeps.
STATE_SESSIONS = 512


@dataclass(frozen=True)
class AuthPolicy:
    """Logins Gradio must require; `generated_password` is set when we made one up."""

    credentials: tuple[tuple[str, str], ...]
    generated_password: str | None = None

    @property
    def required(self) -> bool:
        return bool(self.credentials)


def auth_policy(settings: Settings, token: str | None = None) -> AuthPolicy:
    """Explicit `--auth` wins; exposure (`--share`/`--listen`) without it gets a generated password."""
    if settings.auth:
        return AuthPolicy(tuple(settings.auth))
    if (settings.share or settings.listen) and not settings.no_auth:
        password = token or secrets.token_urlsafe(12)
        return AuthPolicy(((GENERATED_USER, password),), password)
    return AuthPolicy(())


@dataclass
class Server:
    """A running app: its local URL, whether a share link exists, and how to stop it."""

    demo: gr.Blocks
    local_url: str
    share_url: str | None
    policy: AuthPolicy
    ctx: UiContext | None = None

    def close(self) -> None:
        self.demo.close()
        if self.ctx is not None:
            self.ctx.shown_errors.detach()  # its errors stop counting with the app


def host_for(settings: Settings) -> str:
    """All interfaces only when asked (`--listen`); the default stays on loopback."""
    return "0.0.0.0" if settings.listen else "127.0.0.1"


def start_server(ctx: UiContext, policy: AuthPolicy) -> Server:
    """Build and launch the app without blocking; raises `OSError` when the port is taken. The logins decide
    the accounts and their admins (`app/accounts.py`); the checkpoint loaded now is the sessions' default."""
    settings = ctx.settings
    ctx.accounts = Accounts.from_logins(settings.admins, policy.credentials, api_logins(settings, policy.credentials))
    ctx.sessions.set_default_model(ctx.engine.snapshot().model)
    demo = build_app(ctx)
    demo.queue(default_concurrency_limit=1, max_size=settings.queue_size, api_open=False)
    settings.outputs_dir.mkdir(parents=True, exist_ok=True)
    app, local_url, share_url = demo.launch(
        server_name=host_for(settings), server_port=settings.port, share=settings.share,
        auth=list(policy.credentials) or None, auth_message="Steady Diffusion: log in to continue",
        allowed_paths=[str(settings.outputs_dir)], prevent_thread_lock=True, quiet=True, show_error=True,
        inbrowser=False, footer_links=["api", "settings"], ssr_mode=False, mcp_server=False, pwa=False,
        max_file_size=settings.max_upload_mib * 2**20, state_session_capacity=STATE_SESSIONS, **launch_kwargs())
    exposed = settings.listen or settings.share
    print(install_api(app, ctx, policy.credentials), flush=True)
    upload = (UPLOAD, settings.max_upload_mib * 2**20 + 2**16)  # one file and its multipart framing
    guard = GuardPolicy(None if exposed else loopback_hosts(demo.server_port), settings.session_queue_size,
                        quota(settings, policy.required), gated_prefixes=GATED_PREFIXES,
                        gate=api_gate(settings, policy.credentials), body_limits=(upload, *body_limits(settings)),
                        max_upload_files=settings.max_upload_files,
                        account_upload_quota=settings.account_upload_quota_mib << 20)
    install(app, demo, guard, ctx.login_jobs)
    count_jobs_by_account(ctx, demo)
    trust_proxies(demo.server.config, settings.forwarded_allow_ips)
    return Server(demo, local_url, share_url, policy, ctx)


def count_jobs_by_account(ctx: UiContext, demo: gr.Blocks) -> None:
    """Quotas and turns per login (`app/ui/login_jobs.py`): the UI's jobs are counted from Gradio's queue,
    and the engine serves the logins in turn."""
    ctx.login_jobs.gradio_jobs = functools.partial(gradio_jobs, demo)
    ctx.engine.take_turns_by(ctx.login_jobs.of_owner)


def trust_proxies(config, addresses: tuple[str, ...]) -> None:
    """Take a client's address from `X-Forwarded-For` only when the connection comes from one of
    `addresses` (`--forwarded-allow-ips`); otherwise the address is the socket's peer.

    uvicorn, as Gradio starts it, trusts the header from any loopback connection, and every reverse
    proxy, tunnel or script on the same machine connects from loopback: with a new header value per
    try, 300 password guesses went past the login throttle. uvicorn builds each connection's app
    from `config.loaded_app`, so replacing its outermost proxy-header layer applies from the next
    connection on.
    """
    app = config.loaded_app
    inner = app.app if isinstance(app, ProxyHeadersMiddleware) else app
    config.loaded_app = ProxyHeadersMiddleware(inner, trusted_hosts=list(addresses)) if addresses else inner


def wait_until_ready(url: str, timeout_s: float = 30.0) -> None:
    """Poll `/gradio_api/info` until it answers (200, or 401 when a login is required)."""
    deadline = time.monotonic() + timeout_s
    target = url.rstrip("/") + "/gradio_api/info"
    while True:
        try:
            with urllib.request.urlopen(target, timeout=2):
                return
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app did not answer at {target} within {timeout_s:.0f} s")
        time.sleep(0.2)


def install_log_capture() -> RecentLogHandler:
    """Keep recent log lines (for the bug report) from every logger of the process."""
    handler = RecentLogHandler()
    handler.setLevel(logging.INFO)
    logging.getLogger().addHandler(handler)
    return handler


def _ensure_demo(settings: Settings) -> None:
    if checkpoint_names(settings):
        return
    from app.adapters.synthetic import write_demo_loras
    from app.demo import write_demo

    print(f"No checkpoints in {settings.checkpoints_dir}: writing tiny random-weight demo models and LoRAs there.",
          flush=True)
    write_demo(settings.data_dir, lora_writer=write_demo_loras, folders=False, inpainting=True)


def port_problem(settings: Settings) -> str | None:
    """Why the port cannot be served on, or None. Checked before the model loads, so a busy port
    fails in a second instead of after a minute of loading. SO_REUSEADDR as uvicorn sets it, so a
    port left in TIME_WAIT by the last run does not count as busy."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host_for(settings), settings.port))
        except OSError as exc:
            return f"port {settings.port} on {host_for(settings)} is not free ({exc.strerror or exc})"
    return None


def load_first_working(engine: Engine, names: list[str], notes: list[str]) -> str | None:
    """Load the first of `names` that loads; each failure is logged in one line (the engine has
    logged its traceback) and the reasons go to `notes` for the page (files named relative to the
    data folder, as in every answer). Returns the loaded name."""
    failed = []
    for name in names:
        try:
            engine.load_model(name)
        except Exception as exc:  # recorded by the engine (history, last error); try the next one
            log.warning("checkpoint %s could not be loaded: %s", name, str(exc))
            reason = str(exc) if name in str(exc) else f"{name}: {exc}"
            failed.append(html.escape(without_folders(reason, engine.settings.data_dir)))
            continue
        if failed:
            notes.append(f"⚠ At start {len(failed)} checkpoint(s) would not load, so **{html.escape(name)}** was "
                         "loaded instead:\n\n" + "\n\n".join(f"- {reason}" for reason in failed))
        return name
    if failed:
        notes.append("⚠ No checkpoint could be loaded at start:\n\n" + "\n\n".join(f"- {r}" for r in failed))
    return None


def _load_in_background(ctx: UiContext, names: list[str]) -> None:
    """The UI opens at once; the status line shows LOADING until a model is in, the sessions' default then."""
    def load() -> None:
        ctx.sessions.set_default_model(load_first_working(ctx.engine, names, ctx.startup_notes))

    threading.Thread(target=load, name="initial-load", daemon=True).start()


def _announce(settings: Settings, server: Server) -> None:
    """Console lines for the user. The share link is printed once, never logged."""
    shown_host = "127.0.0.1" if not settings.listen else f"0.0.0.0 (all interfaces), port {settings.port}"
    print(f"Steady Diffusion is running at {server.local_url} (bound to {shown_host})", flush=True)
    if settings.share and server.share_url:
        print(f"Public share link (also protected by the login): {server.share_url}", flush=True)
    elif settings.share:
        print("Could not create a Gradio share link (no connection to the share server?). "
              f"Serving locally only, at {server.local_url}.", flush=True)
    policy = server.policy
    if policy.generated_password:
        print(f"Login required. user: {GENERATED_USER}  password: {policy.generated_password}\n"
              "(generated for this run and shown only once; choose your own with --auth user:pass, "
              "or allow open access with --no-auth)", flush=True)
    elif policy.required:
        print(f"Login required ({len(policy.credentials)} user(s) from --auth/--auth-file).", flush=True)


def serve(settings: Settings, initial_model: str | None = None, create_demo: bool = True) -> int:
    """Run the app until Ctrl+C; returns the process exit code.

    The ready line splits the process's CPU time at this call: before it, importing torch,
    diffusers and Gradio (their cost, the same for any app on them); after it, our own start
    (demo models, engine, UI, server), which is what a change here can make slower.
    """
    imports_cpu_s = time.process_time()
    problem = port_problem(settings)
    if problem:
        print(f"Cannot serve: {problem}. Choose another with --port, or stop what uses it.", flush=True)
        return 1
    log_capture = install_log_capture()
    if create_demo:
        _ensure_demo(settings)
    engine = make_engine(settings)  # one per --devices entry behind a dispatcher, else one
    names = checkpoint_names(settings)
    policy = auth_policy(settings)
    ctx = UiContext(engine, settings, log_capture.lines, tuple(p for _u, p in policy.credentials))
    if names:  # the asked-for checkpoint (else the one remembered from the last run) first, then the others
        first = initial_model or default_checkpoint.remembered(settings.default_checkpoint_file)
        asked = [first] if first and (first in names or initial_model) else []
        _load_in_background(ctx, asked + [n for n in names if n not in asked])
    else:
        print(f"No checkpoint found in {settings.checkpoints_dir}; add one and press ↻ in the UI.", flush=True)
    try:
        server = start_server(ctx, policy)
    except OSError as exc:
        print(f"Cannot serve on port {settings.port}: {exc}. Choose another with --port.", flush=True)
        engine.close()
        return 1
    _announce(settings, server)
    log.info("UI ready %.1f s after the process started (CPU: %.1f s importing libraries, %.1f s starting)",
             time.time() - psutil.Process().create_time(), imports_cpu_s, time.process_time() - imports_cpu_s)
    try:
        server.demo.block_thread()
    finally:
        engine.close()
    return 0
