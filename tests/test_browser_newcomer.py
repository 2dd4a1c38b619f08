"""A newcomer's day on the demo models, in Chromium (issue 45, items 2-5, 7, 8): what they tripped over.

- The page says when the loaded model is a random-weight demo and where real checkpoints go (a banner).
- On a family that never reads a negative prompt (FLUX.1-dev), the box says so, the settings note says
  so after Generate and the image's infotext states it.
- History → Send to img2img after a family switch and PNG Info → Send to Generate of another family's
  infotext fill the LOADED family's controls (its sampler list, its guidance's name), a sampler it lacks
  becoming its nearest with a note, and the next run draws (it failed with Gradio's raw "Value: Euler a
  is not in the list of choices").
- The errors the page showed (a refused Generate) count in Diagnostics and in the bug report's card, and
  the images of the run before are marked as such.
- The Klein "Reference images" sub-tab is there while the Inpaint sub-tab is active.
- A refused upload keeps the picture already in the img2img and Extras fields and says why.
Screenshots go to test-output/screenshots/newcomer-*.png; the app's console and the page's show no
traceback (nor uncaught JavaScript error).
Needs Playwright and Debian's chromium (see `browser_kit`); skips without them.
"""

from __future__ import annotations

import io
import json
import zipfile

import pytest
from browser_kit import (
    SHOTS,
    TIMEOUT_MS,
    choose,
    close_toasts,
    generate_and_wait,
    offered,
    outputs,
    save,
    set_number,
    toasts,
)
from PIL import Image
from served_app import fresh_start

from app.families import family
from app.infotext import parse_infotext, read_parameters
from app.report import REPORT_JSON
from app.ui.generate_run import FAILED_LABEL
from app.ui.kept_upload import REFUSED

pytestmark = pytest.mark.browser
SD15, KLEIN = "tiny-sd15.safetensors", "tiny-flux2-klein-4b.safetensors"
# An SD1.5 infotext from another install: its checkpoint is not among ours, its sampler not one Klein has.
FOREIGN = ("a lighthouse at dusk\nNegative prompt: fog\nSteps: 2, Sampler: DPM++ 2M, CFG scale: 7, Seed: 5, "
           "Size: 64x64, Model hash: 0123456789, Model: v1-5-pruned-emaonly, Version: v1.10.1")


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    """A fresh start on the demo models: the first checkpoint by name, a tiny FLUX.1-dev."""
    with fresh_start(tmp_path_factory.mktemp("browser-newcomer"), demo_dir) as started:
        assert started[1].snapshot().family == "flux-dev"
        yield started


@pytest.fixture
def console(capfd, page):
    """The app's console during a test, and the page's: neither may show a traceback (a Python one, an
    uncaught JavaScript error) for anything the user did."""
    thrown: list[str] = []
    page.on("pageerror", lambda error: thrown.append(str(error)))
    yield
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, (out + err)[-4000:]
    assert thrown == [], thrown


def _load(page, model: str) -> None:
    page.get_by_role("tab", name="Generate").first.click()
    choose(page, "sd-model", model)
    page.wait_for_selector(f"#sd-model-status >> text=Loaded {model}", timeout=TIMEOUT_MS)


def _run_and_wait(page, engine, button: str) -> None:
    """Click a run button and wait for the image it writes."""
    before = len(outputs(engine))
    page.click(f"#{button}")
    for _ in range(TIMEOUT_MS // 200):
        if len(outputs(engine)) > before:
            break
        page.wait_for_timeout(200)
    assert len(outputs(engine)) > before, toasts(page)
    page.wait_for_selector("#sd-status-line >> text=READY", timeout=TIMEOUT_MS)


def test_the_demo_says_so_and_a_negative_prompt_flux_never_reads_is_said(page, served, console):
    """FLUX.1-dev demo loaded: the banner names it a random-weight demo and the checkpoint folder; the
    negative box says FLUX.1-dev runs no unconditional pass, and after Generate so do the note and the
    image's infotext (`Negative prompt unused`)."""
    _url, engine = served
    page.wait_for_selector("#sd-demo-banner >> text=demo model with random weights", timeout=TIMEOUT_MS)
    banner = page.inner_text("#sd-demo-banner")
    assert engine.snapshot().model in banner and "models/Stable-diffusion/" in banner, banner
    save(page, "newcomer-demo-banner.png")
    label = page.inner_text("#sd-negative")
    assert "not used" in label and "FLUX.1-dev runs no unconditional pass" in label, label
    page.fill("#sd-prompt textarea", "a red cube")
    page.fill("#sd-negative textarea", "blurry, watermark")
    set_number(page, "sd-steps", "2")
    settings = parse_infotext(read_parameters(generate_and_wait(page, engine))).settings
    assert settings["Negative prompt unused"] == "FLUX.1-dev runs no unconditional pass", settings
    page.wait_for_selector("#sd-settings-note >> text=the negative prompt is not used", timeout=TIMEOUT_MS)
    save(page, "newcomer-negative-unused.png")


def test_sends_fit_the_loaded_family_and_the_page_keeps_its_errors(page, served, console):
    """(2) img2img filled for FLUX.1, SD1.5 loaded and an image drawn: History → Send to img2img puts SD's
    sampler list, "Euler a" and "CFG scale" there, and img2img draws. (7) With the Inpaint sub-tab
    active, loading Klein shows "Reference images" beside it. (2) PNG Info → Send to Generate of an SD1.5
    infotext while Klein is loaded: "DPM++ 2M" becomes Klein's "Euler" with a note, and Generate draws.
    (3) A refused Generate marks the last images as the run before's, and the Diagnostics box and the bug
    report (its JSON and card) list the error."""
    _url, engine = served
    page.get_by_role("tab", name="img2img").first.click()  # its fields are filled for FLUX.1-dev
    page.wait_for_function("document.querySelector('#sd-i2i-cfg').innerText.includes('Distilled CFG Scale')",
                           timeout=TIMEOUT_MS)
    _load(page, SD15)
    page.fill("#sd-prompt textarea", "a lighthouse")
    set_number(page, "sd-steps", "2")
    generate_and_wait(page, engine)
    page.get_by_role("tab", name="History").first.click()
    page.locator("#sd-history-gallery .thumbnail-item").first.click()
    page.wait_for_function("document.querySelector('#sd-history-infotext textarea').value.startsWith('a lighthouse')",
                           timeout=TIMEOUT_MS)
    page.click("#sd-history-send-img2img")
    page.wait_for_selector("#sd-i2i-note >> text=Settings sent from an infotext", timeout=TIMEOUT_MS)
    assert page.input_value("#sd-i2i-sampler input") == "Euler a"
    assert offered(page, "sd-i2i-sampler") == list(family("sd15").sampling.samplers)
    cfg_label = page.inner_text("#sd-i2i-cfg")
    assert "CFG scale" in cfg_label and "Distilled" not in cfg_label, cfg_label
    save(page, "newcomer-send-to-img2img.png")
    _run_and_wait(page, engine, "sd-i2i-run")

    page.get_by_role("tab", name="Inpaint").first.click()  # SD1.5: no Reference images sub-tab
    _load(page, KLEIN)
    page.get_by_role("tab", name="img2img").first.click()
    page.get_by_role("tab", name="Reference images").first.wait_for(timeout=TIMEOUT_MS)
    assert page.locator("#sd-inpaint-editor").is_visible()  # Inpaint is still the active sub-tab
    save(page, "newcomer-reference-beside-inpaint.png")

    page.get_by_role("tab", name="PNG Info").first.click()
    page.fill("#sd-pnginfo-text textarea", FOREIGN)
    page.click("#sd-pnginfo-send-generate")
    page.wait_for_selector("#sd-settings-note >> text='Euler', the nearest it has", timeout=TIMEOUT_MS)
    assert page.input_value("#sd-sampler input") == "Euler" and engine.snapshot().family == "flux2-klein-4b"
    assert family("flux2-klein-4b").sampling.guidance_label in page.inner_text("#sd-cfg")
    save(page, "newcomer-send-to-generate.png")
    drawn = parse_infotext(read_parameters(generate_and_wait(page, engine))).settings
    assert drawn["Sampler"] == "Euler" and drawn["Negative prompt unused"], drawn

    set_number(page, "sd-steps", "9999")
    page.click("#sd-generate")
    page.wait_for_selector("[data-testid=toast-text] >> text=Generation failed", timeout=TIMEOUT_MS)
    page.wait_for_selector(f"#sd-gallery >> text={FAILED_LABEL[2:30]}", timeout=TIMEOUT_MS)
    close_toasts(page)
    page.get_by_role("tab", name="Diagnostics").first.click()
    page.wait_for_function("document.querySelector('#sd-last-error').innerText.includes("
                           "'error(s) shown on the page')", timeout=TIMEOUT_MS)
    assert "Generation failed: steps" in page.inner_text("#sd-last-error")
    page.click("#sd-bug-report")
    page.wait_for_selector("#sd-bug-card img", timeout=TIMEOUT_MS)
    card = page.locator("#sd-bug-card img").get_attribute("src")
    bundle = page.request.get(page.locator("#sd-bug-zip a").first.get_attribute("href")).body()
    report = json.loads(zipfile.ZipFile(io.BytesIO(bundle)).read(REPORT_JSON))
    shown = [e for e in report["errors"] if e.get("shown")]
    assert shown and "steps" in shown[-1]["message"] and shown[-1]["command"] == "Generation failed", report["errors"]
    SHOTS.mkdir(parents=True, exist_ok=True)
    Image.open(io.BytesIO(page.request.get(card).body())).save(SHOTS / "newcomer-bug-card.png")


def test_a_refused_upload_keeps_the_picture_and_says_why(page, served, tmp_path, console):
    """A PNG in img2img's and Extras' fields, then a BMP (refused by the upload check): the PNG stays and
    the note says the upload was refused; the user's own clear (×) still empties the field."""
    Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / "good.png")
    Image.new("RGB", (64, 64), (30, 30, 200)).save(tmp_path / "bad.bmp")
    for tab, field, note in (("img2img", "sd-i2i-image", "sd-i2i-note"),
                             ("Extras", "sd-extras-image", "sd-extras-infotext")):
        page.get_by_role("tab", name=tab).first.click()
        page.locator(f"#{field} input[type=file]").set_input_files(str(tmp_path / "good.png"))
        page.wait_for_selector(f"#{field} img", timeout=TIMEOUT_MS)
        page.locator(f"#{field} input[type=file]").set_input_files(str(tmp_path / "bad.bmp"))
        page.wait_for_selector("[data-testid=toast-text] >> text=not a PNG, JPEG or WebP", timeout=TIMEOUT_MS)
        page.wait_for_function(f"""() => {{ const n = document.querySelector('#{note}');
            return (n.querySelector('textarea')?.value ?? n.innerText).includes({REFUSED[2:40]!r}); }}""",
                               timeout=TIMEOUT_MS)
        assert page.locator(f"#{field} img").count() == 1, tab
        save(page, f"newcomer-refused-upload-{tab.lower()}.png")
        close_toasts(page)
        page.locator(f"#{field} button[aria-label='Remove Image']").click()
        page.wait_for_timeout(1500)
        assert page.locator(f"#{field} img").count() == 0, f"{tab}: the user's clear was undone"
