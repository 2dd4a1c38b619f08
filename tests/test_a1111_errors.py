"""The A1111 API's refusals and its login: A1111's error shape, the UI's limits, never a traceback.

Served apps as in `test_a1111_api.py`: one on loopback without a login for the unhappy paths, one
behind the UI's login, one with separate `--api-auth` logins; the serving policy and the lane's
backlog cap are checked without a server.
"""

from __future__ import annotations

import base64
import io

import anyio
import pytest
import requests
from fastapi import FastAPI
from PIL import Image
from served_app import MODEL, free_port, make_ui_data, running_app

from app.a1111 import install_api
from app.a1111.errors import ApiError
from app.a1111.state import ApiState
from app.settings import Settings
from app.ui.common import UiContext
from app.ui.login_jobs import Quota

webuiapi = pytest.importorskip("webuiapi")
ERROR_KEYS = {"error", "detail", "body", "errors"}
SMALL = {"prompt": "a fox", "steps": 2, "width": 64, "height": 64}


def _serve(tmp_path_factory, demo_dir, **settings):
    data = make_ui_data(tmp_path_factory.mktemp("a1111-errors"), demo_dir)
    return running_app(Settings(data_dir=data, device="cpu", port=free_port(), **settings))


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    with _serve(tmp_path_factory, demo_dir) as (server, engine):
        yield server.local_url.rstrip("/"), engine


def _refused(answer: requests.Response, status: int, *words: str) -> dict:
    """An A1111-shaped refusal with `status` whose detail names `words`, and nothing of a traceback."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == ERROR_KEYS, body
    assert "Traceback" not in answer.text and 'File "' not in answer.text
    for word in words:
        assert word in str(body["detail"]), body
    return body


@pytest.mark.parametrize(("change", "status", "words"), [
    ({"sampler_name": "Bogus"}, 400, ("Sampler not found", "Euler a")),
    ({"sampler_name": "Euler", "scheduler": "Exponential"}, 400, ("Scheduler not found", "karras")),
    ({"sampler_name": "Euler", "scheduler": "Karras"}, 400, ("no Karras schedule", "DPM++ 2M")),
    ({"steps": 151}, 422, ("steps", "1…150")),
    ({"steps": 0, "cfg_scale": 31}, 422, ("steps", "cfg")),
    ({"width": 4096}, 422, ("width", "64…2048")),
    ({"batch_size": 16, "width": 2048, "height": 2048, "steps": 150}, 422, ("per-request cap",)),
    ({"prompt": "x" * 16_001}, 422, ("16,000 characters",)),
    ({"enable_hr": True, "hr_resize_x": 256}, 422, ("hires fix to a fixed size",)),
    ({"restore_faces": True}, 422, ("face restoration needs", "models/GFPGAN or models/Codeformer")),
    ({"enable_hr": True, "hr_scale": 5}, 422, ("hires_scale", "1…4")),
    ({"enable_hr": True, "hr_upscaler": "R-ESRGAN 4x+"}, 422, ("unknown hires upscaler", "Lanczos")),
    ({"enable_hr": True, "denoising_strength": 0.1}, 422, ("run no step",)),
    ({"override_settings": {"sd_model_checkpoint": "no-such-model"}}, 404, ("Model not found", MODEL)),
])
def test_bad_txt2img_requests_are_refused_in_a1111s_shape(app, change, status, words):
    body = _refused(requests.post(f"{app[0]}/sdapi/v1/txt2img", json={**SMALL, **change}), status, *words)
    assert body["error"] in ("HTTPException", "ValueError", "LoraApplyError", "FaceModelError")
    assert app[1].snapshot().model == MODEL and app[1].snapshot().loras == ()  # nothing was changed


def test_wrong_types_are_refused_with_the_field_named(app):
    body = _refused(requests.post(f"{app[0]}/sdapi/v1/txt2img", json={**SMALL, "steps": "many"}), 422)
    assert body["error"] == "RequestValidationError" and body["detail"][0]["loc"] == ["body", "steps"]
    assert body["errors"].startswith("body.steps:")


def test_webuiapi_sees_the_refusal(app):
    api = webuiapi.WebUIApi(baseurl=f"{app[0]}/sdapi/v1")
    with pytest.raises(RuntimeError) as caught:
        api.txt2img(prompt="a fox", sampler_name="Bogus", steps=2, width=64, height=64)
    assert caught.value.args[0] == 400 and "Sampler not found" in caught.value.args[1]


def test_other_refusals(app):
    url = f"{app[0]}/sdapi/v1"
    _refused(requests.post(f"{url}/img2img", json={**SMALL, "init_images": []}), 422, "init_images")
    _refused(requests.post(f"{url}/img2img", json={**SMALL, "init_images": ["not base64!"]}), 422,
             "Invalid encoded image")
    picture = base64.b64encode(_png_bytes()).decode()
    _refused(requests.post(f"{url}/img2img", json={**SMALL, "init_images": [picture], "denoising_strength": 1.5}),
             422, "denoising_strength")
    _refused(requests.post(f"{url}/img2img", json={**SMALL, "init_images": [picture], "mask": picture,
                                                   "resize_mode": 7}), 422, "resize mode")
    _refused(requests.post(f"{url}/png-info", json={"image": "not base64!"}), 422, "Invalid encoded image")
    _refused(requests.post(f"{url}/png-info", json={"image": "aGVsbG8="}), 422, "Invalid encoded image")
    _refused(requests.post(f"{url}/options", json={"sd_model_checkpoint": "nope"}), 404, "Model not found")
    _refused(requests.post(f"{url}/options", json={"CLIP_stop_at_last_layers": 13, "sd_model_checkpoint": "tiny-sdxl"}),
             422, "CLIP_stop_at_last_layers must be a whole number in 1…12", "nothing changed")
    _refused(requests.post(f"{url}/options", json={"no_such_option": 1}), 422, "no_such_option (unknown here)")
    _refused(requests.post(f"{url}/options", json={"steady_offload": "sideways"}), 422, "offload must be one of")
    assert app[1].snapshot().model == MODEL and app[1].snapshot().offload == "none"


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_cross_site_page_cannot_drive_the_api(app):
    answer = requests.post(f"{app[0]}/sdapi/v1/interrupt", headers={"Sec-Fetch-Site": "cross-site"})
    _refused(answer, 403, "cross-site")
    assert requests.post(f"{app[0]}/sdapi/v1/interrupt", headers={"Sec-Fetch-Site": "none"}).status_code == 200


def test_a_cross_origin_post_without_sec_fetch_site_is_refused_whatever_its_content_type(app):
    """Localhost mode without a login (issue 28): a page of another site may POST text/plain without a
    preflight, and over plain HTTP its browser sends no Sec-Fetch-Site; its Origin refuses it, for
    the API and the UI's routes alike. The app's own origin passes."""
    for path in ("/sdapi/v1/unload-checkpoint", "/sdapi/v1/interrupt", "/gradio_api/queue/join"):
        answer = requests.post(f"{app[0]}{path}", data="{}", headers={"Origin": "http://evil.example",
                                                                      "Content-Type": "text/plain"})
        assert answer.status_code == 403 and "site" in answer.text
    assert app[1].snapshot().model == MODEL
    assert requests.post(f"{app[0]}/sdapi/v1/interrupt", headers={"Origin": app[0]}).status_code == 200


def test_a_foreign_host_is_refused_by_the_guard(app):
    assert requests.get(f"{app[0]}/sdapi/v1/options", headers={"Host": "evil.example:80"}).status_code == 403


def test_the_ui_login_protects_the_api(tmp_path_factory, demo_dir):
    with _serve(tmp_path_factory, demo_dir, auth=(("alice", "s3cret-pw"),)) as (server, _engine):
        url = f"{server.local_url.rstrip('/')}/sdapi/v1"
        missing = requests.get(f"{url}/options")
        _refused(missing, 401, "Not authenticated")
        assert missing.headers["www-authenticate"].startswith("Basic")
        _refused(requests.get(f"{url}/options", auth=("alice", "wrong")), 401, "Incorrect username or password")
        _refused(requests.get(f"{server.local_url.rstrip('/')}/steady/v1/snapshot"), 401)
        assert requests.get(f"{url}/options", auth=("alice", "s3cret-pw")).status_code == 200
        api = webuiapi.WebUIApi(baseurl=url, username="alice", password="s3cret-pw")
        assert len(api.txt2img(prompt="a fox", steps=2, width=64, height=64).images) == 1
        report = requests.get(f"{server.local_url.rstrip('/')}/steady/v1/bug-report", auth=("alice", "s3cret-pw"))
        assert report.status_code == 200 and b"s3cret-pw" not in report.content


def test_api_auth_gives_the_api_its_own_logins(tmp_path_factory, demo_dir):
    settings = dict(auth=(("alice", "ui-password"),), api_auth=(("bot", "api-password"),))
    with _serve(tmp_path_factory, demo_dir, **settings) as (server, _engine):
        url = f"{server.local_url.rstrip('/')}/sdapi/v1"
        _refused(requests.get(f"{url}/sd-models", auth=("alice", "ui-password")), 401)
        assert requests.get(f"{url}/sd-models", auth=("bot", "api-password")).status_code == 200


def test_failed_api_logins_are_throttled(tmp_path_factory, demo_dir):
    with _serve(tmp_path_factory, demo_dir, auth=(("alice", "s3cret-pw"),)) as (server, _engine):
        url = f"{server.local_url.rstrip('/')}/sdapi/v1/options"
        codes = [requests.get(url, auth=("alice", f"guess-{i}")).status_code for i in range(8)]
        assert codes[:5] == [401] * 5 and 429 in codes[5:]
        throttled = requests.get(url, auth=("alice", "s3cret-pw"))
        assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) >= 1


@pytest.mark.parametrize(("settings", "served"), [
    ({}, True),  # loopback without a login
    ({"listen": True, "no_auth": True}, False),  # reachable by others without a login
    ({"listen": True, "no_auth": True, "api": True}, True),  # ... unless asked for
    ({"share": True, "no_auth": True, "api_auth": (("bot", "pw"),)}, True),  # ... or behind its own login
])
def test_the_api_is_off_only_where_others_could_reach_it_without_a_login(tmp_path, settings, served):
    app = FastAPI()
    before = len(app.router.routes)
    ctx = UiContext(engine=None, settings=Settings(data_dir=tmp_path, **settings))
    line = install_api(app, ctx, ui_logins=())
    assert (len(app.router.routes) > before) is served
    assert ("is off" in line) is not served


def test_launch_flags_for_the_api():
    from launch import build_parser, settings_from_args

    args = build_parser().parse_args(["--api", "--api-auth", "bot:pw1,cli:pw2", "--api-auth", "ci:pw3"])
    settings = settings_from_args(args)
    assert settings.api and settings.api_auth == (("bot", "pw1"), ("cli", "pw2"), ("ci", "pw3"))
    assert "pw1" not in str(settings.public_dict()) and settings.public_dict()["api_auth_users"] == 3


def test_a_backlog_of_api_requests_is_refused_not_queued(tmp_path):
    state = ApiState(UiContext(engine=None, settings=Settings(data_dir=tmp_path)), Quota(0, "--account-queue-size"))
    with pytest.raises(ApiError) as caught:
        anyio.run(state.run, "txt2img", lambda: None)
    assert caught.value.status_code == 429
