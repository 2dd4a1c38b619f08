"""A newcomer's day through the Gradio API and the app's own functions (issue 45, items 2-6 and 9); the
page side of the same items is tests/test_browser_newcomer.py.

What it protects: a `<lora:…>` tag naming a LoRA the folder lacks warns and draws (A1111's way), the
infotext keeping nothing of it; an error a request was shown counts in the bug report; a sent sampler a
family lacks becomes its nearest, and a guidance-distilled family takes the infotext's distilled guidance;
a negative prompt nothing reads is noted and the infotext states it; the demo marks its checkpoints, the
first start writes the SD1.5 inpainting checkpoint too, the model line names it "SD1.5 inpainting", and
the README documents `python -m app.demo DIR`.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import httpx
import pytest
from served_app import MODEL, served_demo

from app.demo import is_demo_checkpoint
from app.engine.generate import GenerateParams, RunContext, infotext, params_from_form
from app.families import family
from app.infotext import parse_infotext
from app.report import REPORT_JSON
from app.settings import Settings
from app.ui.common import UiContext
from app.ui.demo_banner import banner_text
from app.ui.generate_tab import loaded_text
from app.ui.send_to import fit_to_family, nearest_sampler
from app.ui.serve import _ensure_demo

gradio_client = pytest.importorskip("gradio_client")
ROOT = Path(__file__).resolve().parents[1]
INPAINTING = "tiny-sd15-inpainting.safetensors"


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    with served_demo(tmp_path_factory.mktemp("newcomer"), demo_dir) as started:
        yield started


def test_a_missing_lora_tag_warns_and_draws_without_it(app):
    """A pasted prompt naming a LoRA the folder lacks draws (it failed with "LoRA 'x' not found"), a note
    says which and where it was looked for, and the infotext keeps nothing of it (no tag, no hash); a LoRA
    that is there still applies. The A1111 API draws too (it answered 422)."""
    client = gradio_client.Client(app[0].local_url, verbose=False)
    _images, text, details = client.predict(prompt="a fox <lora:nowhere:0.8> <lora:style:0.5>", sampler="Euler",
                                            steps=2, cfg=5.0, seed=3, width=64, height=64, api_name="/generate")
    notes = details[0]["notes"]
    assert any("'nowhere' not found in models/Lora" in note and "drawn without it" in note for note in notes), notes
    assert "nowhere" not in text, text
    assert [spec.name for spec in parse_infotext(text).loras] == ["style"], text
    # the A1111 API draws too, as A1111 does (it answered 422)
    answer = httpx.post(f"{app[0].local_url.rstrip('/')}/sdapi/v1/txt2img", timeout=120,
                        json={"prompt": "a fox <lora:nowhere:1>", "steps": 2, "width": 64, "height": 64})
    assert answer.status_code == 200 and len(answer.json()["images"]) == 1, answer.text[:300]
    assert "nowhere" not in json.loads(answer.json()["info"])["infotexts"][0]


def test_an_error_a_request_was_shown_is_in_the_bug_report(app):
    """A refused Generate (steps over the limit) is listed in the bug report's errors, marked as shown
    (the report said "no errors this session" after one)."""
    client = gradio_client.Client(app[0].local_url, verbose=False)
    with pytest.raises(gradio_client.exceptions.AppError, match="steps"):
        client.predict(prompt="a fox", sampler="Euler", steps=9999, cfg=5.0, seed=3, width=64, height=64,
                       api_name="/generate")
    zip_path, _card = client.predict(api_name="/bug_report")
    report = json.loads(zipfile.ZipFile(zip_path).read(REPORT_JSON))
    shown = [e for e in report["errors"] if e.get("shown")]
    assert shown and shown[-1]["command"] == "generate failed" and "9999" in shown[-1]["message"], report["errors"]


def test_a_sent_sampler_a_family_lacks_becomes_its_nearest_and_distilled_guidance_is_read():
    """"DPM++ 2M" from an SD1.5 infotext is Klein's "Euler" (its stated nearest, named in a note), "DPM++ 2M
    Karras" on FLUX its "Euler Karras", a name no family maps falls back to the default; SD keeps "Euler a";
    FLUX.1-dev takes `Distilled CFG Scale` (its `CFG scale` is 1), SD1.5 the `CFG scale`."""
    notes: list[str] = []
    fields = {"sampler": "DPM++ 2M", "cfg": 1, "distilled_cfg": 3.5}
    assert fit_to_family(fields, family("flux2-klein-4b"), notes)["sampler"] == "Euler"
    assert notes == ["sampler 'DPM++ 2M': FLUX.2 Klein 4B has no such sampler; 'Euler', the nearest it has, was "
                     "put in"]
    assert nearest_sampler(family("flux-dev"), "DPM++ 2M Karras") == "Euler Karras"
    assert nearest_sampler(family("flux-dev"), "LMS") == family("flux-dev").sampling.default_sampler
    assert fit_to_family(fields, family("flux-dev"), [])["cfg"] == 3.5
    assert fit_to_family({**fields, "sampler": "Euler a"}, family("sd15"), []) == {"sampler": "Euler a", "cfg": 1}


def test_a_negative_prompt_nothing_reads_is_noted_and_stated_in_the_infotext():
    """FLUX.1-dev (no unconditional pass) and Z-Image Turbo at CFG 1 note the unused negative prompt and
    their infotext says why; SD1.5 at CFG 7 reads it (no note, the negative prompt written)."""
    values = dict(prompt="a fox", negative_prompt="blurry", sampler="Euler", steps=4, seed=1, width=64, height=64,
                  batch=1)
    for family_name, cfg, why in (("flux-dev", 3.5, "FLUX.1-dev runs no unconditional pass"),
                                  ("zimage-turbo", 1, "CFG scale 1 runs no unconditional pass (above 1 it does)")):
        params, notes = params_from_form({**values, "cfg": cfg}, family_name)
        assert f"the negative prompt is not used: {why}" in notes, notes
        assert parse_infotext(infotext(params, 1, RunContext("m", "abc", family=family_name))).settings[
            "Negative prompt unused"] == why
    params, notes = params_from_form({**values, "cfg": 7, "sampler": "Euler a"}, "sd15")
    text = parse_infotext(infotext(params, 1, RunContext("m", "abc", family="sd15")))
    assert not notes and text.negative_prompt == "blurry" and "Negative prompt unused" not in text.settings
    assert infotext(GenerateParams("a fox", cfg=7), 1, RunContext("m", "abc", family="sd15")).count("unused") == 0


def test_the_inpainting_demo_is_written_at_first_start_and_named_so(app, tmp_path):
    """The first start writes the SD1.5 inpainting checkpoint with the others, every checkpoint marked as a
    demo (the banner reads the mark); loaded, the model line says "SD1.5 inpainting", not "sd15"; the README
    documents `python -m app.demo DIR`."""
    settings = Settings(data_dir=tmp_path)
    _ensure_demo(settings)
    written = sorted(p.name for p in settings.checkpoints_dir.iterdir())
    assert INPAINTING in written and all(is_demo_checkpoint(settings.checkpoints_dir / n) for n in written), written
    server, engine = app
    ctx = UiContext(engine, engine.settings)
    try:
        snap = engine.load_model(INPAINTING)
        assert snap.model_label == "SD1.5 inpainting" and "(SD1.5 inpainting," in loaded_text(snap)
        assert INPAINTING in banner_text(ctx) and "models/Stable-diffusion/" in banner_text(ctx)
    finally:
        ctx.shown_errors.detach()
        engine.load_model(MODEL)
    assert engine.snapshot().model_label == "SD1.5"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "python -m app.demo" in readme
