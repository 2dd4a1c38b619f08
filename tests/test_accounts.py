"""Accounts on a shared server (issue 43, finding 6): one user's choices never reach another's.

One app served with three logins, `ann` (the admin: the first login listed), `bob` and `cat`, probed
as those users would: `gradio_client` sessions, raw A1111 API calls with basic auth, and the page's
own style-saving event. Each test says which promise it keeps.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from served_app import MODEL, free_port, make_ui_data, running_app

from app.accounts import LOCAL, Accounts
from app.settings import Settings
from app.styles import MAX_FILE_BYTES, MAX_STYLE_CHARS, MAX_STYLES, PromptStyle, account_file, csv_text
from app.ui.model_options import ADMIN_ONLY

gradio_client = pytest.importorskip("gradio_client")
LOGINS = (("ann", "pw-ann-1234"), ("bob", "pw-bob-1234"), ("cat", "pw-cat-1234"))
PASSWORDS = dict(LOGINS)
OTHER_MODEL = "tiny-sdxl.safetensors"
SMALL = dict(steps=2, width=64, height=64)
ADMIN_NEEDED = "needs an admin login"


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("accounts"), demo_dir)
    settings = Settings(data_dir=data, device="cpu", port=free_port(), auth=LOGINS)
    with running_app(settings) as (server, engine):
        yield server, engine, settings


def _client(app, user: str):
    return gradio_client.Client(app[0].local_url, auth=(user, PASSWORDS[user]), verbose=False)


def _generate(client, seed: int = 1) -> np.ndarray:
    images, _infotext, _details = client.predict(prompt="a fox", sampler="Euler", cfg=5.0, seed=seed,
                                                 api_name="/generate", **SMALL)
    with Image.open(images[0]["image"]) as image:
        return np.asarray(image.convert("RGB"))


def _api(app, user: str) -> httpx.Client:
    return httpx.Client(base_url=app[0].local_url.rstrip("/"), auth=(user, PASSWORDS[user]), timeout=120)


def _txt2img(api: httpx.Client, **fields) -> dict:
    response = api.post("/sdapi/v1/txt2img", json={"prompt": "a fox", "seed": 3, "sampler_name": "Euler",
                                                   "cfg_scale": 5.0, **SMALL, **fields})
    assert response.status_code == 200, response.text
    answer = response.json()
    answer["info"] = json.loads(answer["info"])
    return answer


def _pixels(answer: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))).convert("RGB"))


def test_a_session_that_chose_no_lora_draws_without_another_sessions_lora(app):
    """A `gradio_client` session that set no LoRA draws bit for bit the image it drew before another session
    set a LoRA (which changes that other session's image): the session starts from the app's defaults, not
    from whatever LoRA another session left in the engine."""
    bob, ann = _client(app, "bob"), _client(app, "ann")
    alone = _generate(bob)
    ann.predict([{"name": "style", "weight": 1.5}], api_name="/set_loras")
    assert [spec.name for spec in app[1].snapshot().desired.loras] == ["style"]  # the engine now holds ann's LoRA
    with_lora = _generate(ann)
    assert not np.array_equal(with_lora, alone)
    assert np.array_equal(_generate(bob), alone)
    ann.predict([], api_name="/set_loras")


def test_api_accounts_keep_their_own_checkpoint(app):
    """One A1111 API login's checkpoint (`POST /options`) is its own: another login that chose none keeps
    drawing on the app's default checkpoint, bit for bit as before, and reads that one in its options."""
    bob, cat = _api(app, "bob"), _api(app, "cat")
    before = _txt2img(cat)
    assert bob.post("/sdapi/v1/options", json={"sd_model_checkpoint": OTHER_MODEL}).status_code == 200
    assert _txt2img(bob)["info"]["sd_model_name"] == "tiny-sdxl"
    after = _txt2img(cat)
    assert after["info"]["sd_model_name"] == "tiny-sd15" and np.array_equal(_pixels(after), _pixels(before))
    assert cat.get("/sdapi/v1/options").json()["sd_model_checkpoint"].startswith(MODEL)
    assert bob.get("/sdapi/v1/options").json()["sd_model_checkpoint"].startswith(OTHER_MODEL)
    assert bob.post("/sdapi/v1/options", json={"sd_model_checkpoint": MODEL}).status_code == 200


def test_engine_wide_switches_of_the_gradio_api_are_an_admins_only(app):
    """`/unload`, `/set_debug`, `/set_offload`, `/set_dtype`, `/set_weights`, `/set_model_parts`,
    `/set_lora_partial` and `any_owner` on `/interrupt` and `/skip` are refused to a login that is not an
    admin, with a message saying an admin login is needed, and change nothing; the admin's work."""
    _server, engine, settings = app
    bob, ann = _client(app, "bob"), _client(app, "ann")
    calls = {"/unload": (), "/set_debug": (True, True, True), "/set_offload": ("model",), "/set_dtype": ("bf16",),
             "/set_weights": ("fp8",), "/set_model_parts": ({"vae": None},), "/set_lora_partial": ("partial", True),
             "/interrupt": (True, True), "/skip": (True,)}
    for name, args in calls.items():
        with pytest.raises(Exception, match=ADMIN_NEEDED):
            bob.predict(*args, api_name=name)
    snap = engine.snapshot()
    assert (snap.model, snap.offload, snap.requested_dtype, snap.weights) == (MODEL, "none", "auto", "full")
    assert not engine.settings.lora_debug and not settings.lora_options_file.exists()
    assert ann.predict(True, False, False, api_name="/set_debug")["lora_debug"] is True
    assert ann.predict(False, False, False, api_name="/set_debug")["lora_debug"] is False
    ann.predict("partial", True, api_name="/set_lora_partial")
    assert "partial" in settings.lora_options_file.read_text()
    assert ann.predict(True, True, api_name="/interrupt")["stopped"] is False  # nothing runs: allowed, no-op
    assert ann.predict(api_name="/unload")["model"] is None
    engine.load_model(MODEL)


def _slow_job(api: httpx.Client, out: list) -> None:
    out.append(_txt2img(api, steps=150, width=256, height=256))


def _while_running(engine, start, act) -> None:
    """Start a job in a thread; once the engine denoises it, `act()`; then wait for the job."""
    thread = threading.Thread(target=start)
    thread.start()
    deadline = time.monotonic() + 60
    while not ((snap := engine.snapshot()).generating and snap.progress and snap.progress.step > 0):
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.02)
    act()
    thread.join(300)


def test_engine_wide_a1111_routes_are_an_admins_only(app):
    """`unload-checkpoint`, `reload-checkpoint` and a change of `steady_dtype`/`steady_offload` answer 403 to
    a login that is not an admin (sending them back unchanged, as Open WebUI does, is fine); its Interrupt
    does not stop another login's job, while the admin's Interrupt stops whatever runs."""
    _server, engine, _settings = app
    bob, ann = _api(app, "bob"), _api(app, "ann")
    refusals = [bob.post("/sdapi/v1/unload-checkpoint"), bob.post("/sdapi/v1/reload-checkpoint"),
                bob.post("/sdapi/v1/options", json={"steady_offload": "model"}),
                bob.post("/sdapi/v1/options", json={"steady_dtype": "fp32"})]
    for response in refusals:
        assert response.status_code == 403 and ADMIN_NEEDED in response.json()["detail"], response.text
    assert engine.snapshot().model == MODEL and engine.snapshot().offload == "none"
    assert bob.post("/sdapi/v1/options", json=bob.get("/sdapi/v1/options").json()).status_code == 200
    anns: list[dict] = []
    _while_running(engine, lambda: _slow_job(ann, anns), lambda: bob.post("/sdapi/v1/interrupt"))
    assert anns[0]["info"]["interrupted"] is False
    bobs: list[dict] = []
    _while_running(engine, lambda: _slow_job(bob, bobs), lambda: ann.post("/sdapi/v1/interrupt"))
    assert bobs[0]["info"]["interrupted"] is True
    assert ann.post("/sdapi/v1/unload-checkpoint").status_code == 200 and engine.snapshot().model is None
    assert ann.post("/sdapi/v1/reload-checkpoint").status_code == 200 and engine.snapshot().model == MODEL


# ------------------------------------------------------------------------------------------------ styles
def _page(app, user: str) -> httpx.Client:
    client = httpx.Client(base_url=app[0].local_url.rstrip("/"), timeout=60,
                          headers={"Sec-Fetch-Site": "same-origin"})
    assert client.post("/login", data={"username": user, "password": PASSWORDS[user]}).status_code == 200
    return client


def _page_event(app, user: str, handler: str, data: list, outputs: int | None = None) -> dict:
    """Run the page's event `handler` (by its function's name, and its number of `outputs` where two share a
    name) as `user`'s page does (its login cookie, a same-origin request naming the event's component);
    returns Gradio's `process_completed` message."""
    demo = app[0].demo
    index = next(i for i, fn in demo.fns.items()
                 if fn.name == handler and outputs in (None, len(fn.outputs)))
    session = f"{user}-{time.monotonic_ns()}"
    page = _page(app, user)
    try:
        joined = page.post("/gradio_api/queue/join", json={
            "data": data, "fn_index": index, "session_hash": session, "trigger_id": demo.fns[index].targets[0][0]})
        assert joined.status_code == 200, joined.text
        with page.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as events:
            for line in events.iter_lines():
                message = json.loads(line[5:]) if line.startswith("data:") else {}
                if message.get("msg") == "process_completed":
                    return message
    finally:
        page.close()
    raise AssertionError(f"{handler} never completed")


def _save_style(app, user: str, name: str, prompt: str) -> dict:
    """Press the Generate tab's "Save as style" as `user`'s page does."""
    return _page_event(app, user, "ui_save", [name, prompt, "", []])


def test_the_pages_engine_wide_controls_are_an_admins_only(app):
    """The page's own handlers for the debug switches, Unload, dtype, offload and weight storage refuse a login
    that is not an admin, saying an admin login is needed, and change nothing; the page shows the Diagnostics
    tab's switches and Unload greyed out to it, saying why; the admin's are usable and its toggle works."""
    _server, engine, _settings = app
    for handler, data in (("toggle", [True, True, True, False]), ("free_memory", []), ("ui_set_dtype", ["fp32"]),
                          ("ui_set_offload", ["model"]), ("ui_set_weights", ["fp8"])):
        refused = _page_event(app, "bob", handler, data)
        assert not refused["success"] and ADMIN_NEEDED in refused["output"]["error"], (handler, refused)
    snap = engine.snapshot()
    assert (snap.model, snap.offload, snap.requested_dtype, snap.weights) == (MODEL, "none", "auto", "full")
    assert not engine.settings.lora_debug
    for user, admin in (("bob", False), ("ann", True)):  # on page load: greyed out for bob, usable for ann
        shown = _page_event(app, user, "on_load", [], outputs=5)["output"]["data"]  # 4 switches and Unload
        assert [update["interactive"] for update in shown] == [admin] * 5
        assert [update.get("info") for update in shown[:4]] == [None if admin else ADMIN_ONLY] * 4
    assert _page_event(app, "ann", "toggle", [True, False, False, False])["success"]
    assert engine.settings.lora_debug
    assert _page_event(app, "ann", "toggle", [False, False, False, False])["success"]


def _styles_of(app, user: str) -> dict[str, str]:
    with _api(app, user) as api:
        return {s["name"]: s["prompt"] for s in api.get("/sdapi/v1/prompt-styles").json()}


def test_a_login_cannot_overwrite_another_accounts_style(app):
    """The admin's save goes to the shared `styles.csv`, seen by everyone; another login's save of the same
    name goes to its own styles only: the shared one stays, and a third login still sees and applies the
    shared one (a style with a LoRA tag saved by one login never reaches another login's prompts)."""
    settings = app[2]
    assert _save_style(app, "ann", "look", "framed, {prompt}")["success"]
    assert _save_style(app, "bob", "look", "<lora:style:1>, {prompt}")["success"]
    assert _save_style(app, "bob", "mine", "bob's own")["success"]
    assert "<lora" not in settings.styles_file.read_text(encoding="utf-8-sig")
    assert _styles_of(app, "bob") == {"look": "<lora:style:1>, {prompt}", "mine": "bob's own"}
    assert _styles_of(app, "cat") == {"look": "framed, {prompt}"}
    with _api(app, "cat") as cat:
        assert _txt2img(cat, styles=["look"])["info"]["prompt"] == "framed, a fox"
        refused = cat.post("/sdapi/v1/txt2img", json={"prompt": "a fox", "styles": ["mine"], **SMALL})
        assert refused.status_code == 422 and "unknown style" in refused.json()["detail"]


def test_styles_are_capped_in_count_and_size_with_the_cap_named(app):
    """A save past a cap is refused with the cap named and writes nothing: a style's text over
    `MAX_STYLE_CHARS`, a file already holding `MAX_STYLES`, a file that would pass `MAX_FILE_BYTES`."""
    own = account_file(app[2].data_dir, "cat")
    refused = _save_style(app, "cat", "long", "x" * (MAX_STYLE_CHARS + 1))
    assert not refused["success"] and f"{MAX_STYLE_CHARS:,} characters" in refused["output"]["error"]
    own.parent.mkdir(parents=True, exist_ok=True)
    for count, size, cap in ((MAX_STYLES, 1, f"({MAX_STYLES})"),
                             (MAX_FILE_BYTES // MAX_STYLE_CHARS, MAX_STYLE_CHARS, f"{MAX_FILE_BYTES:,} allowed")):
        own.write_text(csv_text(PromptStyle(f"s{i}", "y" * size, "") for i in range(count)), encoding="utf-8-sig")
        before = own.read_bytes()
        refused = _save_style(app, "cat", "one-more", "z" * MAX_STYLE_CHARS)
        assert not refused["success"] and cap in refused["output"]["error"], refused["output"]
        assert own.read_bytes() == before
    own.unlink()


# --------------------------------------------------------------------------------------------- who is admin
def test_the_first_login_is_the_admin_unless_admin_names_others():
    """Without `--admin` the first login listed is the admin (the UI's, then the API's); `--admin` names
    them (for API logins too); with no login the local user is; an `--admin` that is no login is refused."""
    ui, api = (("ann", "p"), ("bob", "p")), (("robot", "p"),)
    first = Accounts.from_logins((), ui, api)
    assert first.ui("ann").admin and not first.ui("bob").admin and not first.api("robot").admin
    named = Accounts.from_logins(("bob", "robot"), ui, api)
    assert named.ui("bob").admin and named.api("robot").admin and not named.ui("ann").admin
    assert Accounts.from_logins((), (), api).api("robot").admin
    assert Accounts().ui(None).name == LOCAL and Accounts().ui(None).admin and Accounts().api("x").admin
    assert not first.ui(None).admin  # behind a login a request without one is nobody's admin
    with pytest.raises(ValueError, match="--admin 'eve': not a login"):
        Settings(auth=ui, admins=("eve",))
    from launch import build_parser, settings_from_args

    args = build_parser().parse_args(["--auth", "ann:p", "--api-auth", "robot:p", "--admin", "robot"])
    assert settings_from_args(args).admins == ("robot",)
