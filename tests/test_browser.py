"""A real headless Chromium drives the UI: LoRA selection, a slider drag, generation, live Diagnostics.

Skips cleanly where Playwright or Debian's `chromium` is missing. Screenshots of both tabs go to
`test-output/screenshots/`; with `SD_UPDATE_SCREENSHOTS=1` they are also copied to
`assets/screenshots/` (the README's pictures), so a normal run never dirties the checkout.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from served_app import free_port, make_ui_data, running_app

from app.settings import Settings

pytestmark = pytest.mark.browser
sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "test-output" / "screenshots"
ASSETS = ROOT / "assets" / "screenshots"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        pytest.skip("no /usr/bin/chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        try:
            chromium = playwright.chromium.launch(
                executable_path=str(CHROMIUM),
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        except sync_api.Error as exc:
            pytest.skip(f"chromium does not start here: {exc}")
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("browser"), demo_dir)
    with running_app(Settings(data_dir=data, device="cpu", port=free_port())) as (server, engine):
        yield server.local_url, engine


def _pick_loras(page, names: list[str]) -> None:
    """Type to filter, then click the option (Enter could pick the previous filter's first item)."""
    for name in names:
        page.click("#sd-loras input")
        page.keyboard.type(name)
        page.click(f"#sd-loras li[role=option][aria-label='{name}']")
        page.wait_for_selector(f"#sd-loras .token:has-text('{name}')")
    page.keyboard.press("Escape")


def _drag_slider(page, elem_id: str, to_fraction: float) -> None:
    """Drag the range thumb like a user (pointer down, move, up): the `release` event re-weights."""
    slider = page.locator(f"#{elem_id} input[type=range]")
    slider.scroll_into_view_if_needed()
    box = slider.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.75, y)  # the thumb sits at 1.0 on a -2…2 slider
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * to_fraction, y, steps=8)
    page.mouse.up()


def _set_number(page, elem_id: str, value: str) -> None:
    page.fill(f"#{elem_id} input[type=number]", value)
    page.keyboard.press("Tab")


def _save(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / name), full_page=True)
    if os.environ.get("SD_UPDATE_SCREENSHOTS") == "1":
        ASSETS.mkdir(parents=True, exist_ok=True)
        shutil.copy2(SHOTS / name, ASSETS / name)


def _generate_tab(page, engine) -> None:
    page.wait_for_selector("#sd-status-line >> text=READY", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-lora-status >> text=Applied", timeout=TIMEOUT_MS)  # page-load sync is done
    assert page.input_value("#sd-width input[type=number]") == "64"  # the tiny model's native size
    _pick_loras(page, ["style", "detail", "wrong"])
    page.wait_for_selector("#sd-lora-card-1 >> text=fits", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-lora-card-2 >> text=does not fit", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-lora-status >> text=not applied", timeout=TIMEOUT_MS)
    _drag_slider(page, "sd-lora-unet-0", 0.6)
    page.wait_for_function("document.querySelector('#sd-lora-status').innerText.includes('style UNet 0.')",
                           timeout=TIMEOUT_MS)
    applied = {s.name: s.unet_strength for s in engine.snapshot().loras}
    assert set(applied) == {"style", "detail"} and 0 < applied["style"] < 1 and applied["detail"] == 1
    page.fill("#sd-prompt textarea", "a watercolour fox in the snow")
    for elem_id, value in (("sd-steps", "2"), ("sd-width", "128"), ("sd-height", "128")):
        _set_number(page, elem_id, value)
    page.fill("#sd-seed input", "42")
    page.click("#sd-generate")
    page.wait_for_selector("#sd-gallery img", timeout=TIMEOUT_MS)
    page.wait_for_function("document.querySelector('#sd-infotext textarea').value.includes('Lora weights')",
                           timeout=TIMEOUT_MS)
    infotext = page.input_value("#sd-infotext textarea")
    assert "Seed: 42" in infotext and "style: 0." in infotext and "wrong" not in infotext
    page.wait_for_selector("#sd-status-line >> text=READY", timeout=TIMEOUT_MS)


def _diagnostics_tab(page) -> None:
    page.get_by_role("tab", name="Diagnostics").click()
    page.wait_for_selector("#sd-diag-updated", timeout=TIMEOUT_MS)
    first = page.inner_text("#sd-diag-updated")
    page.wait_for_function(f"document.querySelector('#sd-diag-updated').innerText !== {first!r}", timeout=15_000)
    counters = page.inner_text("#sd-lora-counters")
    assert "style" in counters and "detail" in counters
    page.get_by_label("only LoRA-patched").check()
    page.wait_for_function("document.querySelector('#sd-modules-note').innerText.startsWith('showing 5 of 5')",
                           timeout=15_000)
    assert "encoder.layers.0.self_attn.q_proj" in page.inner_text("#sd-modules")
    page.wait_for_selector("#sd-timeline svg", timeout=15_000)
    page.click("#sd-bug-report")
    page.wait_for_selector("#sd-bug-card img", timeout=TIMEOUT_MS)
    assert ".zip" in page.inner_text("#sd-bug-zip")


def test_select_loras_drag_generate_and_watch_diagnostics(browser, served):
    url, engine = served
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    outside = []
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith((url, "data:", "blob:")) else None)
    page.goto(url)
    _generate_tab(page, engine)
    _save(page, "generate.png")
    _diagnostics_tab(page)
    _save(page, "diagnostics.png")
    page.get_by_role("tab", name="Generate").click()
    page.wait_for_timeout(3000)  # let the stop event and any tick already in flight land
    stopped_at = page.text_content("#sd-diag-updated")
    page.wait_for_timeout(4500)  # two refresh periods: a timer still running would have changed the stamp
    assert page.text_content("#sd-diag-updated") == stopped_at, "the Diagnostics timer kept running off-tab"
    assert outside == [], f"the page fetched from outside the app (fonts, CDN, analytics): {outside}"
    page.close()
