"""The first minute as an A1111 user lives it, in a real headless Chromium (issue 32).

A fresh start (the demo models, the first checkpoint that loads, nothing chosen): type a prompt,
Ctrl+Enter, an image. Then on the tiny SD1.5: the img2img tab's live preview and Interrupt (the
Generate tab's Interrupt stops it too), Ctrl+Enter on the img2img prompt, the hires fix ticked on
the Generate tab, a LoRA weight confirmed with Enter or the arrow keys without leaving the field,
a failed generation that leaves the gallery as it was, and a rounding note that goes away once
the width is corrected.
"""

from __future__ import annotations

import re
import time

import pytest
from browser_kit import TIMEOUT_MS, choose, close_toasts, outputs, pick_loras, set_number, toasts
from PIL import Image
from served_app import MODEL, fresh_start

from app.infotext import read_parameters

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    """The app as `python launch.py` starts it on the demo models: the first checkpoint that loads."""
    with fresh_start(tmp_path_factory.mktemp("first-minute"), demo_dir) as started:
        yield started


def _image_written(engine, before: int) -> str:
    """Wait for a new PNG in the outputs folder; returns its infotext."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(outputs(engine)) == before:
        assert time.monotonic() < deadline, "no image written"
        time.sleep(0.1)
    return read_parameters(outputs(engine)[-1])


def _preview_step(page, gallery: str, after: int) -> int:
    """Wait for a live preview later than step `after` in `gallery`; returns its step."""
    pattern = r"preview · step (\d+)"
    page.wait_for_function(f"(() => {{ const m = document.querySelector({gallery!r}).innerText.match(/{pattern}/); "
                           f"return m !== null && Number(m[1]) > {after}; }})()", timeout=TIMEOUT_MS)
    return int(re.search(pattern, page.inner_text(gallery)).group(1))


def test_fresh_start_a_prompt_and_ctrl_enter_give_an_image(page, served):
    """Nothing chosen but the prompt, on whichever model the start loaded: Ctrl+Enter in the prompt
    generates, the image lands in the gallery with its infotext, and no error toast appears."""
    url, engine = served
    before = len(outputs(engine))
    page.click("#sd-prompt textarea")
    page.keyboard.type("a lighthouse at dusk")
    page.keyboard.press("Control+Enter")
    text = _image_written(engine, before)
    page.wait_for_selector("#sd-gallery img", timeout=TIMEOUT_MS)
    assert text.startswith("a lighthouse at dusk\n") and not toasts(page)
    assert page.input_value("#sd-prompt textarea") == "a lighthouse at dusk"  # no newline typed


@pytest.fixture
def sd15(page, served):
    """The page, with the tiny SD1.5 loaded (the other tests here are about the page, not the model): picked
    on the page, as a fresh page starts from the app's default checkpoint, not from what the engine holds."""
    _url, engine = served
    if engine.snapshot().model != MODEL:
        choose(page, "sd-model", MODEL)
        page.wait_for_selector(f"#sd-model-status >> text=Loaded {MODEL}", timeout=TIMEOUT_MS)
    return page


def test_img2img_streams_previews_and_either_tabs_interrupt_stops_it(sd15, served, tmp_path):
    """Issue 32: the img2img tab had no preview, Interrupt or Skip, and the Generate tab's Interrupt
    was disabled meanwhile (and the Inpaint panel's refusals said "img2img failed"). Ctrl+Enter on
    the img2img prompt runs it; previews replace each other in its gallery; both tabs' Interrupt come
    alive; the Generate tab's stops it within a few steps and the partial image is shown with the
    step, the run listed as interrupted."""
    page, (_url, engine) = sd15, served
    Image.new("RGB", (64, 64), (200, 120, 40)).save(tmp_path / "init.png")
    page.get_by_role("tab", name="img2img").first.click()
    page.get_by_role("tab", name="Inpaint").click()  # its refusals are the inpaint's (they said "img2img")
    page.click("#sd-inpaint-run")
    page.wait_for_selector("[data-testid=toast-text] >> text=inpaint failed: upload an init image first",
                           timeout=TIMEOUT_MS)
    close_toasts(page)
    page.get_by_role("tab", name="img2img", exact=True).last.click()
    page.locator("#sd-i2i-image input[type=file]").set_input_files(str(tmp_path / "init.png"))
    page.wait_for_selector("#sd-i2i-image img", timeout=TIMEOUT_MS)
    for elem_id, value in (("sd-i2i-steps", "150"), ("sd-i2i-denoising_strength", "1"), ("sd-i2i-width", "256"),
                           ("sd-i2i-height", "256")):  # slow enough steps (~0.1 s) to click in between
        set_number(page, elem_id, value)
    page.click("#sd-i2i-prompt textarea")
    page.keyboard.type("a copper kettle")
    page.keyboard.press("Control+Enter")
    page.wait_for_selector("#sd-i2i-run:has-text('Generating…'):disabled", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-i2i-interrupt:enabled", timeout=TIMEOUT_MS)
    first = _preview_step(page, "#sd-i2i-gallery", after=0)
    _preview_step(page, "#sd-i2i-gallery", after=first)  # a newer preview replaced it
    page.get_by_role("tab", name="Generate").first.click()
    page.wait_for_selector("#sd-interrupt:enabled", timeout=TIMEOUT_MS)  # the status timer's doing
    clicked_at = engine.snapshot().progress.step
    page.click("#sd-interrupt")
    page.get_by_role("tab", name="img2img").first.click()
    page.wait_for_selector("#sd-i2i-gallery >> text=stopped at step", timeout=TIMEOUT_MS)
    stopped_at = int(re.search(r"stopped at step (\d+)", page.inner_text("#sd-i2i-gallery")).group(1))
    # A click crosses the browser and Gradio's queue (steps here take ~0.1 s on a busy box); that the
    # engine stops within one step of the request is the A1111 API tests' measure.
    assert clicked_at <= stopped_at <= clicked_at + 5 < 150, (clicked_at, stopped_at)
    assert [h.outcome for h in engine.snapshot().history if h.command == "img2img"][-1] == "interrupted"
    page.wait_for_selector("#sd-i2i-run:enabled:has-text('Run img2img')", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-i2i-interrupt:disabled", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-interrupt:disabled", state="attached", timeout=TIMEOUT_MS)  # on the hidden tab
    assert "a copper kettle" in page.input_value("#sd-i2i-infotext textarea")


def test_hires_fix_is_a_checkbox_on_the_generate_tab(sd15, served):
    """A1111's place for it: ticked, Generate runs the hires fix (twice the size, its infotext)."""
    page, (_url, engine) = sd15, served
    before = len(outputs(engine))
    assert not page.locator("#sd-hires-hires_steps").is_visible()
    page.get_by_label("Hires. fix").check()
    set_number(page, "sd-hires-hires_steps", "2")
    for elem_id, value in (("sd-steps", "2"), ("sd-seed", "3")):
        set_number(page, elem_id, value)
    page.fill("#sd-prompt textarea", "a fox")
    page.click("#sd-generate")
    text = _image_written(engine, before)
    assert "Hires upscale: 2" in text and "Hires steps: 2" in text
    assert Image.open(outputs(engine)[-1]).size == (128, 128)
    assert {"txt2img", "hires upscale", "hires fix"} <= {h.command for h in engine.snapshot().history}


def test_a_lora_weight_confirmed_with_enter_or_arrows_applies_in_place(sd15, served):
    """Issue 32: a weight typed and confirmed with Enter (or stepped with the arrow keys) waited for
    the field to lose focus. Now it re-weights at once and the focus stays in the field."""
    page, (_url, engine) = sd15, served
    pick_loras(page, ["style"])
    page.wait_for_selector("#sd-lora-status >> text=style UNet 1", timeout=TIMEOUT_MS)
    box = page.locator("#sd-lora-unet-0 input[type=number]")
    box.fill("0.5")
    box.press("Enter")
    page.wait_for_selector("#sd-lora-status >> text=style UNet 0.5", timeout=TIMEOUT_MS)
    assert [(s.name, s.unet_strength) for s in engine.snapshot().loras] == [("style", 0.5)]
    box.press("ArrowUp")
    page.wait_for_selector("#sd-lora-status >> text=style UNet 0.55", timeout=TIMEOUT_MS)
    assert page.evaluate("document.activeElement === document.querySelector('#sd-lora-unet-0 input[type=number]')")


def test_an_error_keeps_the_gallery_and_a_corrected_width_drops_its_note(sd15, served):
    """A refused generation is one toast and the gallery keeps the last images (it was emptied); the
    note that width 100 was rounded to 96 goes away once the user types another width."""
    page, (_url, engine) = sd15, served
    for elem_id, value in (("sd-steps", "2"), ("sd-seed", "5"), ("sd-width", "100")):
        set_number(page, elem_id, value)
    page.fill("#sd-prompt textarea", "a fox")
    before = len(outputs(engine))
    page.click("#sd-generate")
    _image_written(engine, before)
    page.wait_for_selector("#sd-settings-note >> text=width 100 → 96", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-gallery img", timeout=TIMEOUT_MS)
    page.fill("#sd-prompt textarea", "a fox " * 3000)  # over the 16,000-character cap (a missing LoRA now draws)
    page.click("#sd-generate")
    page.wait_for_selector("[data-testid=toast-text]", timeout=TIMEOUT_MS)
    assert any("characters long" in t for t in toasts(page))
    page.wait_for_selector("#sd-generate:enabled:has-text('Generate')", timeout=TIMEOUT_MS)
    assert page.locator("#sd-gallery img").count() >= 1, "the error emptied the gallery"
    close_toasts(page)
    set_number(page, "sd-width", "128")
    page.wait_for_function("!document.querySelector('#sd-settings-note').innerText.includes('width 100')",
                           timeout=TIMEOUT_MS)
