"""The workflows through the named API (`gradio_client`): `/img2img`, `/inpaint`, `/txt2img_hires`.

What it protects: the endpoint names scripts depend on (never renamed `_1` by a UI handler), a
result carrying the workflow's settings in its infotext, and refused values coming back as one
message naming every refused field (both rule sets: the request's and the workflow's)."""

from __future__ import annotations

import re
import time

import pytest
from PIL import Image
from served_app import free_port, make_ui_data, running_app

from app.settings import Settings

gradio_client = pytest.importorskip("gradio_client")
BASE = dict(prompt="a fox", sampler="Euler", steps=3, cfg=5.0, seed=11, width=64, height=64)


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("workflows-api"), demo_dir)
    with running_app(Settings(data_dir=data, device="cpu", port=free_port())) as (server, engine):
        yield server, engine


@pytest.fixture(scope="module")
def client(served):
    return gradio_client.Client(served[0].local_url, verbose=False)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("api-pictures")
    Image.new("RGB", (64, 64), (200, 60, 30)).save(folder / "init.png")
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    mask.save(folder / "mask.png")
    return {"init": str(folder / "init.png"), "mask": str(folder / "mask.png")}


def test_workflow_endpoints_keep_their_names(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/img2img", "/inpaint", "/txt2img_hires", "/generate"} <= names
    assert not [n for n in names if re.search(r"_\d+$", n)]


def test_each_endpoint_runs_its_workflow(client, pictures):
    """Each endpoint returns an image whose infotext carries the workflow's settings."""
    image = gradio_client.handle_file(pictures["init"])
    _, text, details = client.predict(**BASE, init_image=image, denoising_strength=0.5, resize_mode="resize and fill",
                                      api_name="/img2img")
    assert "Denoising strength: 0.5" in text and "Resize mode: resize and fill" in text and details[0]["seed"] == 11
    _, text, _ = client.predict(**BASE, init_image=image, denoising_strength=1.0, resize_mode="just resize",
                                mask=gradio_client.handle_file(pictures["mask"]), mask_blur=2,
                                inpainting_fill="latent nothing", inpainting_mask_invert=True, api_name="/inpaint")
    assert "Masked content: latent nothing" in text and "Mask mode: Inpaint not masked" in text
    _, text, _ = client.predict(**BASE, hires_scale=1.5, hires_upscaler="Nearest", hires_steps=2,
                                denoising_strength=0.5, hires_sampler="DDIM", hires_prompt="",
                                hires_negative_prompt="", api_name="/txt2img_hires")
    assert "Hires upscale: 1.5, Hires steps: 2, Hires upscaler: Nearest, Hires sampler: DDIM" in text


def test_refused_values_come_back_in_one_message(client, pictures):
    """Every refused field of both rule sets is named in one error; a missing mask is refused."""
    image = gradio_client.handle_file(pictures["init"])
    with pytest.raises(gradio_client.exceptions.AppError) as refused:
        client.predict(**{**BASE, "steps": 0}, init_image=image, denoising_strength=1.5, resize_mode="just resize",
                       api_name="/img2img")
    assert "steps must be a whole number in 1…150" in str(refused.value)
    assert "denoising_strength must be a number in 0…1" in str(refused.value)
    with pytest.raises(gradio_client.exceptions.AppError, match="a mask is required"):
        client.predict(**BASE, init_image=image, denoising_strength=0.5, resize_mode="just resize", mask=None,
                       mask_blur=4, inpainting_fill="original", inpainting_mask_invert=False, api_name="/inpaint")
    with pytest.raises(gradio_client.exceptions.AppError, match="hires_scale must be a number in 1…4"):
        client.predict(**BASE, hires_scale=9, hires_upscaler="Latent", hires_steps=0, denoising_strength=0.5,
                       hires_sampler="Use same sampler", hires_prompt="", hires_negative_prompt="",
                       api_name="/txt2img_hires")


def test_a_clients_interrupt_stops_its_inpaint(served, client, pictures):
    """A script's `/inpaint` is its own job: its `/interrupt` stops it (issue 32: no stop reached an
    inpaint; the run is listed as interrupted) and the answer still carries the image reached;
    another client's `/interrupt` does not touch it."""
    engine = served[1]
    job = client.submit(**{**BASE, "steps": 150}, init_image=gradio_client.handle_file(pictures["init"]),
                        denoising_strength=1.0, resize_mode="just resize",
                        mask=gradio_client.handle_file(pictures["mask"]), mask_blur=0, inpainting_fill="original",
                        inpainting_mask_invert=False, api_name="/inpaint")
    deadline = time.monotonic() + 60
    while (engine.snapshot().progress is None or engine.snapshot().progress.step < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    stranger = gradio_client.Client(served[0].local_url, verbose=False)
    assert stranger.predict(api_name="/interrupt")["stopped"] is False
    assert client.predict(api_name="/interrupt")["stopped"] is True
    _images, text, _details = job.result(timeout=120)
    assert "Steps: 150" in text
    assert [h.outcome for h in engine.snapshot().history if h.command == "inpaint"][-1] == "interrupted"

