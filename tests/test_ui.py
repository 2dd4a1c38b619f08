"""The served app through its public API (`gradio_client`), the auth policy, and the UI's pure helpers.

One app is launched per module on the tiny SD1.5 demo model with synthetic kohya LoRAs; the
share/auth test launches `launch.py` itself on an empty folder, as a newcomer would.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from served_app import ATTN, MID, MODEL, free_port, make_ui_data, running_app

from app.families import FAMILIES
from app.infotext import parse_infotext
from app.safetensors_files import file_sha256
from app.settings import Settings
from app.ui import views
from app.ui.common import UiContext, specs_from_json
from app.ui.generate_tab import native_size_updates
from app.ui.lora_panel import selected_specs, slot_weights
from app.ui.send_to import plan_send
from app.ui.serve import auth_policy, wait_until_ready

gradio_client = pytest.importorskip("gradio_client")
ROOT = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("ui"), demo_dir)
    settings = Settings(data_dir=data, device="cpu", port=free_port())
    with running_app(settings) as (server, engine):
        yield server, engine, settings


@pytest.fixture(scope="module")
def client(app):
    return gradio_client.Client(app[0].local_url, verbose=False)


def _generate(client, seed: int, prompt: str = "a fox") -> tuple[np.ndarray, str, list]:
    images, infotext, details = client.predict(prompt=prompt, sampler="Euler", steps=2, cfg=5.0, seed=seed, width=64,
                                               height=64, api_name="/generate")
    with Image.open(images[0]["image"]) as im:
        return np.asarray(im.convert("RGB")), infotext, details


# ------------------------------------------------------------------------------------ API tests
def test_endpoints_have_their_documented_names(client):
    """Scripts depend on these names: a UI handler must never take one (Gradio would rename ours `_1`)."""
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/generate", "/interrupt", "/skip", "/set_loras", "/set_lora_partial", "/set_offload", "/set_dtype",
            "/set_weights", "/set_model_parts", "/load_model", "/unload", "/set_debug", "/snapshot", "/list_models",
            "/list_loras", "/inspect_lora", "/bug_report"} <= names
    assert not [n for n in names if re.search(r"_\d+$", n)]


def test_generate_returns_image_and_infotext(client):
    pixels, infotext, details = _generate(client, seed=7)
    assert pixels.shape == (64, 64, 3)
    assert "Seed: 7" in infotext and "Steps: 2" in infotext and f"Model: {MODEL}" in infotext
    assert details[0]["seed"] == 7 and details[0]["file"].endswith(".png")


GOOD = dict(prompt="a fox", sampler="Euler", steps=2, cfg=5.0, seed=5, width=64, height=64)


def _generations(client) -> int:
    return sum(row["command"] == "generate" for row in client.predict(api_name="/snapshot")["history"])


@pytest.mark.parametrize("field, value, message", [
    ("steps", 0, "steps must be a whole number in 1…150, got 0"),
    ("steps", 100000, "steps must be a whole number in 1…150, got 100000"),
    ("width", 7, "width must be a whole number in 64…2048, got 7"),
    ("seed", 1.5, "seed must be a whole number in -1…4294967295 (-1 = random), got 1.5"),
    ("cfg", "inf", "cfg must be a number in 1…30, got 'inf'"),
    ("batch", 17, "batch must be a whole number in 1…16, got 17"),
])
def test_out_of_range_settings_are_refused_with_their_range(client, field, value, message):
    """The API and the page share one rule set: nothing is clamped or rounded into range quietly,
    the refusal names the range, and nothing is generated."""
    before = _generations(client)
    with pytest.raises(gradio_client.exceptions.AppError) as refused:
        client.predict(**dict(GOOD, **{field: value}), api_name="/generate")
    assert str(refused.value) == f"generate failed: {message}"
    assert _generations(client) == before


def test_nan_cfg_in_raw_json_is_refused(app):
    """JSON clients can send NaN (Python's json does); it is refused like any other bad number."""
    url = app[0].local_url + "gradio_api/call/generate"
    body = json.dumps({"data": ["a fox", "", "Euler", 2, float("nan"), 5, 64, 64, 1, 1, 1]}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        event = json.loads(answer.read())["event_id"]
    with urllib.request.urlopen(f"{url}/{event}", timeout=60) as stream:
        text = stream.read().decode()
    assert "event: error" in text and "cfg must be a number in 1\\u202630, got nan" in text


def test_sizes_round_down_to_the_model_multiple_with_a_note(client):
    _images, infotext, details = client.predict(**dict(GOOD, width=100, height=71), api_name="/generate")
    assert "Size: 96x64" in infotext
    assert details[0]["notes"] == ["width 100 → 96: SD1.5 sizes are multiples of 8 (rounded down, as A1111 does)",
                                   "height 71 → 64: SD1.5 sizes are multiples of 8 (rounded down, as A1111 does)"]
    assert _generate(client, seed=5)[2][0]["notes"] == []


def test_clip_skip_is_a_generation_setting_written_into_the_infotext(client):
    """The page's (and its API's) clip skip reaches the picture and the infotext as A1111 writes it."""
    one, text_one, _ = _generate(client, seed=4)
    images, text_two, _ = client.predict(prompt="a fox", sampler="Euler", steps=2, cfg=5.0, seed=4, width=64,
                                         height=64, clip_skip=2, api_name="/generate")
    with Image.open(images[0]["image"]) as im:
        assert not np.array_equal(np.asarray(im.convert("RGB")), one)
    assert "Clip skip" not in text_one and "Clip skip: 2" in text_two


def _tracebacks(caplog, capfd) -> int:
    printed = capfd.readouterr().err
    return printed.count("Traceback (most recent call last)") + sum(
        "Traceback (most recent call last)" in r.getMessage() or r.exc_info is not None for r in caplog.records)


def test_a_refusal_is_whole_and_one_log_line_and_a_bug_keeps_its_traceback(app, client, caplog, capfd, monkeypatch):
    """A refusal inside the engine reaches the client whole (the `<lora:…>` tag included) and the log
    gets one line at INFO, no traceback and nothing at ERROR (issue 32: a refused sampler or an empty
    mask printed 40 lines at ERROR). A real failure (a bug) keeps exactly one traceback, the engine's,
    not Gradio's second copy."""
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    with pytest.raises(gradio_client.exceptions.AppError) as refused:
        client.predict(**dict(GOOD, prompt="a fox <lora:style:x>"), api_name="/generate")
    message = "prompt tag '<lora:style:x>': 'x' is not a number"
    assert str(refused.value) == f"generate failed: {message}"
    assert _tracebacks(caplog, capfd) == 0
    said = [r for r in caplog.records if message in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and all(r.levelno < logging.WARNING for r in caplog.records)
    caplog.clear()

    def bug(*_args, **_kwargs):
        raise ZeroDivisionError("a bug in the denoising loop")

    monkeypatch.setattr(app[1]._lifecycle, "denoise", bug)
    with pytest.raises(gradio_client.exceptions.AppError, match="a bug in the denoising loop"):
        client.predict(**GOOD, api_name="/generate")
    assert _tracebacks(caplog, capfd) == 1
    assert [r.name for r in caplog.records if r.levelno >= logging.ERROR] == ["app.engine.worker"]


def test_send_plan_maps_a1111_settings_finds_models_by_hash_and_names_what_it_cannot_match(app):
    """What "send to Generate/img2img" will do with another tool's text: A1111 sampler + schedule names, the
    checkpoint by `Model hash` although its name differs, LoRA weights in A1111's order (TE first),
    and a note for each thing it cannot match instead of a guess."""
    _server, engine, settings = app
    ctx = UiContext(engine, settings)
    sdxl_hash = file_sha256(settings.checkpoints_dir / "tiny-sdxl.safetensors")[:10]
    text = ("a fox <lora:style:0.5:1.5> <lora:missing:1>\nNegative prompt: blurry\nSteps: 28, Sampler: DPM++ 2M, "
            f"Schedule type: Karras, CFG scale: 6.5, Seed: 99, Size: 832x1216, Model hash: {sdxl_hash}, "
            "Model: renamed_elsewhere, Denoising strength: 0.4, Clip skip: 2, Version: v1.10.1")
    plan = plan_send(ctx, parse_infotext(text))
    assert plan.fields == {"prompt": "a fox", "negative": "blurry", "steps": 28, "cfg": 6.5, "seed": 99, "width": 832,
                           "height": 1216, "sampler": "DPM++ 2M Karras", "denoising_strength": 0.4, "clip_skip": 2,
                           "subseed_strength": 0, "seed_resize_from_w": 0, "seed_resize_from_h": 0,  # no variation
                           "step_cache": 0, "refiner_checkpoint": "None",  # nor a step cache
                           "cn0_enabled": False, "cn1_enabled": False, "cn2_enabled": False,  # nor ControlNet units
                           "ad_enable": False}  # nor a detail pass
    assert plan.checkpoint == "tiny-sdxl.safetensors"
    assert [(s.name, s.unet_strength, s.te_strength) for s in plan.loras] == [("style", 1.5, 0.5)]
    assert plan.notes == ("LoRA missing is not in models/Lora",)  # relative, as every message names files
    loaded = engine.snapshot()
    plan = plan_send(ctx, parse_infotext(f"a\nSteps: 2, Sampler: LCM, Seed: 1, Model hash: {loaded.model_hash}"))
    assert plan.fields["clip_skip"] == 1  # no `Clip skip` means 1, as A1111 reads it
    assert plan.checkpoint is None and len(plan.notes) == 1 and plan.notes[0].startswith("sampler 'LCM' is not")
    plan = plan_send(ctx, parse_infotext("a\nSteps: 2, Seed: 1, Model hash: 0123456789, Model: nowhere"))
    assert plan.checkpoint is None
    assert plan.notes == (f"checkpoint nowhere (hash 0123456789) is not among yours; kept {loaded.model}",)


def test_set_loras_changes_output_reweights_live_and_removal_restores(client):
    client.predict([], api_name="/set_loras")
    base, _, _ = _generate(client, seed=3)
    loads_before = client.predict(api_name="/snapshot")["timers"]["load"]["count"]
    summary = client.predict([{"name": "style", "weight": 1.5}, {"name": "detail", "weight": -1.0, "te_weight": 0.5}],
                             api_name="/set_loras")
    assert [(x["name"], x["unet_weight"], x["te_weight"]) for x in summary["loras"]] == \
        [("style", 1.5, 1.5), ("detail", -1.0, 0.5)]
    patched, infotext, _ = _generate(client, seed=3)
    assert np.abs(patched.astype(int) - base.astype(int)).max() > 0, "two LoRAs left the image unchanged"
    assert 'Lora weights: "style: 1.5, detail: -1"' in infotext
    client.predict([{"name": "style", "weight": 0.7}, {"name": "detail", "weight": -1.0, "te_weight": 0.5}],
                   api_name="/set_loras")
    snap = client.predict(api_name="/snapshot")
    assert snap["history"][-1]["command"] == "set_loras" and snap["timers"]["load"]["count"] == loads_before
    client.predict([], api_name="/set_loras")
    restored, _, _ = _generate(client, seed=3)
    assert np.array_equal(restored, base), "removing every LoRA must give the original image back"


def test_snapshot_shows_patched_modules(client):
    client.predict([["style", 1.0], ["detail", 0.5]], api_name="/set_loras")
    snap = client.predict(api_name="/snapshot")
    patched = {(r["component"], r["module"]): r["loras"] for r in snap["placement"] if r["loras"]}
    assert patched[("unet", ATTN + "to_q")] == ["style"]
    assert patched[("unet", MID + "attn2.to_k")] == ["detail"]
    assert patched[("text_encoder", "encoder.layers.0.self_attn.q_proj")] == ["detail"]  # kohya: text_model_…
    assert len(patched) == 5
    assert snap["lora_counters"]["detail"]["matched_layers"] == 3
    client.predict([], api_name="/set_loras")


def test_any_finite_weight_through_the_api_but_not_inf_or_text(client):
    summary = client.predict([{"name": "style", "weight": 7.5}], api_name="/set_loras")
    assert summary["loras"][0]["unet_weight"] == 7.5  # beyond the slider range: allowed through the API
    for bad in ("inf", None, True):
        with pytest.raises(Exception, match="finite number"):
            client.predict([{"name": "style", "weight": bad}], api_name="/set_loras")
    assert client.predict(api_name="/snapshot")["loras"][0]["weight"] == 7.5  # refused calls changed nothing
    client.predict([], api_name="/set_loras")


@pytest.mark.parametrize("endpoint, argument", [
    ("/set_loras", [{"name": "../../../etc/passwd", "weight": 1}]),
    ("/set_loras", [{"name": "/etc/passwd", "weight": 1}]),
    ("/load_model", "../tiny-sd15.safetensors"),
    ("/load_model", "/etc/passwd"),
    ("/inspect_lora", "../Stable-diffusion/tiny-sd15"),
])
def test_path_traversal_names_are_refused(client, endpoint, argument):
    with pytest.raises(Exception, match="not a plain name|not in "):
        client.predict(argument, api_name=endpoint)
    snap = client.predict(api_name="/snapshot")
    assert snap["model"] == MODEL and snap["state"] == "READY"


def test_lora_fit_badges_and_card_metadata(client):
    """`/inspect_lora` gives the card's metadata and the fit check: ok, refused (wrong shape, nothing
    matched) or partial, with the per-file report (layout, scale source, unmatched tensors named)."""
    style = client.predict("style", api_name="/inspect_lora")
    assert style["fit"]["level"] == "ok" and style["fit"]["matched_layers"] == 2
    card = style["card"]
    assert (card["base_model"], card["rank"], card["algorithm"]) == ("sd_v1", 4, "LoRA")
    assert card["trigger_words"] == ["watercolor", "fox"] and len(card["short_hash"]) == 12
    wrong = client.predict("wrong", api_name="/inspect_lora")["fit"]
    assert wrong["level"] == "error" and "does not fit" in wrong["message"]
    nomatch = client.predict("nomatch", api_name="/inspect_lora")["fit"]
    assert nomatch["level"] == "error" and "matched zero" in nomatch["message"]
    partial = client.predict("partial", api_name="/inspect_lora")["fit"]
    assert (partial["level"], partial["matched_layers"], partial["unmatched_keys"]) == ("warn", 1, 3)
    assert (partial["layout"], partial["scale_source"], partial["fits"]) == ("kohya", "alpha tensors", "SD15")
    assert partial["unmatched_examples"][0] == "lora_unet_no_such_block_proj.alpha"


def test_bug_report_zip_has_json_and_png(client):
    zip_path, card_path = client.predict(api_name="/bug_report")
    with zipfile.ZipFile(zip_path) as bundle:
        report = json.loads(bundle.read("report.json"))
        with Image.open(io.BytesIO(bundle.read("card.png"))) as card:
            assert card.format == "PNG" and card.width == 1100 and card.height > 200
    assert report["snapshot"]["model"] == MODEL
    assert report["versions"]["torch"]["version"] == torch.__version__
    assert report["versions"]["libraries"]["gradio"]
    assert any(h["command"] == "generate" for h in report["history"])
    with Image.open(card_path) as preview:
        assert preview.format == "PNG"


def test_offload_and_unload_round_trip(client):
    assert client.predict("model", api_name="/set_offload")["offload"] == "model"
    assert client.predict("none", api_name="/set_offload")["offload"] == "none"
    with pytest.raises(Exception, match="offload must be one of"):
        client.predict("everything", api_name="/set_offload")
    assert client.predict(api_name="/unload")["state"] == "EMPTY"
    assert client.predict(api_name="/snapshot")["placement"] == []
    assert client.predict(MODEL, api_name="/load_model")["state"] == "READY"


def test_debug_toggles_take_effect_at_once(client):
    adapters, placement = logging.getLogger("app.adapters"), logging.getLogger("app.engine.placement")
    assert client.predict(True, True, True, api_name="/set_debug") == \
        {"lora_debug": True, "move_debug": True, "strict": True}
    assert adapters.level == placement.level == logging.DEBUG
    client.predict(False, False, False, api_name="/set_debug")
    assert adapters.level == placement.level == logging.INFO


def test_only_generated_images_are_served(app, client):
    """Gradio's file route must serve outputs, and never models, LoRAs (their thumbnails included: the
    LoRA browser hands Gradio copies) or the app's own files."""
    settings = app[2]
    _generate(client, seed=1)
    output = next(settings.outputs_dir.rglob("*.png"))
    base = app[0].local_url + "gradio_api/file="
    assert urllib.request.urlopen(base + str(output), timeout=10).status == 200
    for private in (settings.lora_dir / "style.safetensors", settings.lora_dir / "style.preview.png",
                    settings.checkpoints_dir / MODEL, ROOT / "launch.py"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + str(private), timeout=10)
        assert refused.value.code == 403, private


def test_auth_refuses_an_unauthenticated_client(app):
    _server, engine, settings = app
    locked = settings.replace(port=free_port(), auth=(("alice", "s3cret-pw"),))
    with running_app(locked, engine) as (server, _):
        _assert_locked(server.local_url)
        with pytest.raises(ValueError, match="Could not login"):
            gradio_client.Client(server.local_url, auth=("alice", "wrong"), verbose=False)
        authed = gradio_client.Client(server.local_url, auth=("alice", "s3cret-pw"), verbose=False)
        zip_path, _ = authed.predict(api_name="/bug_report")
        with zipfile.ZipFile(zip_path) as bundle:
            assert b"s3cret-pw" not in bundle.read("report.json")


def test_share_without_auth_requires_the_generated_password(tmp_path):
    """`launch.py --share` on an empty folder: demo written, share refused offline (said clearly),
    served locally behind a generated password printed once; our own start (demo models, engine,
    UI, server) within 8 CPU s on top of importing the libraries."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--data-dir", str(tmp_path), "--port", str(port),
                             "--share", "--device", "cpu"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until_ready(url, timeout_s=90)
        cpu_s = sum(psutil.Process(proc.pid).cpu_times()[:2])
        ready = r"UI ready .* \(CPU: ([\d.]+) s importing libraries, ([\d.]+) s starting\)"
        output = _read_until(proc, ready, timeout_s=20)
        password = re.search(r"password: (\S+)", output).group(1)
        assert "Could not create a Gradio share link" in output and "gradio.live" not in output
        _assert_locked(url)
        authed = gradio_client.Client(url, auth=("steady", password), verbose=False)
        # One checkpoint per family, a single file where it loads one, and the inpainting checkpoints (issue
        # 45: the Inpaint sub-tab can be tried at once): the other folders are left to `python -m app.demo`.
        assert authed.predict(api_name="/list_models") == sorted(
            [f"tiny-{family_name}.safetensors" if "file" in fam.files.layouts else f"tiny-{family_name}-diffusers"
             for family_name, fam in FAMILIES.items()]
            + [f"tiny-{family_name}-inpainting.safetensors" for family_name, fam in FAMILIES.items()
               if fam.test_kit.tiny_inpainting_channels])
        # CPU seconds, not wall time: on a shared 2-core CI box other jobs stretch the wall clock.
        # Importing torch, diffusers and Gradio alone takes 12-14 CPU s on a 2-core CI box, so the
        # bound is on what follows them; the whole-process bound only catches a runaway start.
        imports_s, starting_s = map(float, re.search(ready, output).groups())
        assert starting_s < 8, f"our start took {starting_s:.1f} CPU s after {imports_s:.1f} s of imports"
        assert cpu_s < 30, f"the UI needed {cpu_s:.1f} CPU s to answer on a fresh folder"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _assert_locked(url: str) -> None:
    """No client, no config, no direct API call without a login."""
    with pytest.raises(gradio_client.exceptions.AuthenticationError):
        gradio_client.Client(url, verbose=False)
    for path, body in (("config", None), ("gradio_api/info", None), ("gradio_api/call/snapshot", b'{"data": []}')):
        request = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401, path


def _read_until(proc: subprocess.Popen, pattern: str, timeout_s: float) -> str:
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline and not re.search(pattern, text):
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        text += line
    return text


# ---------------------------------------------------------------------------- policy and helpers
@pytest.mark.parametrize("changes, expect_user, generated", [
    ({}, None, False),
    ({"listen": True}, "steady", True),
    ({"share": True}, "steady", True),
    ({"share": True, "no_auth": True}, None, False),
    ({"listen": True, "auth": (("bob", "pw"),)}, "bob", False),
])
def test_auth_policy(changes, expect_user, generated):
    policy = auth_policy(Settings(**changes))
    assert (policy.credentials[0][0] if policy.credentials else None) == expect_user
    assert (policy.generated_password is not None) == generated
    if generated:
        assert len(policy.generated_password) >= 16 and auth_policy(Settings(**changes)).generated_password != \
            policy.generated_password


def test_specs_from_json_validates_shape_and_numbers():
    specs = specs_from_json([{"name": "a", "weight": 0.5, "te_weight": -3}, ["b", 2]])
    assert [(s.name, s.unet_strength, s.te_strength) for s in specs] == [("a", 0.5, -3.0), ("b", 2.0, 2.0)]
    for bad in ({"name": "a"}, [{"weight": 1}], [{"name": "a", "strength": 1}], [{"name": "a", "weight": "1"}]):
        with pytest.raises(ValueError):
            specs_from_json(bad)


def test_size_sliders_follow_the_native_size_only_when_it_changes(app):
    """The served tiny model reports its native size (UNet sample size 8 × VAE factor 8 = 64 px);
    loading a model of another native size moves width and height there, the same size keeps the
    user's choice, and no model (None) changes nothing."""
    assert app[1].snapshot().native_size == 64
    assert [u.get("value") for u in native_size_updates(512, 1024)] == [1024, 1024]
    assert [u.get("value") for u in native_size_updates(None, 64)] == [64, 64]
    for previous, current in ((512, 512), (1024, None)):
        assert all("value" not in u for u in native_size_updates(previous, current)), (previous, current)


def test_the_img2img_tab_fills_its_family_fields_when_the_model_it_shows_changes():
    """The img2img tab fills sampler, steps, guidance and size when it opens on a model other than the
    one it last filled them for: all of them on a fresh page or another family (SDXL: 1024², not the
    tab's 64²), steps and guidance between a distilled and an undistilled model of one family, nothing
    for the same model (the user's values stay). The tiny models are all 64², so this test holds the size."""
    from types import SimpleNamespace

    from app.families import family
    from app.ui.generate_tab import ModelShown
    from app.ui.img2img_tab import FAMILY_FIELDS, family_fill

    def snap(family_name, defaults, side):
        return SimpleNamespace(family=family_name, defaults=defaults, native_size=side)

    def values(fill):  # the value an update or a returned component sets (Gradio sends its arguments); None: kept
        return [(u if isinstance(u, dict) else u.constructor_args).get("value") for u in map(fill.get, FAMILY_FIELDS)]

    sdxl, sd15 = snap("sdxl", (20, 5.0), 1024), snap("sd15", (20, 7.0), 512)
    fill, shown = family_fill(sdxl, None)
    assert values(fill) == [family("sdxl").sampling.default_sampler, 20, 5.0, 1024, 1024]
    assert shown == ModelShown("sdxl", (20, 5.0), 1024) and family_fill(sdxl, shown) == ({}, shown)
    fill, shown = family_fill(sd15, shown)
    assert values(fill) == [family("sd15").sampling.default_sampler, 20, 7.0, 512, 512] and shown.native_size == 512
    klein, base = snap("flux2-klein-4b", (4, 1.0), 1024), snap("flux2-klein-4b", (50, 4.0), 1024)
    fill, shown = family_fill(klein, shown)
    assert values(fill) == [family("flux2-klein-4b").sampling.default_sampler, 4, 1.0, 1024, 1024]
    fill, shown = family_fill(base, shown)
    assert values(fill) == [None, 50, 4.0, None, None] and shown.defaults == (50, 4.0)
    assert family_fill(snap(None, None, None), shown) == ({}, shown)


def test_slider_values_map_to_specs_and_every_selected_lora_is_kept():
    """No LoRA is left out by the page: what does not fit is the engine's to set aside. A card's schedule box
    (UNet weight by step) stands for its UNet slider; a malformed one is refused naming the LoRA."""
    values = (0.5, 1.0, *[1.0] * 6, 0.25, -1.0, *[1.0] * 6, "", " 0@0,1@1 ", *[""] * 6)
    assert slot_weights(["a", "b"], values) == {"a": (0.5, 0.25, ""), "b": (1.0, -1.0, "0@0,1@1")}
    specs = selected_specs(["a", "b"], values)
    assert [(s.name, s.unet_strength, s.te_strength) for s in specs] == [("a", 0.5, 0.25), ("b", 0.0, -1.0)]
    assert specs[0].schedule is None and specs[1].schedule.strengths(3) == (0.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="LoRA 'b', UNet weight by step: '0@0,1' is not a strength schedule"):
        selected_specs(["a", "b"], (*values[:17], "0@0,1", *values[18:]))


def test_module_table_filters_and_names_hooks(app):
    engine = app[1]
    snap = engine.snapshot()
    all_rows, total = views.module_rows(snap)
    assert total == len(snap.placement) and len(all_rows) == min(total, views.MAX_MODULE_ROWS)
    unet_rows, _ = views.module_rows(snap, component="unet", text="to_q")
    assert unet_rows and all(r[0] == "unet" and "to_q" in r[1] for r in unet_rows)
    assert views.module_rows(snap, only_violations=True)[1] == len([r for r in snap.placement if r.violation])
    hooks = views.MODULE_HEADERS.index("hooks")
    assert {r[hooks] for r in all_rows} == {""}  # nothing hooked without offload on a CPU
    engine.set_offload("sequential")
    try:
        (conv_in,), _ = views.module_rows(engine.snapshot(), component="unet", text="conv_in")
        assert conv_in[hooks] == "offload.stream"
    finally:
        engine.set_offload("none")


def test_weight_storage_switches_through_the_api_and_back(client):
    """`/set_weights fp8` stores the large weights in 8 bits (the snapshot counts layers and bytes
    saved), generation still works, `/set_weights full` brings every weight back to the compute
    dtype; an unknown storage is refused with the choices."""
    summary = client.predict("fp8", api_name="/set_weights")
    snap = client.predict(api_name="/snapshot")
    assert summary["state"] == "READY" and snap["weights"] == "fp8" and snap["stored_layers"] > 0
    assert snap["bytes_saved"] > 0
    rows = {(r["component"], r["module"]): r for r in snap["placement"]}
    to_q = rows["unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"]
    assert (to_q["storage"], to_q["compute"]) == ("fp8 e4m3fn", "fp32")  # auto on the CPU computes in fp32
    assert sum("fp8 e4m3fn" in r["storage"] for r in snap["placement"]) == snap["stored_layers"]
    assert _generate(client, seed=3)[0].shape == (64, 64, 3)
    client.predict("full", api_name="/set_weights")
    assert client.predict(api_name="/snapshot")["stored_layers"] == 0
    with pytest.raises(Exception, match="weights must be one of full, fp8"):
        client.predict("int4", api_name="/set_weights")


def test_memory_timeline_labels_of_close_transitions_do_not_overlap():
    """Issues 32 and 45: transitions a second apart wrote their labels on top of each other, and then
    (stacked in rows) across each other's dashed lines and the memory line. Labels now sit in one band
    above the plot; transitions whose lines are too close for a label each share one ("… (4)"), and a
    label with little room is cut ("unl… (2)"), each naming them all in its tooltip; no line crosses a
    label that does not name it, and labels are clear of each other and of the chart's edges."""
    samples = [{"t": float(t), "ram_mib": 900.0 + t} for t in range(61)]
    marks = ((0, "load_model"), (10, "set_loras"), (11, "txt2img"), (12, "hires fix"), (13, "detail"), (58, "unload"),
             (60, "set_offload"))
    for t, name in marks:
        samples[t]["marker"] = name
    svg = views.timeline_svg(samples)
    drawn = re.findall(r"<g><title>([^<]+)</title><text x='([\d.-]+)' y='(\d+)' font-size='10' fill='#bc4c00'>"
                       r"([^<]+)</text></g>", svg)
    assert [tip for tip, _x, _y, _label in drawn] == [
        "load_model", "set_loras → txt2img → hires fix → detail", "unload → set_offload"], svg
    assert [label for *_rest, label in drawn] == ["load_model", "set_loras · txt2img · hires fix · detail (4)",
                                                  "unl… (2)"]  # cut at the right edge, whole in its tooltip
    spans = [(float(x), float(x) + len(label) * views._CHAR_PX) for _tip, x, _y, label in drawn]
    assert all(right + views._LABEL_GAP <= left for (_l, right), (left, _r) in itertools.pairwise(spans)), spans
    assert spans[0][0] >= 0 and spans[-1][1] <= 760  # the one at the left edge is drawn, none runs off the right
    assert {int(y) for *_rest, y, _label in drawn} == {views._LABEL_BAND - 4}
    lines = [(float(x), tip) for tip, group in re.findall(r"<g><title>([^<]+)</title>((?:<line [^>]+/>)+)</g>", svg)
             for x in re.findall(r"x1='([\d.]+)'", group)]
    assert len(lines) == len(marks) == svg.count(f"y1='{views._LABEL_BAND}'")  # every line starts below the band
    for x, tip in lines:  # a line under a label is one that label names
        assert all(tip == other or not left <= x <= right
                   for (left, right), (other, *_r) in zip(spans, drawn, strict=True)), x
