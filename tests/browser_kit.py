"""What the browser tests share: starting Debian's Chromium through Playwright, and the few
gestures a user makes (pick LoRAs, drag a slider, type a number, click Generate and wait).

Screenshots go to `test-output/screenshots/`; with `SD_UPDATE_SCREENSHOTS=1` they are also copied
to `assets/screenshots/` (the README's pictures), so a normal run never dirties the checkout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "test-output" / "screenshots"
ASSETS = ROOT / "assets" / "screenshots"
TIMEOUT_MS = 60_000


@contextlib.contextmanager
def chromium():
    """A headless Chromium, or a skip saying why there is none."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.is_file():
        pytest.skip("no /usr/bin/chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM),
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        except sync_api.Error as exc:
            pytest.skip(f"chromium does not start here: {exc}")
        yield browser
        browser.close()


def open_page(browser, url: str, engine):
    """A fresh page on the served app with no LoRA wanted (the tests of a module share one engine),
    once the page-load sync has drawn the LoRA panel."""
    engine.set_loras([])
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(url)
    page.wait_for_selector("#sd-status-line >> text=READY", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-lora-status >> text=Applied", timeout=TIMEOUT_MS)
    return page


def pick_loras(page, names: list[str]) -> None:
    """Type to filter, then click the option (Enter could pick the previous filter's first item)."""
    for name in names:
        page.click("#sd-loras input")
        page.keyboard.type(name)
        page.click(f"#sd-loras li[role=option][aria-label='{name}']")
        page.wait_for_selector(f"#sd-loras .token:has-text('{name}')")
    page.keyboard.press("Escape")


def drag_slider(page, elem_id: str, to_fraction: float) -> None:
    """Drag the range thumb like a user (pointer down, move, up): the `release` event re-weights."""
    slider = page.locator(f"#{elem_id} input[type=range]")
    slider.scroll_into_view_if_needed()
    box = slider.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.75, y)  # the thumb sits at 1.0 on a -2…2 slider
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * to_fraction, y, steps=8)
    page.mouse.up()


def set_number(page, elem_id: str, value: str) -> None:
    page.fill(f"#{elem_id} input[type=number]", value)
    page.keyboard.press("Tab")


def set_numbers_on_opening(page, accordion: str, values: dict[str, str]) -> None:
    """Open the accordion `accordion` and set its number fields. It mounts them on opening and gives
    them their values a moment later, each on its own: a fill before then is overwritten (1 run in 4
    lost the variation seed), so the fields are filled until they all hold their values."""
    page.click(f"#{accordion}")
    for _ in range(5):
        for elem_id, value in values.items():
            set_number(page, elem_id, value)
        page.wait_for_timeout(300)
        if all(page.input_value(f"#{elem_id} input[type=number]") == value for elem_id, value in values.items()):
            return
    raise AssertionError(f"#{accordion}: its fields did not keep {values}")


def save(page, name: str) -> None:
    page.wait_for_timeout(700)  # let toasts and previews finish fading in
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / name), full_page=True)
    if os.environ.get("SD_UPDATE_SCREENSHOTS") == "1":
        ASSETS.mkdir(parents=True, exist_ok=True)
        shutil.copy2(SHOTS / name, ASSETS / name)


def toasts(page) -> list[str]:
    return [t.inner_text() for t in page.locator("[data-testid=toast-text]").all()]


def close_toasts(page) -> None:
    for button in page.locator("[data-testid=toast-close]").all():
        button.click()
    page.wait_for_selector("[data-testid=toast-text]", state="detached", timeout=TIMEOUT_MS)


def outputs(engine) -> list[Path]:
    return sorted(engine.settings.outputs_dir.rglob("*.png"), key=lambda p: p.stat().st_mtime_ns)


def generate_and_wait(page, engine) -> Path:
    """Click Generate and return the PNG it wrote."""
    before = len(outputs(engine))
    page.click("#sd-generate")
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(outputs(engine)) == before:
        assert time.monotonic() < deadline, "no image written"
        page.wait_for_timeout(200)
    page.wait_for_selector("#sd-status-line >> text=READY", timeout=TIMEOUT_MS)
    return outputs(engine)[-1]


def offered(page, elem_id: str) -> list[str]:
    """The options a dropdown offers, as a user sees them on opening it."""
    page.click(f"#{elem_id} input")
    options = page.locator(f"#{elem_id} li[role=option]").evaluate_all(
        "options => options.map(o => o.getAttribute('aria-label'))")
    page.keyboard.press("Escape")
    return options


def choose(page, elem_id: str, option: str) -> None:
    page.click(f"#{elem_id} input")
    page.click(f"#{elem_id} li[role=option][aria-label='{option}']")
