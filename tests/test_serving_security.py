"""Safe to share (issue 14), the serving side: one app with a login in localhost mode, probed as an
attacker on a share link would (only ever this local app).

Covers finding 7 (login backoff, password from the environment, Host check against DNS
rebinding without CORS echo, upload cap, UI-only handlers kept to the page, bug-report paths
relative to the data folder), the queue bounds of finding 5 and `/list_loras` with a non-UTF-8
file name (finding 4).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from served_app import MODEL, free_port, make_ui_data, running_app

from app.engine.worker import EngineState
from app.report import build_bug_report
from app.settings import Settings
from app.ui import login_throttle
from app.ui.guard import MAX_BODY_BYTES
from app.ui.login_throttle import LoginThrottle

gradio_client = pytest.importorskip("gradio_client")
USER, PASSWORD = "alice", "correct-horse-battery"
BAD_NAME = b"\xff\xfe-not-utf8.safetensors"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    """The app on the tiny demo model, a login required, a non-UTF-8 checkpoint and LoRA present at start."""
    data = make_ui_data(tmp_path_factory.mktemp("serving"), demo_dir)
    for folder in ("models/Stable-diffusion", "models/Lora"):
        os.link(data / "models" / "Lora" / "style.safetensors", os.path.join(os.fsencode(data / folder), BAD_NAME))
    settings = Settings(data_dir=data, device="cpu", port=free_port(), auth=((USER, PASSWORD),), max_upload_mib=1,
                        session_queue_size=3)
    with running_app(settings) as (server, engine):
        yield server, engine, settings


def _http(app, address: str = "127.0.0.1", login: bool = True) -> httpx.Client:
    """A raw HTTP client connecting from `address` (any 127.x address is this machine's loopback, and
    the login throttle keys on the connection's own address)."""
    client = httpx.Client(base_url=app[0].local_url, timeout=30,
                          transport=httpx.HTTPTransport(local_address=address))
    if login:
        assert client.post("/login", data={"username": USER, "password": PASSWORD}).status_code == 200
    return client


def _fn_index(app, name: str) -> int:
    return next(i for i, fn in app[0].demo.fns.items() if fn.api_name == name)


def _join(client: httpx.Client, fn_index: int, session: str = "s1", data=(), trigger: int | None = None,
          **headers) -> httpx.Response:
    return client.post("/gradio_api/queue/join", headers=headers,
                       json={"data": list(data), "fn_index": fn_index, "session_hash": session, "trigger_id": trigger})


def _trigger(app, fn_index: int) -> int:
    """The component whose event runs the handler (what Gradio's page sends as `trigger_id`)."""
    return app[0].demo.fns[fn_index].targets[0][0]


# ------------------------------------------------------------------------------------ login
def test_throttle_gives_free_tries_then_doubles_the_wait_up_to_a_cap():
    """5 free tries, then 1, 2, 4 … s between attempts up to 300 s; a success clears the address."""
    throttle, now = LoginThrottle(), 1000.0
    assert [throttle.begin("a", now) for _ in range(5)] == [0.0] * 5
    assert throttle.begin("a", now) == 1.0
    waits = []
    for _ in range(12):
        now += throttle.begin("a", now)
        assert throttle.begin("a", now) == 0.0
        waits.append(throttle.begin("a", now))
    assert waits[:4] == [2.0, 4.0, 8.0, 16.0] and waits[-1] == login_throttle.MAX_DELAY_S
    assert throttle.begin("b", now) == 0.0  # per address
    throttle.succeeded("a")
    assert throttle.begin("a", now) == 0.0


def test_throttle_memory_is_bounded(monkeypatch):
    """An attacker rotating addresses cannot grow the table past its bound."""
    monkeypatch.setattr(login_throttle, "MAX_ADDRESSES", 100)
    throttle = LoginThrottle()
    for i in range(1000):
        throttle.begin(f"10.0.{i // 250}.{i % 250}", 0.0)
    assert len(throttle._records) == 100


def test_wrong_passwords_are_throttled_per_address_and_others_can_still_log_in(app):
    """870 wrong passwords a second were accepted; now an address gets 5 tries, then 429 with
    Retry-After, even for the right password. Another address logs in normally."""
    attacker = _http(app, "127.0.0.66", login=False)
    codes = [attacker.post("/login", data={"username": USER, "password": f"guess{i}"}).status_code
             for i in range(40)]
    assert codes[:5] == [400] * 5 and set(codes[5:]) == {429}
    refused = attacker.post("/login", data={"username": USER, "password": PASSWORD})
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "too many failed logins from 127.0.0.66" in refused.json()["detail"]
    _http(app, "127.0.0.67")  # logs in (asserted inside)


def test_password_can_come_from_an_environment_variable(monkeypatch):
    """`--auth-env VAR` reads user:password from VAR (nothing secret on the command line, so
    nothing in `ps`) and removes VAR so child processes (the share tunnel) do not inherit it."""
    from launch import build_parser, settings_from_args

    monkeypatch.setenv("SD_TEST_AUTH", f"{USER}:{PASSWORD}\nbob:builder-pw")
    settings = settings_from_args(build_parser().parse_args(["--auth-env", "SD_TEST_AUTH"]))
    assert settings.auth == ((USER, PASSWORD), ("bob", "builder-pw"))
    assert "SD_TEST_AUTH" not in os.environ
    with pytest.raises(SystemExit, match="--auth-env SD_TEST_AUTH: that environment variable is not set"):
        settings_from_args(build_parser().parse_args(["--auth-env", "SD_TEST_AUTH"]))


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="Linux's /proc shows the start-up environment")
def test_the_password_leaves_proc_environ_too():
    """`os.environ.pop` left the password in `/proc/PID/environ` (the kernel shows the environment the
    process started with); the start-up copy is wiped as well (issue 28, finding 9)."""
    code = ("import os, app.logins; app.logins.parse_auth([], None, 'SD_TEST_AUTH');"
            "print(b'hunter22' in open('/proc/self/environ', 'rb').read(), 'SD_TEST_AUTH' in os.environ)")
    env = dict(os.environ, SD_TEST_AUTH="bob:hunter22", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr[-2000:]


# ------------------------------------------------------------------------------- Host, CORS
@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}", "0.0.0.0:{port}"])
def test_foreign_host_is_refused_without_cors_echo(app, host):
    """DNS rebinding: in localhost mode a request naming another host is refused before Gradio
    sees it, and no Access-Control-Allow-Origin echoes the attacker's origin."""
    port = app[0].demo.server_port
    host = host.format(port=port)
    response = httpx.get(app[0].local_url + "gradio_api/info", headers={"Host": host, "Origin": f"http://{host}"})
    assert response.status_code == 403 and "answers only to" in response.json()["detail"]
    assert "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost"])
def test_bound_host_names_are_served(app, name):
    port = app[0].demo.server_port
    assert httpx.get(f"http://127.0.0.1:{port}/", headers={"Host": f"{name}:{port}"}).status_code == 200


# ------------------------------------------------------------------------ UI-only handlers
def test_ui_only_handlers_are_refused_to_scripts_and_cross_site_pages(app):
    """`free_memory` (the Diagnostics tab's unload) by fn_index or by its route name, from a script
    or a cross-site page, is refused: the model stays loaded. A logged-in script that fakes the
    page's `Sec-Fetch-Site: same-origin` is refused too unless it names the button's own event."""
    client = _http(app)
    unload = _fn_index(app, "free_memory")
    for response in (_join(client, unload), client.post("/gradio_api/call/free_memory", json={"data": []})):
        assert response.status_code == 403 and "belongs to the app's page" in response.json()["detail"]
    for response in (_join(client, unload, **{"Sec-Fetch-Site": "cross-site"}),
                     _join(client, unload, Origin="http://evil.example")):
        assert response.status_code == 403 and "another site" in response.json()["detail"]
    other = _trigger(app, _fn_index(app, "toggle"))
    for trigger in (None, other):
        faked = _join(client, unload, trigger=trigger, **{"Sec-Fetch-Site": "same-origin"})
        assert faked.status_code == 403 and "runs only for its own events" in faked.json()["detail"]
    assert app[1].snapshot().state == EngineState.READY.value and app[1].snapshot().model == MODEL


def test_ui_only_handlers_still_run_for_the_apps_own_page(app):
    """The page's own calls (Sec-Fetch-Site: same-origin, or Origin equal to Host over plain HTTP)
    are accepted: here the debug toggle, which changes no tensor."""
    client = _http(app)
    toggle = _fn_index(app, "toggle")
    port, box = app[0].demo.server_port, _trigger(app, toggle)
    engine = app[1]
    for session, on, headers in (("page1", True, {"Sec-Fetch-Site": "same-origin"}),
                                 ("page2", False, {"Origin": f"http://127.0.0.1:{port}"})):
        switches = [on, False, False, False]  # LoRA debug, move debug, strict, strict forwards
        response = _join(client, toggle, session=session, data=switches, trigger=box, **headers)
        assert response.status_code == 200 and "event_id" in response.json()
        deadline = time.monotonic() + 30
        while engine.settings.lora_debug is not on:  # the handler ran: the engine has the switch as sent
            assert time.monotonic() < deadline, f"the page's own call ({headers}) never ran"
            time.sleep(0.05)


def test_documented_api_keeps_working_for_scripts(app):
    """gradio_client through the login: the public endpoints answer as before."""
    client = gradio_client.Client(app[0].local_url, auth=(USER, PASSWORD), verbose=False)
    assert client.predict(api_name="/snapshot")["state"] == EngineState.READY.value


# -------------------------------------------------------------------------- bounded requests
def test_request_bodies_over_the_cap_are_refused(app):
    """A JSON body over 1 MiB (a 1 MB LoRA name, a 10 MB prompt) is refused before Gradio parses it."""
    response = _join(_http(app), _fn_index(app, "set_loras"), data=[[{"name": "x" * (MAX_BODY_BYTES + 1)}]])
    assert response.status_code == 413 and "request body over 1,048,576 bytes" in response.json()["detail"]


def test_one_session_cannot_fill_the_queue(app):
    """Requests one session joins but never collects stay pending; past `session_queue_size` (3
    here) the session is refused with the limit named, while another session is still served."""
    client = _http(app)
    snapshot = _fn_index(app, "snapshot")
    codes = [_join(client, snapshot, session="greedy").status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]
    refused = _join(client, snapshot, session="greedy")
    assert "already has 3 requests pending" in refused.json()["detail"]
    assert _join(client, snapshot, session="polite").status_code == 200


def test_the_app_queue_is_bounded_and_rest_routes_cannot_bypass_it(app):
    """`max_size` bounds the whole queue; `/run/<name>` (which skips the queue) is closed."""
    assert app[0].demo._queue.max_size == app[2].queue_size
    response = _http(app).post("/gradio_api/run/snapshot", json={"data": []})
    assert response.status_code == 404 and "does not accept direct HTTP POST" in response.text


def test_uploads_over_the_cap_are_refused(app):
    """`/upload` took 300 MB; now anything over `max_upload_mib` (1 MiB here) is refused."""
    response = _http(app).post("/gradio_api/upload", files={"files": ("big.bin", b"\0" * (2 << 20))})
    assert response.status_code == 413


def test_prompt_over_the_cap_is_refused_through_the_api(app):
    """A prompt past the cap is refused with the limit in the message; the engine never runs it."""
    client = gradio_client.Client(app[0].local_url, auth=(USER, PASSWORD), verbose=False)
    with pytest.raises(Exception, match="the limit is 16,000 characters"):
        client.predict(prompt="x" * 20_000, api_name="/generate")


# --------------------------------------------------------------------------- names and report
def test_non_utf8_names_neither_stop_the_app_nor_break_listings(app):
    """The app started with a non-UTF-8 checkpoint and LoRA present; a second one added while it
    runs is skipped too, and the listings still answer."""
    os.link(app[2].lora_dir / "style.safetensors", os.path.join(os.fsencode(app[2].lora_dir), b"\xe9t\xe9.safetensors"))
    client = gradio_client.Client(app[0].local_url, auth=(USER, PASSWORD), verbose=False)
    assert "style" in client.predict(api_name="/list_loras")
    assert MODEL in client.predict(api_name="/list_models")


def test_bug_report_paths_are_relative_to_the_data_folder(app):
    """The bundle carried absolute paths; now paths under the data folder are relative to it."""
    server, engine, settings = app
    with pytest.raises(ValueError, match="not found in"):
        engine.load_model("no-such-model.safetensors")
    with zipfile.ZipFile(io.BytesIO(build_bug_report(engine, settings))) as bundle:
        text = bundle.read("report.json").decode()
    assert str(settings.data_dir) not in text
    assert "not found in models/Stable-diffusion" in text and json.loads(text)["settings"]["data_dir"] == "."


def test_bug_report_tracebacks_do_not_show_where_the_app_and_python_live(app):
    """Tracebacks named the install folders in every line (the user's name, their layout); they read
    `<app>/…`, `<site-packages>/…` now (issue 28, finding 9)."""
    server, engine, settings = app
    with pytest.raises(ValueError):
        engine.load_model("no-such-model.safetensors")
    with zipfile.ZipFile(io.BytesIO(build_bug_report(engine, settings))) as bundle:
        text = bundle.read("report.json").decode()
    assert 'File \\"<app>/app/engine/' in text and str(ROOT) not in text and sys.prefix not in text


def test_a_client_that_goes_away_mid_answer_is_one_log_line_not_a_traceback(caplog):
    """A page closed while its answer streams: Starlette raises `ClientDisconnect` (a send that fails), which
    reached the server as an "Exception in ASGI application" traceback; the guard says it in one line instead."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from starlette.responses import StreamingResponse

    from app.ui.guard import GuardPolicy, RequestGuard

    async def gone(_message: dict) -> None:
        raise OSError("connection reset by peer")

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    answer = StreamingResponse(iter([b"data: 1\n\n", b"data: 2\n\n"]), media_type="text/event-stream")
    guard = RequestGuard(answer, SimpleNamespace(), GuardPolicy(None, 8))
    scope = {"type": "http", "method": "GET", "path": "/gradio_api/queue/data", "headers": [],
             "query_string": b"", "asgi": {"spec_version": "2.4"}}
    caplog.set_level(logging.INFO, logger="app.ui.guard")
    asyncio.run(guard(scope, receive, gone))  # raises nothing
    said = [r for r in caplog.records if r.name == "app.ui.guard"]
    assert [r.getMessage() for r in said] == ["client went away during GET /gradio_api/queue/data; its request "
                                              "was dropped"]
    assert all(r.exc_info is None for r in said)
