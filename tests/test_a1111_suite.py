"""A1111's own API test suite, as requests: each family's tiny demo model answers them all as A1111 does.

stable-diffusion-webui's `test/` (`test_txt2img.py`, `test_img2img.py`, `test_extras.py`, `test_utils.py`) is 29
requests that A1111 answers 200. The same requests (its fields and values, written out here) go to the served app
with each family's demo checkpoint loaded in turn, through `POST /options` as a client switches: every one answers
200 with an image where one is due, and the work asked for was done (a sampler the family has no counterpart for
runs its nearest and the answer says so; tiling is in the infotext; hires at denoising strength 0 is the upscale;
SD upscale answers the upscaled size; restore_faces runs the tiny face restorer in models/GFPGAN). With no
face-restoration model installed A1111 would download one, which this app never does: a 422 naming the folders.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
import requests
from face_models import write_tiny_restorer
from PIL import Image, ImageDraw
from served_app import free_port, make_ui_data, running_app

from app.families import FAMILIES
from app.settings import Settings

# One checkpoint per family: its single file where the demo writes one, else its diffusers folder.
CHECKPOINTS = {name: f"tiny-{name}.safetensors" if "file" in fam.files.layouts else f"tiny-{name}-diffusers"
               for name, fam in FAMILIES.items()}
TXT2IMG = {  # test_txt2img.py's request
    "batch_size": 1, "cfg_scale": 7, "denoising_strength": 0, "enable_hr": False, "eta": 0, "firstphase_height": 0,
    "firstphase_width": 0, "height": 64, "n_iter": 1, "negative_prompt": "", "prompt": "example prompt",
    "restore_faces": False, "s_churn": 0, "s_noise": 1, "s_tmax": 0, "s_tmin": 0, "sampler_index": "Euler a",
    "seed": -1, "seed_resize_from_h": -1, "seed_resize_from_w": -1, "steps": 3, "styles": [], "subseed": -1,
    "subseed_strength": 0, "tiling": False, "width": 64,
}
TXT2IMG_VARIANTS = {  # test name -> the fields it changes
    "simple": {}, "negative_prompt": {"negative_prompt": "example negative prompt"},
    "complex_prompt": {"prompt": "((emphasis)), (emphasis1:1.1), [to:1], [from::2], [from:to:0.3], [alt|alt1]"},
    "not_square": {"height": 128}, "hrfix": {"enable_hr": True}, "tiling": {"tiling": True},
    "sampler_PLMS": {"sampler_index": "PLMS"}, "sampler_DDIM": {"sampler_index": "DDIM"},
    "sampler_UniPC": {"sampler_index": "UniPC"}, "multiple_batches": {"n_iter": 2}, "batch": {"batch_size": 2},
}
IMG2IMG = {  # test_img2img.py's request (its init image and mask: ours, drawn below)
    "batch_size": 1, "cfg_scale": 7, "denoising_strength": 0.75, "eta": 0, "height": 64, "include_init_images": False,
    "inpaint_full_res": False, "inpaint_full_res_padding": 0, "inpainting_fill": 0, "inpainting_mask_invert": False,
    "mask": None, "mask_blur": 4, "n_iter": 1, "negative_prompt": "", "override_settings": {},
    "prompt": "example prompt", "resize_mode": 0, "restore_faces": False, "s_churn": 0, "s_noise": 1, "s_tmax": 0,
    "s_tmin": 0, "sampler_index": "Euler a", "seed": -1, "seed_resize_from_h": -1, "seed_resize_from_w": -1,
    "steps": 3, "styles": [], "subseed": -1, "subseed_strength": 0, "tiling": False, "width": 64,
}
LISTINGS = ("cmd-flags", "samplers", "upscalers", "sd-models", "hypernetworks", "face-restorers", "realesrgan-models",
            "prompt-styles", "embeddings")


def _b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _picture() -> Image.Image:
    image = Image.new("RGB", (64, 64), (200, 120, 60))
    ImageDraw.Draw(image).ellipse((12, 12, 52, 52), fill=(40, 90, 200))
    return image


def _mask() -> Image.Image:
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((16, 16, 48, 48), fill=255)
    return mask


@pytest.fixture(scope="module")
def suite_data(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("a1111-suite"), demo_dir)
    write_tiny_restorer(data / "models" / "GFPGAN" / "tiny-face.safetensors")
    return data


@pytest.fixture(scope="module")
def base(suite_data):
    settings = Settings(data_dir=suite_data, device="cpu", port=free_port())
    with running_app(settings) as (server, _engine):
        yield f"{server.local_url.rstrip('/')}/sdapi/v1"


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_name(request, base) -> str:
    """Each family's demo checkpoint loaded in turn, as a client switches (`POST /options`)."""
    name = CHECKPOINTS[request.param]
    answer = requests.post(f"{base}/options", json={"sd_model_checkpoint": name}, timeout=300)
    assert answer.status_code == 200, answer.text
    return request.param


def _refused_by_name(url: str, body: dict, family_name: str, workflow: str) -> bool:
    """A family that declares no stage pipeline for `workflow` (img2img, inpaint) answers A1111's request with a
    422 naming the workflow and the family, never a 500 or a wrong image: True when that is what happened, False
    when the family has the workflow (the caller then checks the 200). Hires fix at strength 0 (the suite's) is
    the upscale alone and answers 200 on every family."""
    if workflow in FAMILIES[family_name].stage_pipelines:
        return False
    answer = requests.post(url, json=body, timeout=300)
    assert answer.status_code == 422, answer.text
    assert f"{workflow} is not available for {FAMILIES[family_name].label}" in answer.json()["detail"], answer.text
    return True


def _post(url: str, body: dict) -> dict:
    answer = requests.post(url, json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("variant", list(TXT2IMG_VARIANTS))
def test_a1111_txt2img_requests(base, family_name, variant):
    """test_txt2img.py: each request answers 200 with its images at the asked size, and did what it asked."""
    changes = TXT2IMG_VARIANTS[variant]
    out = _post(f"{base}/txt2img", {**TXT2IMG, **changes})
    info = json.loads(out["info"])
    count = changes.get("n_iter", 1) * changes.get("batch_size", 1)
    scale = 2 if changes.get("enable_hr") else 1
    size = (64 * scale, changes.get("height", 64) * scale)
    assert [_image(b64).size for b64 in out["images"]] == [size] * count
    if changes.get("tiling"):
        assert all("Tiling: True" in text for text in info["infotexts"])
    if changes.get("enable_hr"):  # strength 0: the upscale alone, no second pass
        assert "Denoising strength: 0," in info["infotexts"][0]
    asked = changes.get("sampler_index", "Euler a")
    ran = info["sampler_name"]
    assert ran == asked or f"sampler {asked}: " in info["comments"], (ran, info["comments"])


@pytest.mark.parametrize("variant", ["simple", "masked", "inverted_mask", "sd_upscale"])
def test_a1111_img2img_requests(base, family_name, variant):
    """test_img2img.py: img2img, inpaint with a mask and with it inverted, and the "SD upscale" script (overlap 8,
    Lanczos, scale 2: the 64² picture comes back at 128²)."""
    body = {**IMG2IMG, "init_images": [_b64(_picture())]}
    if variant in ("masked", "inverted_mask"):
        body.update(mask=_b64(_mask()), inpainting_mask_invert=variant == "inverted_mask")
    if variant == "sd_upscale":
        body.update(script_name="sd upscale", script_args=["", 8, "Lanczos", 2.0])
    workflow = "inpaint" if variant in ("masked", "inverted_mask") else "img2img"
    if _refused_by_name(f"{base}/img2img", body, family_name, workflow):
        return
    out = _post(f"{base}/img2img", body)
    assert [_image(b64).size for b64 in out["images"]] == [(128, 128) if variant == "sd_upscale" else (64, 64)]


def test_a1111_restore_faces(base, suite_data, tmp_path):
    """test_txt2img.py's restore_faces request (and img2img's): 200 with the face model in models/GFPGAN and
    A1111's infotext `Face restoration: GFPGAN`; with the folder emptied (A1111 would download a model, this app
    never does) one clear 422 naming the folders."""
    for route, body in (("txt2img", TXT2IMG), ("img2img", {**IMG2IMG, "init_images": [_b64(_picture())]})):
        out = _post(f"{base}/{route}", {**body, "restore_faces": True})
        assert len(out["images"]) == 1 and "Face restoration: GFPGAN" in json.loads(out["info"])["infotexts"][0]
    model = suite_data / "models" / "GFPGAN" / "tiny-face.safetensors"
    moved = model.rename(tmp_path / model.name)
    try:
        answer = requests.post(f"{base}/txt2img", json={**TXT2IMG, "restore_faces": True}, timeout=60)
    finally:
        moved.rename(model)
    assert answer.status_code == 422
    assert "face restoration" in answer.json()["detail"] and "models/GFPGAN or models/Codeformer" in \
        answer.json()["detail"]


def test_a1111_extras_requests(base):
    """test_extras.py: Lanczos x2 upscale, and the two requests that send only the image (to the same route; no
    upscaler named: the picture comes back as it was)."""
    picture = _b64(_picture())
    upscale = {"resize_mode": 0, "show_extras_results": True, "gfpgan_visibility": 0, "codeformer_visibility": 0,
               "codeformer_weight": 0, "upscaling_resize": 2, "upscaling_resize_w": 128, "upscaling_resize_h": 128,
               "upscaling_crop": True, "upscaler_1": "Lanczos", "upscaler_2": "None",
               "extras_upscaler_2_visibility": 0, "image": picture}
    assert _image(_post(f"{base}/extra-single-image", upscale)["image"]).size == (128, 128)
    for body in ({"image": picture}, {"image": picture, "model": "clip"}):  # upscaler "None": the picture as sent
        assert _image(_post(f"{base}/extra-single-image", body)["image"]).size == (64, 64)


def test_a1111_options_and_listings(base):
    """test_utils.py: `send_seed` written and read back, and every listing route answers 200 with what the app has."""
    before = requests.get(f"{base}/options", timeout=60).json()["send_seed"]
    assert requests.post(f"{base}/options", json={"send_seed": not before}, timeout=60).status_code == 200
    assert requests.get(f"{base}/options", timeout=60).json()["send_seed"] is (not before)
    assert requests.post(f"{base}/options", json={"send_seed": before}, timeout=60).status_code == 200
    answers = {}
    for route in LISTINGS:
        answer = requests.get(f"{base}/{route}", timeout=60)
        assert answer.status_code == 200, (route, answer.text)
        answers[route] = answer.json()
    assert answers["hypernetworks"] == []
    assert answers["face-restorers"] == [{"name": "tiny-face", "cmd_dir": "models/GFPGAN"}]
    assert [m["name"] for m in answers["realesrgan-models"]] == ["tiny-realesrgan-x4"]
    assert answers["cmd-flags"]["device"] == "cpu" and "auth" not in answers["cmd-flags"]
    assert {"PLMS", "Euler a"} <= {s["name"] for s in answers["samplers"]}


# ------------------------------------------------------------------------------ the work behind the answers
def _pixels(b64: str) -> bytes:
    return _image(b64).convert("RGB").tobytes()


def _on(checkpoint: str, **fields) -> dict:
    """A request run on `checkpoint` (A1111's `override_settings`), seed fixed, 2 steps."""
    return {**TXT2IMG, "seed": 5, "steps": 2, "override_settings": {"sd_model_checkpoint": checkpoint},
            "override_settings_restore_afterwards": False, **fields}


def test_euler_a_on_a_flow_model_is_the_seeded_stochastic_flow_euler(base):
    """"Euler a" on FLUX.1 is flow Euler re-noising at every step (`stochastic_sampling`), drawn from the request's
    seed: the same seed gives the same picture again, and it is not plain Euler's."""
    model = CHECKPOINTS["flux-dev"]
    first, again = (_post(f"{base}/txt2img", _on(model, sampler_name="Euler a")) for _ in range(2))
    plain = _post(f"{base}/txt2img", _on(model, sampler_name="Euler"))
    assert json.loads(first["info"])["sampler_name"] == "Euler a"
    assert _pixels(first["images"][0]) == _pixels(again["images"][0]) != _pixels(plain["images"][0])


def test_a_sampler_a_family_lacks_runs_its_nearest_and_says_so(base):
    """DDIM on FLUX.1 runs flow Euler (the same picture as asking for Euler) and the answer's comments say so; so
    does a hires pass's sampler."""
    model = CHECKPOINTS["flux-dev"]
    ddim = _post(f"{base}/txt2img", _on(model, sampler_name="DDIM"))
    euler = _post(f"{base}/txt2img", _on(model, sampler_name="Euler"))
    info = json.loads(ddim["info"])
    assert info["sampler_name"] == "Euler" and "sampler DDIM: FLUX.1-dev has no such sampler; ran Euler" in \
        info["comments"]
    assert _pixels(ddim["images"][0]) == _pixels(euler["images"][0])
    hires = _post(f"{base}/txt2img", _on(model, enable_hr=True, hr_sampler_name="UniPC", denoising_strength=0.5))
    assert "hires pass: sampler UniPC: FLUX.1-dev has no such sampler; ran Euler" in json.loads(hires["info"])[
        "comments"]


def test_plms_is_pndm_and_differs_from_ddim(base):
    """PLMS on SD1.5 runs diffusers' PNDM (no Runge-Kutta warm-up), its own sampler: not DDIM's picture."""
    model = CHECKPOINTS["sd15"]
    plms = _post(f"{base}/txt2img", _on(model, sampler_name="PLMS"))
    ddim = _post(f"{base}/txt2img", _on(model, sampler_name="DDIM"))
    assert json.loads(plms["info"])["sampler_name"] == "PLMS" and "Sampler: PLMS" in json.loads(plms["info"])[
        "infotexts"][0]
    assert _pixels(plms["images"][0]) != _pixels(ddim["images"][0])


@pytest.mark.parametrize("family_name", ["sd15", "flux-dev"])
def test_tiling_wraps_for_the_job_only(base, family_name):
    """Tiling changes the picture (the convolutions pad circularly) and is put back: the next request without it
    gives the very same pixels as before it."""
    model = CHECKPOINTS[family_name]
    before = _post(f"{base}/txt2img", _on(model))["images"][0]
    tiled = _post(f"{base}/txt2img", _on(model, tiling=True))["images"][0]
    after = _post(f"{base}/txt2img", _on(model))["images"][0]
    assert _pixels(before) == _pixels(after) != _pixels(tiled)


def test_hires_at_denoising_strength_zero_is_the_upscale_alone(base):
    """Hires fix at strength 0 with Lanczos: the first pass resized by Lanczos, bit for bit (no second pass)."""
    model = CHECKPOINTS["sd15"]
    first = _image(_post(f"{base}/txt2img", _on(model))["images"][0]).convert("RGB")
    hires = _post(f"{base}/txt2img", _on(model, enable_hr=True, hr_upscaler="Lanczos", denoising_strength=0))
    assert _pixels(hires["images"][0]) == first.resize((128, 128), Image.Resampling.LANCZOS).tobytes()


def test_the_page_says_offload_changes_nothing_without_a_gpu(base):
    """The Offload choice on a machine without a GPU carries the note that no mode changes anything."""
    config = requests.get(base.removesuffix("/sdapi/v1") + "/config", timeout=60).json()
    infos = [c["props"].get("info") for c in config["components"] if c["props"].get("label") == "Offload"]
    assert infos == ["no GPU here: no mode changes anything (offload saves GPU memory)"]


def test_sd_upscale_puts_every_tile_back_where_it_was_cut():
    """The script's tiling and blending alone: with a denoise that returns its tile unchanged, the result is the
    upscaled picture pixel for pixel (every tile back at its place, overlaps weighted to exactly 1)."""
    from app.a1111 import sd_upscale
    from app.engine.generate import GeneratedImage, GenerateParams

    picture = _picture().resize((100, 76))
    big = picture.resize((200, 152), Image.Resampling.LANCZOS)
    tiles = []

    def same(params, tile):
        tiles.append(tile.size)
        return GeneratedImage(tile, 7, f"a, Steps: 3, Size: {params.width}x{params.height}")

    args = sd_upscale.parse_args(["", 8, "Lanczos", 2.0], ["None", "Lanczos"])
    out = sd_upscale.upscale_tiled(picture, GenerateParams("a", steps=3, width=64, height=64, sampler="Euler"), args,
                                   lambda image, extras: image.resize((200, 152), Image.Resampling.LANCZOS), same)
    assert out.image.tobytes() == big.tobytes() and len(tiles) == 4 * 3 and set(tiles) == {(64, 64)}
    assert "Size: 200x152" in out.infotext and "SD upscale overlap: 8" in out.infotext


def test_sd_upscale_draws_a_random_seed_once_and_counts_results_on_from_it():
    """Seed -1: every tile of a result shares one seed drawn once (as A1111's script), and `n_iter` 2 gives two
    results, the second at seed + 1."""
    from types import SimpleNamespace

    from app.a1111 import img2img, sd_upscale
    from app.accounts import LOCAL_ACCOUNT
    from app.engine.generate import GeneratedImage, GenerateParams

    seeds = []

    def record(params, tile):
        seeds.append(params.seed)
        return GeneratedImage(tile, params.seed, f"a, Size: {params.width}x{params.height}")

    def extras(images, params, owner):
        return [SimpleNamespace(image=images[0].resize((128, 128)))]

    state = SimpleNamespace(engine=SimpleNamespace(extras=extras))
    params = GenerateParams("a", steps=3, width=64, height=64, sampler="Euler", seed=-1, n_iter=2)
    args = sd_upscale.SdUpscaleArgs(overlap=8, upscaler="Lanczos", scale=2.0)
    out = img2img._sd_upscaled(state, LOCAL_ACCOUNT, [_picture()], params, args, record)
    assert len(out) == 2 and len(seeds) == 18 and seeds[0] != -1
    assert set(seeds[:9]) == {seeds[0]} and set(seeds[9:]) == {seeds[0] + 1}
