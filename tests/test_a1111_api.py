"""The A1111 web API of the served app, driven as its clients drive it: the `webuiapi` package and raw HTTP.

One app per module on the tiny SD1.5 demo model with synthetic kohya LoRAs, on loopback without a
login (where the API is on by default). The expected fields and defaults are A1111's own, from its
`modules/api/models.py` and `api.py` (v1.10), written out here so a drift on our side fails a test.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
import zipfile

import numpy as np
import pytest
import requests
from PIL import Image
from served_app import MODEL, free_port, make_ui_data, running_app

from app.a1111.schema import Txt2ImgRequest
from app.engine.generate import params_from_form
from app.settings import Settings
from app.styles import PromptStyle, save_style

webuiapi = pytest.importorskip("webuiapi")
SDXL = "tiny-sdxl.safetensors"
SMALL = dict(steps=2, width=64, height=64, cfg_scale=5.0, sampler_name="Euler")
# A1111's txt2img request defaults (StableDiffusionProcessingTxt2Img + the API's additional fields).
A1111_DEFAULTS = {
    "prompt": "", "negative_prompt": "", "styles": None, "seed": -1, "subseed": -1, "subseed_strength": 0,
    "seed_resize_from_h": -1, "seed_resize_from_w": -1, "sampler_name": None, "scheduler": None, "batch_size": 1,
    "n_iter": 1, "steps": 50, "cfg_scale": 7.0, "width": 512, "height": 512, "restore_faces": None, "tiling": None,
    "do_not_save_samples": False, "do_not_save_grid": False, "eta": None, "denoising_strength": 0.75,
    "s_min_uncond": None, "s_churn": None, "s_tmax": None, "s_tmin": None, "s_noise": None, "override_settings": None,
    "override_settings_restore_afterwards": True, "refiner_checkpoint": None, "refiner_switch_at": None,
    "disable_extra_networks": False, "firstpass_image": None, "comments": None, "enable_hr": False,
    "firstphase_width": 0, "firstphase_height": 0, "hr_scale": 2.0, "hr_upscaler": None, "hr_second_pass_steps": 0,
    "hr_resize_x": 0, "hr_resize_y": 0, "hr_checkpoint_name": None, "hr_sampler_name": None, "hr_scheduler": None,
    "hr_prompt": "", "hr_negative_prompt": "", "force_task_id": None, "sampler_index": "Euler", "script_name": None,
    "script_args": [], "send_images": True, "save_images": False, "alwayson_scripts": {}, "infotext": None,
}
STATE_KEYS = {"skipped", "interrupted", "stopping_generation", "job", "job_count", "job_timestamp", "job_no",
              "sampling_step", "sampling_steps"}
EMBEDDING_KEYS = {"step", "sd_checkpoint", "sd_checkpoint_name", "shape", "vectors"}


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("a1111"), demo_dir)
    settings = Settings(data_dir=data, device="cpu", port=free_port(), max_upload_mib=2)
    with running_app(settings) as (server, engine):
        yield server.local_url.rstrip("/"), engine


@pytest.fixture(scope="module")
def api(app):
    return webuiapi.WebUIApi(baseurl=f"{app[0]}/sdapi/v1", sampler="Euler", steps=2)


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def _png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


# ------------------------------------------------------------------------------ schema, field by field
def test_txt2img_request_defaults_are_a1111s():
    assert Txt2ImgRequest().model_dump() == A1111_DEFAULTS


def test_list_endpoints_have_a1111s_fields(api):
    models = api.get_sd_models()
    titles = {m["title"] for m in models}
    assert SDXL in titles and any(t.startswith(f"{MODEL} [") for t in titles)
    for item in models:
        assert set(item) == {"title", "model_name", "hash", "sha256", "filename", "config"}
    loaded = next(m for m in models if m["title"].startswith(MODEL))
    assert loaded["title"] == f"{MODEL} [{loaded['hash']}]" and len(loaded["hash"]) == 10
    assert loaded["model_name"] == "tiny-sd15"
    for item in api.get_samplers():
        assert set(item) == {"name", "aliases", "options"} and isinstance(item["aliases"], list)
    assert {"Euler", "Euler a", "DPM++ 2M"} <= {s["name"] for s in api.get_samplers()}
    for item in api.get_schedulers():
        assert set(item) == {"name", "label", "aliases", "default_rho", "need_inner_model"}
    loras = {item["name"]: item for item in api.get_loras()}
    assert set(loras["style"]) == {"name", "alias", "path", "metadata"}
    assert loras["style"]["metadata"]["ss_tag_frequency"] == {"set": {"watercolor": 5, "fox": 3}}  # parsed JSON
    assert loras["style"]["path"].endswith("style.safetensors")


def test_embeddings_and_memory_have_a1111s_fields(api):
    found = api.get_embeddings()
    assert set(found) == {"loaded", "skipped"}
    assert set(found["loaded"]) == {"tiny-sd15-embedding"} and "tiny-sdxl-embedding" in found["skipped"]
    for item in [*found["loaded"].values(), *found["skipped"].values()]:
        assert set(item) == EMBEDDING_KEYS and isinstance(item["shape"], int) and item["vectors"] >= 1
    memory = api.get_memory()
    assert set(memory) == {"ram", "cuda"} and set(memory["ram"]) == {"free", "used", "total"}
    assert memory["ram"]["used"] > 0 and memory["cuda"] == {"error": "unavailable"}  # a CPU engine


def test_options_report_the_checkpoint_and_our_engine_settings(api, app):
    options = api.get_options()
    assert options["sd_model_checkpoint"].startswith(f"{MODEL} [")
    assert api.util_get_current_model() == options["sd_model_checkpoint"]
    assert options["steady_dtype"] == app[1].snapshot().requested_dtype
    assert options["steady_offload"] == app[1].snapshot().offload == "none"
    assert requests.post(f"{app[0]}/sdapi/v1/options", json=options).status_code == 200  # Open WebUI posts it back


@pytest.mark.gpu
def test_memory_reports_a1111s_cuda_counters_on_a_gpu():
    from app.a1111.listings import memory

    cuda = memory("cuda")["cuda"]
    assert set(cuda) == {"system", "active", "allocated", "reserved", "inactive", "events"}
    assert cuda["system"]["total"] > cuda["system"]["free"] > 0 and set(cuda["events"]) == {"retries", "oom"}


# ------------------------------------------------------------------------------ txt2img and png-info
def test_txt2img_with_a_lora_tag_applies_it_for_that_request_only(api, app):
    plain = api.txt2img(prompt="a fox", seed=11, **SMALL)
    tagged = api.txt2img(prompt="a fox <lora:style:0.8>", seed=11, **SMALL)
    assert len(tagged.images) == 1 and tagged.images[0].size == (64, 64)
    assert np.abs(_pixels(tagged.image) - _pixels(plain.image)).max() > 0  # the LoRA changed the picture
    assert app[1].snapshot().loras == ()  # and was taken off again
    text = tagged.image.info["parameters"]
    assert "<lora:style:0.8>" in text and "Lora hashes" in text and "Seed: 11" in text and f"Model: {MODEL}" in text
    assert tagged.info["infotexts"] == [text] and tagged.info["all_seeds"] == [11]
    assert tagged.info["sd_model_name"] == "tiny-sd15" and tagged.parameters["prompt"] == "a fox <lora:style:0.8>"
    again = api.txt2img(prompt="a fox", seed=11, **SMALL)
    assert np.array_equal(_pixels(again.image), _pixels(plain.image))


def test_txt2img_takes_a_step_scheduled_lora_tag_and_refuses_a_malformed_one(api, app):
    """The loractl tag `<lora:style:1@0,0@0.5>` through the A1111 API: another picture than the constant strength,
    the infotext keeps the schedule as typed, the LoRA is off again after; a malformed schedule is one clear error
    naming the tag, nothing generated."""
    small = {**SMALL, "steps": 3}
    constant = api.txt2img(prompt="a fox <lora:style:1>", seed=12, **small)
    scheduled = api.txt2img(prompt="a fox <lora:style:1@0,0@0.5>", seed=12, **small)
    assert not np.array_equal(_pixels(constant.image), _pixels(scheduled.image))
    assert scheduled.image.info["parameters"].startswith("a fox <lora:style:1@0,0@0.5>\n")
    assert app[1].snapshot().loras == ()
    answer = requests.post(f"{app[0]}/sdapi/v1/txt2img", json={"prompt": "a fox <lora:style:1@0,0>", **small},
                           timeout=60)
    assert answer.status_code in (400, 422), answer.text
    assert "<lora:style:1@0,0>" in answer.text and "@step" in answer.text


def test_a1111_emphasis_and_long_prompts_reach_the_picture(api):
    """Prompts mean what they mean in A1111: `a (cat:1.0)` is `a cat` bit for bit, `(cat:1.5)` is another
    picture, and words past CLIP's 77th token change the picture (75-token chunks, not a silent cut)."""
    def picture(prompt: str) -> np.ndarray:
        return _pixels(api.txt2img(prompt=prompt, seed=5, **SMALL).image)

    plain = picture("a cat")
    assert np.array_equal(picture("a (cat:1.0)"), plain)
    assert not np.array_equal(picture("a (cat:1.5)"), plain)
    words = " ".join(["red"] * 80)  # 80 tokens: what follows is in the second chunk
    assert not np.array_equal(picture(f"{words} fox"), picture(f"{words} owl"))


def test_lora_tags_and_embeddings_work_inside_weighted_parts(api):
    """A `<lora:…>` tag inside `( … :1.5)` still applies the LoRA (and leaves the weighting to the words),
    and an embedding's name inside brackets takes the weight like any word."""
    def made(prompt: str):
        return api.txt2img(prompt=prompt, seed=6, **SMALL)

    weighted, tagged = made("a (cat:1.5)"), made("a (cat <lora:style:0.8>:1.5)")
    assert "Lora hashes" in tagged.image.info["parameters"] and "Lora hashes" not in weighted.image.info["parameters"]
    assert not np.array_equal(_pixels(tagged.image), _pixels(weighted.image))
    assert not np.array_equal(_pixels(tagged.image), _pixels(made("a cat <lora:style:0.8>").image))
    embedding = "tiny-sd15-embedding"
    assert not np.array_equal(_pixels(made(f"a ({embedding}:1.5)").image), _pixels(made(f"a {embedding}").image))


def test_clip_skip_is_a1111s_option_and_override_and_is_written_into_the_infotext(api, app):
    """`CLIP_stop_at_last_layers` per request (`override_settings`) or as the API's option: the picture
    changes, the infotext carries `Clip skip: 2` (absent at 1, as A1111 writes it), and so does `info`."""
    one = api.txt2img(prompt="a fox", seed=2, **SMALL)
    two = api.txt2img(prompt="a fox", seed=2, override_settings={"CLIP_stop_at_last_layers": 2}, **SMALL)
    assert "Clip skip" not in one.image.info["parameters"] and "Clip skip: 2" in two.image.info["parameters"]
    assert (one.info["clip_skip"], two.info["clip_skip"]) == (1, 2) and "ignored" not in two.info["comments"]
    assert not np.array_equal(_pixels(one.image), _pixels(two.image))
    try:
        api.set_options({"CLIP_stop_at_last_layers": 2})
        assert api.get_options()["CLIP_stop_at_last_layers"] == 2
        assert np.array_equal(_pixels(api.txt2img(prompt="a fox", seed=2, **SMALL).image), _pixels(two.image))
    finally:
        api.set_options({"CLIP_stop_at_last_layers": 1})


def test_txt2img_echoes_a1111_parameters_and_rounds_sizes_with_a_note(app):
    body = {"prompt": "a fox", "seed": 3, "steps": 2, "width": 100, "height": 64, "batch_size": 2, "n_iter": 1}
    answer = requests.post(f"{app[0]}/sdapi/v1/txt2img", json=body).json()
    assert set(answer) == {"images", "parameters", "info"} and len(answer["images"]) == 2
    assert set(answer["parameters"]) == set(A1111_DEFAULTS) and answer["parameters"]["width"] == 100
    info = json.loads(answer["info"])
    assert info["width"] == 96 and "width 100 → 96" in info["comments"] and info["all_seeds"] == [3, 4]
    assert _png(answer["images"][0]).size == (96, 64)


def test_styles_and_variation_seeds_through_the_api(api, app):
    """`GET /prompt-styles` lists `styles.csv` with A1111's fields; `styles` apply to the prompts as A1111
    applies them (the infotext holds the styled prompt, `info.styles` the names); `subseed` at
    `subseed_strength` 1 gives the variation seed's image with A1111's `info` fields; an unknown style
    is refused by name."""
    save_style(app[1].settings.styles_file, PromptStyle("frame", "framed, {prompt}", "blurry"))
    assert requests.get(f"{app[0]}/sdapi/v1/prompt-styles").json() == [
        {"name": "frame", "prompt": "framed, {prompt}", "negative_prompt": "blurry"}]
    styled = api.txt2img(prompt="a fox", styles=["frame"], seed=4, **SMALL)
    assert styled.image.info["parameters"].startswith("framed, a fox\nNegative prompt: blurry\n")
    assert styled.info["styles"] == ["frame"] and styled.info["all_prompts"] == ["framed, a fox"]
    varied = api.txt2img(prompt="a fox", seed=4, subseed=11, subseed_strength=1.0, batch_size=2, **SMALL)
    plain = api.txt2img(prompt="a fox", seed=11, batch_size=2, **SMALL)
    assert all(np.array_equal(_pixels(a), _pixels(b)) for a, b in zip(varied.images, plain.images, strict=True))
    assert (varied.info["all_seeds"], varied.info["all_subseeds"], varied.info["subseed_strength"]) == (
        [4, 4], [11, 12], 1.0)
    unknown = requests.post(f"{app[0]}/sdapi/v1/txt2img", json={**SMALL, "styles": ["nope"]})
    assert unknown.status_code == 422 and "'nope'" in unknown.text


def test_refiner_fields_run_the_refiner_on_sdxl_and_are_refused_where_there_is_none(api, app):
    """`refiner_checkpoint` (a title or name) and `refiner_switch_at` finish an SDXL image with the refiner
    (its infotext names it as A1111 does); on SD1.5, which has no refiner stage, they are refused (422)."""
    body = {**SMALL, "prompt": "a fox", "seed": 2, "refiner_checkpoint": "tiny-sdxl", "refiner_switch_at": 0.5,
            "override_settings": {"sd_model_checkpoint": SDXL}}
    text = json.loads(requests.post(f"{app[0]}/sdapi/v1/txt2img", json=body).json()["info"])["infotexts"][0]
    assert f"Model: {SDXL}" in text and f"Refiner: {SDXL} [" in text and "Refiner switch at: 0.5" in text
    refused = requests.post(f"{app[0]}/sdapi/v1/txt2img", json={**SMALL, "refiner_checkpoint": SDXL})
    assert refused.status_code == 422 and "no refiner stage" in refused.text


# ------------------------------------------------------------------------------ img2img, inpaint, hires fix
def _init_picture() -> Image.Image:
    """A 64x64 picture with structure (a gradient and a square), so a resize or repaint shows."""
    ramp = np.tile(np.linspace(0, 255, 64, dtype=np.uint8), (64, 1))
    pixels = np.stack([ramp, ramp.T, np.full_like(ramp, 90)], axis=-1)
    pixels[20:44, 20:44] = (230, 40, 40)
    return Image.fromarray(pixels)


def test_img2img_is_the_engines_img2img_bit_for_bit(api, app):
    init = _init_picture()
    made = api.img2img(images=[init], prompt="a fox", seed=5, denoising_strength=0.5, **{**SMALL, "steps": 4})
    assert made.image.size == (64, 64) and made.info["denoising_strength"] == 0.5
    assert "Denoising strength: 0.5" in made.image.info["parameters"]
    same = app[1].img2img(_params(app, seed=5, steps=4), [init], denoising_strength=0.5)
    assert np.array_equal(_pixels(made.image), _pixels(same[0].image))  # the API adds nothing of its own
    assert np.abs(_pixels(made.image) - _pixels(init)).max() > 0


def _params(app, **changes):
    """The engine's parameters for the `SMALL` request with `changes`, as the UI's form builds them."""
    values = {"prompt": "a fox", "negative_prompt": "", "sampler": "Euler", "steps": 2, "cfg": 5.0, "seed": 0,
              "width": 64, "height": 64, "batch": 1, "n_iter": 1} | changes
    return params_from_form(values, app[1].snapshot().family)[0]


def test_inpaint_keeps_the_unmasked_pixels_and_says_only_masked_is_not_built(api, app):
    init, mask = _init_picture(), Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    made = api.img2img(images=[init], mask_image=mask, mask_blur=0, inpainting_fill=1, prompt="a fox", seed=8,
                       denoising_strength=0.9, **{**SMALL, "steps": 4})
    out, before = _pixels(made.image), _pixels(init)
    assert np.array_equal(out[:8], before[:8]) and np.array_equal(out[:, :8], before[:, :8])  # outside the mask
    assert np.abs(out[20:44, 20:44] - before[20:44, 20:44]).max() > 0  # inside it was repainted
    assert "Mask blur: 0" in made.image.info["parameters"] and "only masked" in made.info["comments"]


def test_txt2img_with_enable_hr_runs_the_hires_fix(api, app):
    made = api.txt2img(prompt="a fox", seed=9, enable_hr=True, hr_scale=2, hr_upscaler="Latent", hr_second_pass_steps=2,
                       denoising_strength=0.6, **SMALL)
    assert made.image.size == (128, 128) and made.info["denoising_strength"] == 0.6
    text = made.image.info["parameters"]
    assert "Hires upscale: 2" in text and "Hires upscaler: Latent" in text and "Size: 128x128" not in text
    pixel = api.txt2img(prompt="a fox", seed=9, enable_hr=True, hr_scale=1.5, hr_upscaler="Lanczos",
                        denoising_strength=0.5, **SMALL)
    assert pixel.image.size == (96, 96) and "Hires upscaler: Lanczos" in pixel.image.info["parameters"]


def test_the_upscaler_lists_name_what_the_hires_fix_takes(api):
    listed = api.get_upscalers()
    assert [u.get("name") for u in listed] == ["None", "Lanczos", "Nearest", "tiny-realesrgan-x4"]
    assert listed[-1]["model_name"] == "RealESRGAN" and listed[-1]["scale"] == 4
    assert listed[-1]["model_path"].endswith("models/RealESRGAN/tiny-realesrgan-x4.safetensors")
    assert "Latent (bicubic antialiased)" in [m["name"] for m in api.get_latent_upscale_modes()]


def test_extras_through_webuiapi_upscale_with_the_model_and_keep_the_source_infotext(api, app):
    """`webuiapi`'s `extra_single_image` and `extra_batch_images` with the demo upscaler model: sizes by
    A1111's rules, the postprocessing text as A1111 writes it (in `html_info` and the PNG) with the source
    image's `parameters` kept; face restoration with no model in models/GFPGAN is refused with a 422 naming it."""
    made = api.txt2img(prompt="a fox", seed=4, **SMALL)
    single = api.extra_single_image(made.image, upscaler_1="tiny-realesrgan-x4", upscaling_resize=2)
    assert single.image.size == (128, 128)
    assert single.info == "Postprocess upscale by: 2, Postprocess upscaler: tiny-realesrgan-x4"
    assert single.image.info["parameters"] == made.image.info["parameters"]
    assert single.image.info["postprocessing"] == single.info
    batch = api.extra_batch_images([made.image, made.image], upscaler_1="Lanczos", resize_mode=1,
                                   upscaling_resize_w=96, upscaling_resize_h=80, upscaler_2="tiny-realesrgan-x4",
                                   extras_upscaler_2_visibility=0.5)
    assert [im.size for im in batch.images] == [(96, 80), (96, 80)]
    assert batch.info == ("Postprocess upscale to: 96x80, Postprocess crop to: 96x80, Postprocess upscaler: Lanczos, "
                          "Postprocess upscaler 2: tiny-realesrgan-x4")
    refused = requests.post(f"{app[0]}/sdapi/v1/extra-single-image",
                            json={"image": webuiapi.raw_b64_img(made.image), "gfpgan_visibility": 0.5}, timeout=60)
    assert refused.status_code == 422 and "a GFPGAN model file" in refused.json()["detail"]
    assert "models/GFPGAN under" in refused.json()["detail"]


def test_png_info_reads_our_own_output(api, app):
    made = api.txt2img(prompt="a fox <lora:style:0.5>", negative_prompt="blur", seed=21, **SMALL)
    read = api.png_info(made.image)
    assert read.info == made.image.info["parameters"]
    raw = requests.post(f"{app[0]}/sdapi/v1/png-info",
                        json={"image": "data:image/png;base64," + webuiapi.raw_b64_img(made.image)}).json()
    assert set(raw) == {"info", "items", "parameters"} and raw["info"] == read.info
    params = raw["parameters"]
    assert params["Prompt"] == "a fox <lora:style:0.5>" and params["Negative prompt"] == "blur"
    assert (params["Steps"], params["Seed"], params["Size-1"], params["Size-2"]) == ("2", "21", "64", "64")


def test_png_info_takes_images_over_the_json_cap_up_to_the_upload_cap(app):
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (700, 700, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    assert 2**20 < len(encoded) < 2 * 2**20 * 4 // 3  # over the guard's 1 MiB, under 2 MiB of image
    answer = requests.post(f"{app[0]}/sdapi/v1/png-info", json={"image": encoded})
    assert answer.status_code == 200 and answer.json()["info"] == ""
    too_big = requests.post(f"{app[0]}/sdapi/v1/png-info", json={"image": encoded * 2})
    assert too_big.status_code == 413


# ------------------------------------------------------------------------------ checkpoints
def test_options_switch_the_checkpoint_by_any_of_its_names(api, app):
    try:
        api.set_options({"sd_model_checkpoint": SDXL})
        assert app[1].snapshot().model == SDXL and app[1].snapshot().family == "sdxl"
        assert api.get_options()["sd_model_checkpoint"].startswith(f"{SDXL} [")
        api.set_options({"sd_model_checkpoint": "tiny-sd15"})  # A1111's model_name works too
        assert app[1].snapshot().model == MODEL
    finally:
        app[1].load_model(MODEL)


def test_override_settings_switch_for_one_request_and_restore(api, app):
    made = api.txt2img(prompt="a fox", seed=1, override_settings={"sd_model_checkpoint": SDXL,
                                                                    "sd_vae": "other.safetensors"}, **SMALL)
    assert f"Model: {SDXL}" in made.image.info["parameters"] and made.info["sd_model_name"] == "tiny-sdxl"
    assert "sd_vae='other.safetensors' ignored" in made.info["comments"]
    assert app[1].snapshot().model == MODEL  # restored afterwards, as A1111 does by default
    try:
        api.txt2img(prompt="a fox", override_settings={"sd_model_checkpoint": SDXL},
                    override_settings_restore_afterwards=False, **SMALL)
        assert app[1].snapshot().model == SDXL
    finally:
        app[1].load_model(MODEL)


def test_unload_then_reload_or_generate_brings_the_checkpoint_back(api, app):
    base = f"{app[0]}/sdapi/v1"
    assert requests.post(f"{base}/unload-checkpoint").json() == {}
    assert app[1].snapshot().model is None
    assert api.get_options()["sd_model_checkpoint"] == MODEL  # what the next request loads
    assert requests.post(f"{base}/reload-checkpoint").json() == {}
    assert app[1].snapshot().model == MODEL
    requests.post(f"{base}/unload-checkpoint")
    assert len(api.txt2img(prompt="a fox", **SMALL).images) == 1  # loads on demand, as A1111
    assert app[1].snapshot().model == MODEL
    assert requests.post(f"{base}/refresh-checkpoints").status_code == 200
    assert requests.post(f"{base}/refresh-loras").status_code == 200


# ------------------------------------------------------------------------------ progress, interrupt, skip
class Background:
    """A txt2img (or another endpoint's request) running in a thread, its answer kept."""

    def __init__(self, url: str, body: dict, endpoint: str = "txt2img") -> None:
        self.answer = None
        self.thread = threading.Thread(target=self._post, args=(f"{url}/sdapi/v1/{endpoint}", body), daemon=True)
        self.thread.start()

    def _post(self, url: str, body: dict) -> None:
        self.answer = requests.post(url, json=body, timeout=300)

    def progress_when(self, url: str, ready, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = requests.get(f"{url}/sdapi/v1/progress").json()
            if ready(seen):
                return seen
            time.sleep(0.05)
        raise AssertionError(f"progress never got there; last: {seen}")


def test_progress_while_a_job_runs_then_interrupt_keeps_the_partial_image(app):
    url = app[0]
    job = Background(url, {"prompt": "a fox", "steps": 150, "width": 64, "height": 64, "seed": 2})
    seen = job.progress_when(url, lambda p: p["state"]["sampling_step"] >= 5 and p["current_image"])
    assert set(seen) == {"progress", "eta_relative", "state", "current_image", "textinfo"}
    assert set(seen["state"]) == STATE_KEYS and seen["state"]["sampling_steps"] == 150
    assert seen["state"]["job_count"] == 1 and seen["state"]["job"] == "txt2img"
    assert 0.01 < seen["progress"] < 1 and seen["eta_relative"] > 0
    assert _png(seen["current_image"]).size == (8, 8)  # the live preview: one pixel per latent pixel
    skipped = requests.get(f"{url}/sdapi/v1/progress", params={"skip_current_image": True}).json()
    assert skipped["current_image"] is None
    assert requests.post(f"{url}/sdapi/v1/interrupt").json() == {}
    job.thread.join(120)
    answer = job.answer.json()
    info = json.loads(answer["info"])
    assert job.answer.status_code == 200 and len(answer["images"]) == 1 and info["interrupted"] is True
    idle = requests.get(f"{url}/sdapi/v1/progress").json()
    assert idle["progress"] == 0 and idle["state"]["job_count"] == 0 and idle["current_image"] is None


def test_skip_ends_one_run_and_the_next_runs(app):
    url = app[0]
    job = Background(url, {"prompt": "a fox", "steps": 40, "width": 64, "height": 64, "seed": 2, "n_iter": 2})
    seen = job.progress_when(url, lambda p: p["state"]["sampling_step"] >= 2)
    assert (seen["state"]["job_no"], seen["state"]["job_count"]) == (0, 2)
    assert requests.post(f"{url}/sdapi/v1/skip").status_code == 200
    job.progress_when(url, lambda p: p["state"]["job_no"] == 1 or p["state"]["job_count"] == 0)
    job.thread.join(120)
    info = json.loads(job.answer.json()["info"])
    assert info["all_seeds"] == [2, 3] and info["interrupted"] is True  # run 1 cut short, run 2 whole


def _b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _stop_mid_run(app, endpoint: str, body: dict, stop: str, phase: str) -> tuple[int, dict, list]:
    """Start a long request, send `stop` once its denoising `phase` is 3 steps in; returns (the
    step the engine had reached when the stop was sent, the answer's info, its images)."""
    url, engine = app
    job = Background(url, body, endpoint)
    job.progress_when(url, lambda p: p["state"]["sampling_step"] >= 3 and phase in (p["textinfo"] or ""))
    asked_at = engine.snapshot().progress.step
    assert requests.post(f"{url}/sdapi/v1/{stop}").status_code == 200
    job.thread.join(120)
    assert job.answer.status_code == 200, job.answer.text
    answer = job.answer.json()
    return asked_at, json.loads(answer["info"]), [_png(b64) for b64 in answer["images"]]


def _stopped_at(info: dict) -> list[int]:
    return [int(n) for n in re.findall(r"stopped at step (\d+)", info["comments"])]


@pytest.mark.parametrize(("masked", "stop"), [(False, "interrupt"), (True, "interrupt"), (True, "skip")],
                         ids=["img2img-interrupt", "inpaint-interrupt", "inpaint-skip"])
def test_interrupt_and_skip_stop_img2img_and_inpaint_within_one_step(app, masked, stop):
    """Issue 32: `/interrupt` and `/skip` during an img2img or inpaint run answered 200 while the run
    went on to step 150 with `interrupted: false`. They must stop the pass within one step, mark the
    answer interrupted, return the partial image (as txt2img does); an interrupted run is listed so.
    Issue 45 (10): the PNG's infotext keeps the asked steps (A1111's) and says the step it stopped at."""
    body = {"init_images": [_b64(_init_picture())], "prompt": "a fox", "steps": 150, "width": 64, "height": 64,
            "seed": 4, "denoising_strength": 1.0, "sampler_name": "Euler"}
    if masked:
        mask = Image.new("L", (64, 64), 0)
        mask.paste(255, (16, 16, 48, 48))
        body |= {"mask": _b64(mask), "mask_blur": 0}
    kind = "inpaint" if masked else "img2img"
    asked_at, info, images = _stop_mid_run(app, "img2img", body, stop, kind)
    (stopped_at,) = _stopped_at(info)
    assert info["interrupted"] is True and asked_at <= stopped_at <= asked_at + 1 < 150
    assert len(images) == 1 and images[0].size == (64, 64) and "Steps: 150" in images[0].info["parameters"]
    assert re.search(rf"Stopped at step: {stopped_at}\b", images[0].info["parameters"])  # 45 (10): not 150 alone
    rows = [(h.command, h.outcome) for h in app[1].snapshot().history]
    assert (kind, "interrupted" if stop == "interrupt" else "ok") in rows[-3:]


def test_interrupt_reaches_the_hires_pass(app):
    """The hires fix's second pass is a stage of its own (issue 32: no stop reached it): Interrupt
    ends it within one step and the answer is the partial image at the hires size."""
    body = {"prompt": "a fox", "steps": 2, "width": 64, "height": 64, "seed": 6, "sampler_name": "Euler",
            "enable_hr": True, "hr_scale": 1.5, "hr_upscaler": "Latent", "hr_second_pass_steps": 150,
            "denoising_strength": 1.0}
    asked_at, info, images = _stop_mid_run(app, "txt2img", body, "interrupt", "hires pass")
    (stopped_at,) = _stopped_at(info)
    assert info["interrupted"] is True and asked_at <= stopped_at <= asked_at + 1 < 150
    assert images[0].size == (96, 96) and re.search(rf"Stopped at step: {stopped_at}\b", images[0].info["parameters"])
    assert [h.outcome for h in app[1].snapshot().history if h.command == "hires fix"][-1] == "interrupted"


# ------------------------------------------------------------------------------ /steady/v1 extras
def test_steady_extras(api, app):
    url = app[0]
    api.txt2img(prompt="a fox <lora:style:1>", **SMALL)
    snapshot = requests.get(f"{url}/steady/v1/snapshot").json()
    assert snapshot["model"] == MODEL and snapshot["state"] == "READY" and snapshot["history"]
    rows = requests.get(f"{url}/steady/v1/placement").json()
    assert rows and {"component", "module", "device", "storage", "compute", "violation"} <= set(rows[0])
    counters = requests.get(f"{url}/steady/v1/lora-counters").json()
    assert counters["style"]["matched_layers"] == 2
    report = requests.get(f"{url}/steady/v1/bug-report")
    assert report.headers["content-type"] == "application/zip"
    assert {"report.json", "card.png"} <= set(zipfile.ZipFile(io.BytesIO(report.content)).namelist())


def test_each_answered_image_is_encoded_once_and_is_the_saved_file(app, monkeypatch):
    """Issue 41 part 1 (per-image time): a PNG encode costs ~120 ms of CPU per 1024² image; the engine saves
    each image and the answer used to encode it a second time. Now an API txt2img of two images encodes two
    PNGs, and each answered image is byte for byte the file saved in outputs."""
    from PIL import PngImagePlugin

    encodes = []
    real = PngImagePlugin._save
    monkeypatch.setattr(PngImagePlugin, "_save", lambda *a, **k: encodes.append(1) or real(*a, **k))
    monkeypatch.setitem(Image.SAVE, "PNG", PngImagePlugin._save)
    url, engine = app
    before = set(engine.settings.outputs_dir.rglob("*.png"))
    answer = requests.post(f"{url}/sdapi/v1/txt2img", json={"prompt": "a cat", **SMALL, "batch_size": 2}, timeout=120)
    assert answer.status_code == 200, answer.text[:300]
    assert len(encodes) == 2, f"{len(encodes)} PNG encodes for 2 images"
    saved = {path.read_bytes() for path in set(engine.settings.outputs_dir.rglob("*.png")) - before}
    sent = {base64.b64decode(b64) for b64 in answer.json()["images"]}
    assert len(saved) == len(sent) == 2 and sent == saved


# ------------------------------------------------------------------------------ ADetailer (alwayson_scripts)
def test_webuiapi_adetailer_runs_the_detail_pass_and_writes_adetailers_infotext(api, app):
    """`webuiapi.ADetailer(...)` on txt2img: the built-in face detector runs as the job's `detail detect`
    stage; on the tiny model's picture it finds no face, so the image is the plain txt2img's bit for bit and
    the answer's comments say so; the infotext carries ADetailer's keys, which PNG Info reads back."""
    unit = webuiapi.ADetailer(ad_model="face_opencv_haar", ad_prompt="a detailed face", ad_denoising_strength=0.5)
    # a fresh dict: webuiapi fills its default `alwayson_scripts={}` in place, and every later call would send it
    made = api.txt2img(prompt="a fox", seed=4, adetailer=[unit], alwayson_scripts={}, **SMALL)
    plain = api.txt2img(prompt="a fox", seed=4, **SMALL)
    assert np.array_equal(_pixels(made.image), _pixels(plain.image))
    assert "face_opencv_haar found nothing" in made.info["comments"]
    text = made.image.info["parameters"]
    assert 'ADetailer model: face_opencv_haar' in text and 'ADetailer prompt: a detailed face' in text
    assert "ADetailer version: 25.3.0" in text
    history = [row.command for row in app[1].snapshot().history]
    assert "detail detect" in history and "txt2img" in history
    read = requests.post(f"{app[0]}/sdapi/v1/png-info",
                         json={"image": "data:image/png;base64," + webuiapi.raw_b64_img(made.image)}).json()
    assert read["parameters"]["ADetailer model"] == "face_opencv_haar"
    assert read["parameters"]["ADetailer denoising strength"] in ("0.5", 0.5)


def test_webuiapi_adetailer_skip_img2img_details_the_init_image_as_it_is(api, app):
    """img2img with ADetailer's "skip img2img" (`adetailer_skip_img2img` / args[1]): no img2img pass runs,
    the picture is detailed as it is (nothing found here: returned bit for bit); a unit this app cannot run
    or a pickled detector is refused with one message naming it (422), before anything runs."""
    init = _init_picture()
    start = len(app[1].snapshot().history)
    unit = webuiapi.ADetailer(ad_model="face_opencv_haar")
    body = {"init_images": [webuiapi.raw_b64_img(init)], "prompt": "a fox", "seed": 3, **SMALL,
            "alwayson_scripts": {"ADetailer": {"args": [True, True, unit.to_dict()]}}}
    answer = requests.post(f"{app[0]}/sdapi/v1/img2img", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert np.array_equal(_pixels(_png(answer.json()["images"][0])), _pixels(init))
    commands = [row.command for row in app[1].snapshot().history[start:]]
    assert "detail detect" in commands and "img2img" not in commands
    for bad, named in (({"ad_model": "face_yolov8n.pt"}, "face_yolov8n.pt"),
                       ({"ad_model": "face_opencv_haar", "ad_restore_face": True}, "ad_restore_face")):
        body["alwayson_scripts"] = {"ADetailer": {"args": [True, False, bad]}}
        refused = requests.post(f"{app[0]}/sdapi/v1/img2img", json=body, timeout=60)
        assert refused.status_code == 422 and named in refused.text, refused.text
    body["alwayson_scripts"] = {"SomeOtherExtension": {"args": []}}
    refused = requests.post(f"{app[0]}/sdapi/v1/img2img", json=body, timeout=60)
    assert refused.status_code == 422 and "SomeOtherExtension" in refused.text
