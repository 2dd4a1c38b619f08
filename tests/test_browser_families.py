"""The page follows the loaded family: a fresh page on whatever model loaded first (the tiny FLUX.1-dev,
first by name) generates with the page as it comes up, and Flux → SD1.5 → Flux switches leave the
family's own sampler list, sampler, steps and guidance (its name and range), with which Generate
works each time; the hires fix's sampler list is the family's too, and so are the img2img tab's
sampler, steps, guidance and size; the img2img tab's "Reference images" panel is there for FLUX.2
Klein only, saying how many it takes. Needs Playwright and Debian's chromium (see `browser_kit`);
skips without them.
"""

from __future__ import annotations

import pytest
from browser_kit import TIMEOUT_MS, choose, generate_and_wait, offered, save, set_number
from served_app import fresh_start

from app.engine.stage_params import SAME
from app.families import family
from app.infotext import parse_infotext, read_parameters

pytestmark = pytest.mark.browser
FLUX, SD15, KLEIN = "tiny-flux-dev.safetensors", "tiny-sd15.safetensors", "tiny-flux2-klein-4b.safetensors"


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    """A fresh start: the first checkpoint by name that loads, a tiny FLUX.1-dev (its diffusers folder)."""
    with fresh_start(tmp_path_factory.mktemp("browser-families"), demo_dir) as started:
        assert started[1].snapshot().family == "flux-dev"
        yield started


def _fields(page) -> dict[str, str]:
    return {"sampler": page.input_value("#sd-sampler input"), "steps": page.input_value("#sd-steps input"),
            "cfg": page.input_value("#sd-cfg input"), "cfg label": page.inner_text("#sd-cfg"),
            "offered": offered(page, "sd-sampler")}


def _other_fields(page, samplers: list[str], steps: int) -> tuple[list[str], dict[str, str]]:
    """(hires sampler list, the img2img tab's fields) once the img2img tab's sampler is one of `samplers`
    and its steps are `steps`: the update that fills them as the tab opens may land after the click."""
    page.get_by_label("Hires. fix").check()
    hires = offered(page, "sd-hires-sampler")
    page.get_by_label("Hires. fix").uncheck()
    size = page.input_value("#sd-width input"), page.input_value("#sd-height input")
    page.get_by_role("tab", name="img2img").first.click()
    page.wait_for_function(f"""{samplers!r}.includes(document.querySelector('#sd-i2i-sampler input')?.value)
        && Number(document.querySelector('#sd-i2i-steps input')?.value) === {steps}""", timeout=TIMEOUT_MS)
    image_to_image = {"offered": offered(page, "sd-i2i-sampler"), "sampler": page.input_value("#sd-i2i-sampler input"),
                      "steps": page.input_value("#sd-i2i-steps input"), "cfg": page.input_value("#sd-i2i-cfg input"),
                      "cfg label": page.inner_text("#sd-i2i-cfg"),
                      "size": (page.input_value("#sd-i2i-width input"), page.input_value("#sd-i2i-height input")),
                      "generate size": size}
    page.get_by_role("tab", name="Generate").first.click()
    return hires, image_to_image


def _expect_family(page, family_name: str, other_lists: bool = True) -> None:
    fam = family(family_name)
    page.wait_for_function(f"document.querySelector('#sd-sampler input').value === {fam.sampling.default_sampler!r}",
                           timeout=TIMEOUT_MS)
    shown = _fields(page)
    assert shown["offered"] == list(fam.sampling.samplers), shown
    assert (shown["sampler"], float(shown["steps"]), float(shown["cfg"])) == (
        fam.sampling.default_sampler, fam.sampling.default_steps, fam.sampling.default_guidance), shown
    low, high = fam.sampling.guidance_range
    assert fam.sampling.guidance_label in shown["cfg label"] and f"{low:g}…{high:g}" in shown["cfg label"], shown
    if other_lists:
        hires, i2i = _other_fields(page, list(fam.sampling.samplers), fam.sampling.default_steps)
        assert hires == [SAME, *fam.sampling.samplers] and i2i["offered"] == list(fam.sampling.samplers), i2i
        assert (i2i["sampler"], float(i2i["cfg"])) == (fam.sampling.default_sampler, fam.sampling.default_guidance), i2i
        assert fam.sampling.guidance_label in i2i["cfg label"] and f"{low:g}…{high:g}" in i2i["cfg label"], i2i
        assert i2i["size"] == i2i["generate size"], i2i  # the native size, as on the Generate tab


def _generate(page, engine, family_name: str) -> dict[str, str]:
    """Generate with the family's sampler and guidance as the page shows them (two steps, to be quick)."""
    set_number(page, "sd-steps", "2")
    settings = parse_infotext(read_parameters(generate_and_wait(page, engine))).settings
    assert engine.snapshot().family == family_name
    assert settings["Sampler"] == family(family_name).sampling.default_sampler
    return settings


def _load(page, model: str) -> None:
    choose(page, "sd-model", model)
    page.wait_for_selector(f"#sd-model-status >> text=Loaded {model}", timeout=TIMEOUT_MS)


def test_the_first_generate_works_on_flux_and_switches_keep_a_sampler_each_family_takes(page, served):
    """Flux dev loaded first: the page offers Flux's samplers with its defaults (Euler, 28 steps,
    Distilled CFG Scale 3.5) and Generate works as the page comes up; SD1.5 brings SD's list and
    defaults (Euler a, 20, CFG scale 7); back on Flux, Flux's again; Generate works after each switch.
    The img2img tab, opened after each, shows the same sampler, steps, guidance and size (it kept SD's
    20 steps, CFG 7 and 64² for every model)."""
    _url, engine = served
    page.fill("#sd-prompt textarea", "a red cube")
    _expect_family(page, "flux-dev")
    assert _generate(page, engine, "flux-dev")["Distilled CFG Scale"] == "3.5"
    _load(page, SD15)
    _expect_family(page, "sd15")
    assert _generate(page, engine, "sd15")["CFG scale"] == "7"
    _load(page, FLUX)
    _expect_family(page, "flux-dev", other_lists=False)  # their lists were Flux's at the start
    assert _generate(page, engine, "flux-dev")["Distilled CFG Scale"] == "3.5"


def test_the_reference_images_panel_follows_the_loaded_family(page, served):
    """Klein loaded: the img2img tab offers "Reference images", whose gallery says 1-4 (Klein takes
    four); after a switch to SD1.5 the panel is gone at the next panel choice, as the snapshot says."""
    _url, engine = served
    _load(page, KLEIN)
    page.get_by_role("tab", name="img2img").first.click()
    page.get_by_role("tab", name="Inpaint").first.click()  # a panel choice re-reads the snapshot
    panel = page.get_by_role("tab", name="Reference images")
    panel.first.wait_for(timeout=TIMEOUT_MS)
    panel.first.click()
    page.wait_for_selector("#sd-i2i-references >> text=Reference images (1-4)", timeout=TIMEOUT_MS)
    assert engine.snapshot().family == "flux2-klein-4b"
    save(page, "reference-images.png")
    page.get_by_role("tab", name="Generate").first.click()
    _load(page, SD15)
    page.get_by_role("tab", name="img2img").first.click()
    page.get_by_role("tab", name="img2img").nth(1).click()
    page.wait_for_function("""() => ![...document.querySelectorAll('[role=tab]')]
        .some(t => t.innerText.trim() === 'Reference images' && t.offsetParent !== null)""", timeout=TIMEOUT_MS)
    assert engine.snapshot().family == "sd15"
