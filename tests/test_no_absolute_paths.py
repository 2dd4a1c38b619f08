"""Safe to share, round three (issue 43), finding 9: no absolute path in any answer.

`/sdapi/v1/upscalers` answered `model_path: /home/…/models/RealESRGAN/…`, the checkpoint and LoRA
listings their files' full paths, and refusals said "put the file under /home/…". Each told a
stranger on a share link the user's name and disk layout. The app is served as on a LAN (`--listen`,
a login); every GET route of the A1111 API, the gradio API's listings and snapshot, and a set of
requests that fail (missing model, upscaler, LoRA, model part; a name that leaves its folder) are
read, and none may name the data folder, Gradio's temp folder or the home folder.
"""

from __future__ import annotations

import base64
import io
import json
import tempfile
from pathlib import Path

import httpx
import pytest
from PIL import Image
from served_app import free_port, make_ui_data, running_app

from app.settings import Settings

gradio_client = pytest.importorskip("gradio_client")
USER, PASSWORD = "alice", "correct-horse-battery"


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("no-paths"), demo_dir)
    settings = Settings(data_dir=data, device="cpu", port=free_port(), listen=True, auth=((USER, PASSWORD),))
    with running_app(settings) as (server, engine):
        yield server, settings


def _secret_folders(settings: Settings) -> list[str]:
    return [str(settings.data_dir), str(Path(tempfile.gettempdir()) / "gradio"), str(Path.home())]


def _leaks(text: str, settings: Settings) -> list[str]:
    return [folder for folder in _secret_folders(settings) if folder in text]


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _refusals(api: httpx.Client) -> dict[str, httpx.Response]:
    """A1111 API requests that fail on a file: each answered 4xx."""
    small = {"steps": 1, "width": 64, "height": 64}
    refusals = {
        "missing model": api.post("/sdapi/v1/options", json={"sd_model_checkpoint": "no-such-model.safetensors"}),
        "missing upscaler": api.post("/sdapi/v1/extra-single-image",
                                     json={"image": _png(), "upscaler_1": "no-such-upscaler.pth"}),
        "LoRA outside its folder": api.post("/sdapi/v1/txt2img", json={"prompt": "<lora:../../escape:1>", **small}),
        "missing hires upscaler": api.post("/sdapi/v1/txt2img", json={"prompt": "a", "enable_hr": True,
                                                                      "hr_upscaler": "no-such.pth", **small}),
    }
    assert all(400 <= answer.status_code < 500 for answer in refusals.values()), \
        {what: (answer.status_code, answer.text[:300]) for what, answer in refusals.items()}
    return refusals


def _gradio_failures(client) -> dict[str, str]:
    """Gradio API calls that fail on a file: each one's error message."""
    client.predict("tiny-flux-schnell.safetensors", api_name="/load_model")  # a family whose parts may be files
    failures = {}
    for what, endpoint, args in (("missing model", "/load_model", ("no-such-model.safetensors",)),
                                 ("model outside its folder", "/load_model", ("../../escape.safetensors",)),
                                 ("missing model part", "/set_model_parts", ({"vae": "no-such-vae.safetensors"},)),
                                 ("missing LoRA", "/inspect_lora", ("no-such-lora",)),
                                 ("LoRA outside its folder", "/set_loras", ([{"name": "../../escape"}],))):
        with pytest.raises(gradio_client.exceptions.AppError) as failed:
            client.predict(*args, api_name=endpoint)
        failures[what] = str(failed.value)
    return failures


def _get_routes(api: httpx.Client) -> dict[str, httpx.Response]:
    """Every GET route of the A1111 API and of `/steady/v1` (but the bug report, a zip: see
    test_serving_security), each answered 200."""
    schema = api.get("/openapi.json").json()["paths"]
    routes = sorted(path for path, methods in schema.items()
                    if path.startswith(("/sdapi/v1/", "/steady/v1/")) and "get" in methods and "{" not in path
                    and not path.endswith("/bug-report"))
    assert {"/sdapi/v1/upscalers", "/sdapi/v1/sd-models", "/sdapi/v1/loras", "/steady/v1/snapshot"} <= set(routes)
    answers = {route: api.get(route) for route in routes}
    assert all(answer.status_code == 200 for answer in answers.values()), \
        {route: answer.text[:200] for route, answer in answers.items() if answer.status_code != 200}
    return answers


def test_no_answer_names_an_absolute_path(app):
    """Finding 9: the A1111 listings name files relative to the data folder (A1111 clients only show
    them), and no answer, refusal, error or snapshot (read after the failures, which it records)
    names the data folder, the temp folder or the home folder; the messages still say where a file
    belongs."""
    server, settings = app
    api = httpx.Client(base_url=server.local_url, auth=(USER, PASSWORD), timeout=120)
    client = gradio_client.Client(server.local_url, auth=(USER, PASSWORD), verbose=False)
    refusals, failures = _refusals(api), _gradio_failures(client)
    answers = _get_routes(api)
    listings = {name: json.dumps(client.predict(api_name=name)) for name in ("/list_models", "/list_loras",
                                                                               "/snapshot")}
    texts = {**{route: answer.text for route, answer in answers.items()},
             **{f"API: {what}": answer.text for what, answer in refusals.items()},
             **{f"gradio API: {what}": text for what, text in failures.items()}, **listings}
    leaks = {what: _leaks(text, settings) for what, text in texts.items() if _leaks(text, settings)}
    assert not leaks, "; ".join(sorted(leaks))
    assert "no file 'no-such-vae.safetensors' in models/VAE" in failures["missing model part"]
    assert "put the file under models/Lora and use its name" in texts["API: LoRA outside its folder"]
    assert "is not in models/Stable-diffusion" in failures["missing model"]
    assert "models/VAE" in answers["/steady/v1/snapshot"].text  # the failures are in it, named relatively
    upscaler = next(u for u in answers["/sdapi/v1/upscalers"].json() if u["model_path"])
    assert not Path(upscaler["model_path"]).is_absolute() and (settings.data_dir / upscaler["model_path"]).is_file()
    lora = answers["/sdapi/v1/loras"].json()[0]
    assert lora["path"].startswith("models/Lora/") and (settings.data_dir / lora["path"]).is_file()
    model = answers["/sdapi/v1/sd-models"].json()[0]
    assert model["filename"].startswith("models/Stable-diffusion/")
