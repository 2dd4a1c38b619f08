"""A real headless Chromium drives the UI as a user would: LoRA selection, a slider drag, generation,
live Diagnostics, refused and rounded settings, a failed model load, the LoRA browser, PNG Info's
round trip and History.

Needs Playwright (a test extra) and Debian's `chromium` (`apt-get install chromium`; `.ci/run`
installs it); skips cleanly without them (see `browser_kit`, which also says where screenshots go).
"""

from __future__ import annotations

import io
import os
import shutil
from urllib.parse import urljoin

import pytest
from browser_kit import (
    SHOTS,
    TIMEOUT_MS,
    choose,
    close_toasts,
    drag_slider,
    generate_and_wait,
    outputs,
    pick_loras,
    save,
    set_number,
    set_numbers_on_opening,
    toasts,
)
from PIL import Image
from served_app import MODEL, STYLE_PREVIEW_RGB, free_port, make_ui_data, running_app

from app.engine.detailing import DetailParams, DetailPass
from app.engine.generate import GenerateParams
from app.engine.stage_params import HiresParams
from app.infotext import read_parameters
from app.settings import Settings
from app.styles import read_styles

pytestmark = pytest.mark.browser


BROKEN = "zz-broken.safetensors"  # listed in the dropdown, fails to load
NARROW, WIDE = 1024, 1600  # viewport widths the layout tests measure at


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("browser"), demo_dir)
    (data / "models" / "Stable-diffusion" / BROKEN).write_bytes(b"\x80\x02 a pickle, renamed")
    with running_app(Settings(data_dir=data, device="cpu", port=free_port())) as (server, engine):
        yield server.local_url, engine


def _generate_tab(page, engine) -> None:
    page.wait_for_selector("#sd-status-line >> text=READY", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-lora-status >> text=Applied", timeout=TIMEOUT_MS)  # page-load sync is done
    assert page.input_value("#sd-width input[type=number]") == "64"  # the tiny model's native size
    pick_loras(page, ["style", "detail", "wrong"])
    page.wait_for_selector("#sd-lora-card-1 >> text=applied: 3 layers", timeout=TIMEOUT_MS)
    page.wait_for_selector("#sd-lora-card-2 >> text=set aside", timeout=TIMEOUT_MS)
    assert "does not fit this SD15 model" in page.inner_text("#sd-lora-card-2")
    page.wait_for_selector("#sd-lora-status >> text=Set aside", timeout=TIMEOUT_MS)
    drag_slider(page, "sd-lora-unet-0", 0.6)
    page.wait_for_function("document.querySelector('#sd-lora-status').innerText.includes('style UNet 0.')",
                           timeout=TIMEOUT_MS)
    applied = {s.name: s.unet_strength for s in engine.snapshot().loras}
    assert set(applied) == {"style", "detail"} and 0 < applied["style"] < 1 and applied["detail"] == 1
    page.fill("#sd-prompt textarea", "a watercolour fox in the snow")
    for elem_id, value in (("sd-steps", "2"), ("sd-width", "128"), ("sd-height", "128")):
        set_number(page, elem_id, value)
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
    assert "style" in counters and "detail" in counters and "set aside" in counters
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
    save(page, "generate.png")
    _diagnostics_tab(page)
    save(page, "diagnostics.png")
    page.get_by_role("tab", name="Generate").click()
    page.wait_for_timeout(3000)  # let the stop event and any tick already in flight land
    stopped_at = page.text_content("#sd-diag-updated")
    page.wait_for_timeout(4500)  # two refresh periods: a timer still running would have changed the stamp
    assert page.text_content("#sd-diag-updated") == stopped_at, "the Diagnostics timer kept running off-tab"
    assert outside == [], f"the page fetched from outside the app (fonts, CDN, analytics): {outside}"
    page.close()


# ------------------------------------------------------------------------------- honest inputs
def test_refused_settings_keep_their_fields_and_sizes_round_with_a_note(page, served):
    """Out-of-range values are refused in one whole toast naming each range, the fields keep what the
    user typed; a message holding a `<lora:…>` tag arrives whole; width 100 becomes 96 with a note."""
    _url, engine = served
    for elem_id, value in (("sd-steps", "0"), ("sd-width", "7"), ("sd-seed", "1.5")):
        set_number(page, elem_id, value)
    page.click("#sd-generate")
    page.wait_for_selector("[data-testid=toast-text]", timeout=TIMEOUT_MS)
    assert toasts(page) == ["Generation failed: steps must be a whole number in 1…150, got 0;\nseed must be a whole "
                             "number in -1…4294967295 (-1 = random), got 1.5;\nwidth must be a whole number in "
                             "64…2048, got 7"]
    assert [page.input_value(f"#{e} input") for e in ("sd-steps", "sd-width", "sd-seed")] == ["0", "7", "1.5"]
    save(page, "refused.png")
    close_toasts(page)
    page.fill("#sd-prompt textarea", "a fox <lora:style:x>")
    for elem_id, value in (("sd-steps", "2"), ("sd-width", "100"), ("sd-seed", "42")):
        set_number(page, elem_id, value)
    page.click("#sd-generate")
    page.wait_for_selector("[data-testid=toast-text]", timeout=TIMEOUT_MS)
    assert toasts(page) == ["Generation failed: prompt tag '<lora:style:x>': 'x' is not a number"]
    close_toasts(page)
    page.fill("#sd-prompt textarea", "a fox in the snow")
    with Image.open(generate_and_wait(page, engine)) as image:
        assert image.size == (96, 64)
    page.wait_for_selector("#sd-settings-note >> text=width 100 → 96", timeout=TIMEOUT_MS)
    assert page.input_value("#sd-width input") == "96" and toasts(page) == []
    save(page, "rounding.png")


def test_a_failed_load_puts_the_dropdown_back_and_reselecting_does_not_reload(page, served):
    _url, engine = served
    loads = sum(h.command == "load_model" for h in engine.snapshot().history)
    choose(page, "sd-model", BROKEN)
    page.wait_for_selector("[data-testid=toast-text]", timeout=TIMEOUT_MS)
    (toast,) = toasts(page)
    assert toast.startswith(f"Loading the model failed: {BROKEN}: not a valid safetensors file (it is a pickled")
    page.wait_for_function(f"document.querySelector('#sd-model input').value === {MODEL!r}", timeout=TIMEOUT_MS)
    assert engine.snapshot().model == MODEL and engine.snapshot().state == "READY"
    save(page, "load-refused.png")
    close_toasts(page)
    choose(page, "sd-model", MODEL)  # the loaded one: nothing to do
    page.click("#sd-model input")  # open and close without choosing
    page.keyboard.press("Escape")
    page.click("#sd-prompt textarea")
    page.wait_for_timeout(1500)
    assert sum(h.command == "load_model" for h in engine.snapshot().history) == loads + 1  # only the refused one
    assert toasts(page) == []


def _boxes_meet(a: dict, b: dict, slack: float = 0.5) -> bool:
    """Whether two {x, y, width, height} boxes overlap by more than `slack` px both ways."""
    return (a["x"] + slack < b["x"] + b["width"] and b["x"] + slack < a["x"] + a["width"]
            and a["y"] + slack < b["y"] + b["height"] and b["y"] + slack < a["y"] + a["height"])


def test_a_failed_load_badges_the_model_line_beside_its_text(page, served):
    """Issue 45 (10): after a refused load Gradio marks the model line (the output of the load) with an
    "Error" badge, which sat centred on top of the line's text ("Loaded … (SD1.5 inp[Error]pu; …").
    It now has a row of its own: at a narrow and a wide window the badge is shown whole inside the
    model line's block and its box meets none of the line's text boxes; a load that works removes it."""
    other = "tiny-sd15-inpainting.safetensors"
    try:
        choose(page, "sd-model", other)
        page.wait_for_selector(f"#sd-model-status >> text=Loaded {other}", timeout=TIMEOUT_MS)
        choose(page, "sd-model", BROKEN)
        page.wait_for_selector("#sd-model-status .error", timeout=TIMEOUT_MS)
        close_toasts(page)
        for width in (NARROW, WIDE):
            page.set_viewport_size({"width": width, "height": 900})
            badge = page.locator("#sd-model-status .error").bounding_box()
            block = page.locator("#sd-model-status").bounding_box()
            text = page.locator("#sd-model-status .md").evaluate("""md => {
                const range = document.createRange(); range.selectNodeContents(md);
                return [...range.getClientRects()].map(r => ({x: r.x, y: r.y, width: r.width, height: r.height}));
            }""")
            assert text and "Loaded " + other in page.inner_text("#sd-model-status .md")
            assert badge["width"] > 20 and badge["height"] > 10, badge
            assert not any(_boxes_meet(badge, box) for box in text), (width, badge, text)
            assert block["y"] <= badge["y"] and badge["y"] + badge["height"] <= block["y"] + block["height"] + 0.5, \
                (badge, block)  # shown whole, not clipped by the block
            page.locator("#sd-model-status").scroll_into_view_if_needed()
            save(page, f"load-refused-badge-{width}.png")
    finally:  # through the page: an admin's choice is every session's default checkpoint
        choose(page, "sd-model", MODEL)
        page.wait_for_selector(f"#sd-model-status >> text=Loaded {MODEL}", timeout=TIMEOUT_MS)
    assert page.locator("#sd-model-status .error").count() == 0  # a load that works takes the badge away


# One job of many short stages: the first pass, the hires upscale and pass, two detail units' passes.
_CROWDED_STAGES = ("txt2img", "hires upscale", "hires fix", "detail detect", "detail encode", "detail")
_TIMELINE_LAYOUT = """() => {
    const svg = document.querySelector('#sd-timeline svg');
    const tip = el => {  // the tooltip a user hovers: the element's own <title>, else its group's
        const own = el.querySelector(':scope > title');
        const group = el.closest('g'), theirs = group && group.querySelector(':scope > title');
        return own ? own.textContent : theirs ? theirs.textContent : el.textContent; };
    const box = el => { const r = el.getBoundingClientRect();
                        return {x: r.x, y: r.y, width: r.width, height: r.height}; };
    return {labels: [...svg.querySelectorAll("text[fill='#bc4c00']")].map(
                t => ({text: t.textContent, tip: tip(t), ...box(t)})),
            lines: [...svg.querySelectorAll('line')].map(l => ({tip: tip(l), ...box(l)})),
            paths: [...svg.querySelectorAll('path')].map(box)};
}"""


def test_memory_timeline_labels_stay_clear_of_each_other_the_lines_and_the_plot(page, served):
    """Issue 45 (10): a hires fix with two detail units runs nine transitions within a second; their
    labels were stacked over the chart, crossed by each other's dashed lines and by the RAM line, and a
    transition at the window's left edge had none. Measured in Chromium at a narrow and a wide window:
    no two labels' boxes meet, a dashed line crossing a label is one that label names, no label meets
    the plotted memory, and every transition drawn is named by a label or its tooltip."""
    _url, engine = served
    def region(image):
        mask = Image.new("L", image.size, 0)
        mask.paste(255, (8, 8, 40, 40))
        return [mask], ""
    units = tuple(DetailPass(f"box {i}", region, width=64, height=64) for i in (1, 2))
    engine.generate(GenerateParams("a red house", seed=5, steps=4, width=64, height=64, sampler="Euler"),
                    hires=HiresParams(scale=1.5, upscaler="Lanczos", steps=2, denoising_strength=0.5),
                    details=DetailParams(units))
    page.get_by_role("tab", name="Diagnostics").click()
    page.wait_for_selector("#sd-timeline svg", timeout=TIMEOUT_MS)
    for width in (NARROW, WIDE):
        page.set_viewport_size({"width": width, "height": 900})
        drawn = page.evaluate(_TIMELINE_LAYOUT)
        labels, lines = drawn["labels"], drawn["lines"]
        named = " | ".join(f"{label['text']} | {label['tip']}" for label in labels)
        assert all(stage in named for stage in _CROWDED_STAGES), (width, named)
        assert all(line["tip"] in named for line in lines), (width, named, [line["tip"] for line in lines])
        for i, label in enumerate(labels):
            assert not any(_boxes_meet(label, other) for other in labels[i + 1:]), (width, label, labels)
            assert not any(_boxes_meet(label, plot) for plot in drawn["paths"]), (width, label, drawn["paths"])
            crossing = [line["tip"] for line in lines if label["x"] + 0.5 < line["x"] + line["width"] / 2
                        < label["x"] + label["width"] - 0.5 and _boxes_meet(label, {**line, "width": label["width"],
                                                                                     "x": label["x"]})]
            assert all(tip == label["tip"] for tip in crossing), (width, label, crossing)
        SHOTS.mkdir(parents=True, exist_ok=True)  # a clip, not the element: each Diagnostics tick redraws it
        page.locator("#sd-timeline").scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / f"diagnostics-timeline-{width}.png"),
                        clip=page.locator("#sd-timeline").bounding_box())


# ------------------------------------------------------------------------------- LoRA browser
def test_lora_browser_shows_thumbnails_badges_and_trigger_words(page, served):
    """`style.preview.png` is shown (not a placeholder), clicking it selects the LoRA in the panel and
    lists its trigger words; a word click goes into the prompt; search narrows the list, and so does
    "fits this model" (what the engine accepts for the loaded model)."""
    url, engine = served
    page.click("#sd-lora-browser-panel > button")
    page.wait_for_selector("#sd-lora-browser .thumbnail-item img", timeout=TIMEOUT_MS)
    captions = [c.inner_text() for c in page.locator("#sd-lora-browser .thumbnail-item .caption-label").all()]
    assert captions == sorted(engine.library.names())
    style = page.locator("#sd-lora-browser .thumbnail-item").nth(captions.index("style"))
    picture = page.request.get(urljoin(url, style.locator("img").get_attribute("src")))
    with Image.open(io.BytesIO(picture.body())) as thumb:
        assert thumb.convert("RGB").getpixel((thumb.width // 2, thumb.height // 2)) == STYLE_PREVIEW_RGB
    style.click()
    page.wait_for_selector("#sd-lora-status >> text=style", timeout=TIMEOUT_MS)
    assert [s.name for s in engine.snapshot().loras] == ["style"]
    assert "SD1.5" in page.inner_text("#sd-lora-details")
    page.fill("#sd-prompt textarea", "a fox")
    page.locator("#sd-trigger-words button.gallery-item", has_text="watercolor").click()
    page.wait_for_function("document.querySelector('#sd-prompt textarea').value === 'a fox, watercolor'",
                           timeout=TIMEOUT_MS)
    save(page, "lora-browser.png")
    page.locator("#sd-lora-search textarea").type("sd1.5", delay=30)
    page.wait_for_function("document.querySelectorAll('#sd-lora-browser .thumbnail-item').length === 1",
                           timeout=TIMEOUT_MS)
    page.fill("#sd-lora-search textarea", "")
    page.get_by_label("fits this model").check()  # the engine's inspect_lora: 'wrong' and 'nomatch' go
    page.wait_for_selector("#sd-lora-browser-note >> text=3 LoRA(s) fit", timeout=TIMEOUT_MS)
    captions = [c.inner_text() for c in page.locator("#sd-lora-browser .thumbnail-item .caption-label").all()]
    assert captions == ["detail", "partial", "style"]


# ------------------------------------------------------------------------------ PNG Info, History
def _settings_of_a_first_image(page) -> None:
    page.fill("#sd-prompt textarea", "a lighthouse at dusk")
    page.fill("#sd-negative textarea", "blurry, lowres")
    choose(page, "sd-sampler", "DPM++ 2M Karras")
    for elem_id, value in (("sd-steps", "3"), ("sd-cfg", "6.5"), ("sd-width", "72"), ("sd-seed", "1234"),
                           ("sd-clip_skip", "2")):
        set_number(page, elem_id, value)
    pick_loras(page, ["style"])
    page.wait_for_selector("#sd-lora-card-0 >> text=applied", timeout=TIMEOUT_MS)
    page.locator(".sd-lora-card").first.get_by_text("Text-encoder weight", exact=True).click()
    for slider in ("sd-lora-unet-0", "sd-lora-te-0"):  # equal weights: the engine's infotext has no TE weight yet
        set_number(page, slider, "0.6")


def test_png_info_round_trip_gives_the_same_image_bytes(page, served):
    """Generate, drop that PNG on PNG Info, send it to Generate (prompt, negative, sampler, steps, CFG,
    seed, size, clip skip and the LoRA with both weights come back), generate again: the same file, byte
    for byte."""
    url, engine = served
    _settings_of_a_first_image(page)
    first = generate_and_wait(page, engine)
    engine.set_loras([])
    page.goto(url)  # a fresh page: default settings, no LoRA
    page.wait_for_selector("#sd-lora-status >> text=Applied: none", timeout=TIMEOUT_MS)
    page.get_by_role("tab", name="PNG Info").click()
    page.set_input_files("#sd-pnginfo-image input[type=file]", str(first))
    page.wait_for_selector("#sd-pnginfo-summary table", timeout=TIMEOUT_MS)
    summary = page.inner_text("#sd-pnginfo-summary")
    assert "style (UNet 0.6 / TE 0.6)" in summary and "DPM++ 2M Karras" in summary and "Written by this app" in summary
    save(page, "pnginfo.png")
    page.click("#sd-pnginfo-send-generate")
    page.wait_for_selector("#sd-lora-status >> text=style", timeout=TIMEOUT_MS)
    assert [(s.name, s.unet_strength, s.te_strength) for s in engine.snapshot().loras] == [("style", 0.6, 0.6)]
    assert page.input_value("#sd-seed input") == "1234" and page.input_value("#sd-width input") == "72"
    assert page.input_value("#sd-clip_skip input") == "2"
    second = generate_and_wait(page, engine)
    save(page, "pnginfo-sent.png")
    assert second != first and second.read_bytes() == first.read_bytes()


def test_a_lora_schedule_typed_in_the_panel_reaches_the_engine_the_infotext_and_comes_back_from_png_info(page,
                                                                                                        served):
    """The card's "UNet weight by step" box: a malformed schedule is refused in the status line naming the LoRA
    (nothing changes); a good one (Enter) becomes the engine's wanted LoRA, the image's infotext keeps it as
    typed, and PNG Info -> Send to Generate puts it back in the box and the engine."""
    _url, engine = served
    page.wait_for_selector("#sd-lora-status >> text=Applied: none", timeout=TIMEOUT_MS)
    pick_loras(page, ["style"])
    page.wait_for_selector("#sd-lora-card-0 >> text=applied", timeout=TIMEOUT_MS)
    box = "#sd-lora-schedule-0 input"
    page.fill(box, "1@0,0")
    page.press(box, "Enter")
    page.wait_for_selector("#sd-lora-status >> text=LoRAs not changed", timeout=TIMEOUT_MS)
    assert "'style'" in page.inner_text("#sd-lora-status") and engine.snapshot().loras[0].schedule is None
    page.fill(box, "1@0, 0@0.5")
    page.press(box, "Enter")
    page.wait_for_selector("#sd-lora-status >> text=style UNet 1@0, 0@0.5", timeout=TIMEOUT_MS)
    (spec,) = engine.snapshot().desired.loras
    assert spec.schedule is not None and spec.schedule.strengths(3) == (1.0, 0.0, 0.0)
    set_number(page, "sd-steps", "3")
    first = generate_and_wait(page, engine)
    assert "<lora:style:1@0, 0@0.5>" in read_parameters(first).splitlines()[0]
    page.fill(box, "")  # an empty box: the slider's constant strength again
    page.press(box, "Enter")
    page.wait_for_selector("#sd-lora-status >> text=style UNet 1 /", timeout=TIMEOUT_MS)
    assert engine.snapshot().desired.loras[0].schedule is None
    page.get_by_role("tab", name="PNG Info").click()
    page.set_input_files("#sd-pnginfo-image input[type=file]", str(first))
    page.wait_for_selector("#sd-pnginfo-summary table", timeout=TIMEOUT_MS)
    page.click("#sd-pnginfo-send-generate")
    page.wait_for_selector("#sd-lora-status >> text=style UNet 1@0, 0@0.5", timeout=TIMEOUT_MS)
    assert page.input_value(box) == "1@0, 0@0.5"
    assert [s.schedule for s in engine.snapshot().desired.loras] == [spec.schedule]
    engine.set_loras([])


def test_history_lists_this_session_and_the_outputs_folder(page, served):
    """Images written before this session show under "all outputs" only; selecting one shows its infotext."""
    _url, engine = served
    page.fill("#sd-prompt textarea", "a red lighthouse on a cliff")
    generate_and_wait(page, engine)
    old = engine.settings.outputs_dir / "2020-01-01" / "00000-7.png"
    old.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(outputs(engine)[-1], old)
    os.utime(old, (0, 1_577_836_800))  # 2020-01-01, before the app started
    session = len(outputs(engine)) - 1
    page.get_by_role("tab", name="History").click()
    page.wait_for_selector(f"#sd-history-count >> text={session} image(s) since the app started", timeout=TIMEOUT_MS)
    assert page.locator("#sd-history-gallery .thumbnail-item").count() == session
    page.locator("#sd-history-gallery .thumbnail-item").first.click()
    page.wait_for_function("document.querySelector('#sd-history-infotext textarea').value.startsWith("
                           "'a red lighthouse on a cliff')", timeout=TIMEOUT_MS)
    save(page, "history.png")
    page.get_by_label("all outputs").check()
    page.wait_for_selector(f"#sd-history-count >> text={session + 1} image(s) in", timeout=TIMEOUT_MS)
    # the open image is in this list too: it stays open with its infotext (issue 32: the box went empty,
    # its placeholder claiming "this PNG carries no infotext")
    assert page.input_value("#sd-history-infotext textarea").startswith("a red lighthouse on a cliff")


def test_a_saved_style_and_a_variation_seed_reach_the_image(page, served):
    """Save the prompts as a style (it lands in `styles.csv` in A1111's format), pick it, mix in a variation
    seed and generate: the PNG's infotext carries the styled prompt and the variation pairs."""
    _url, engine = served
    page.fill("#sd-prompt textarea", "framed, {prompt}")
    page.fill("#sd-style-name textarea", "frame")
    page.click("#sd-style-save")
    page.wait_for_selector("text=Style 'frame' saved", timeout=TIMEOUT_MS)
    assert read_styles(engine.settings.styles_file)["frame"].prompt == "framed, {prompt}"
    page.fill("#sd-prompt textarea", "a fox")
    choose(page, "sd-styles", "frame")
    page.keyboard.press("Escape")
    set_number(page, "sd-steps", "2")
    set_numbers_on_opening(page, "sd-variation", {"sd-subseed": "77", "sd-subseed_strength": "0.4"})
    text = read_parameters(generate_and_wait(page, engine))
    assert text.startswith("framed, a fox\n") and "Variation seed: 77, Variation seed strength: 0.4" in text


def test_lora_browser_captions_show_whole_long_names(page, served):
    """A long LoRA name is shown whole on its thumbnail (wrapped, inside the tile), not cut to "demo-detai…"."""
    _url, engine = served
    long_name = "demo-detail-flux2-klein-9b-extra-long-name"
    lora_dir = engine.settings.lora_dir
    shutil.copyfile(lora_dir / "style.safetensors", lora_dir / f"{long_name}.safetensors")
    try:
        page.click("#sd-lora-browser-panel > button")
        page.wait_for_selector("#sd-lora-browser .thumbnail-item img", timeout=TIMEOUT_MS)
        tiles = page.locator("#sd-lora-browser .thumbnail-item").all()
        shown = {}
        for tile in tiles:
            caption = tile.locator(".caption-label")
            box, inside = caption.bounding_box(), tile.bounding_box()
            cut = caption.evaluate("el => el.scrollWidth > el.clientWidth || el.scrollHeight > el.clientHeight")
            shown[caption.inner_text()] = (cut, box["x"] >= inside["x"] and box["x"] + box["width"]
                                           <= inside["x"] + inside["width"] + 0.5)
        save(page, "lora-browser-long-name.png")
        assert shown[long_name] == (False, True), shown
        assert all(fits == (False, True) for fits in shown.values()), shown
    finally:
        (lora_dir / f"{long_name}.safetensors").unlink()
