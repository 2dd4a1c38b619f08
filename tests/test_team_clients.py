"""A shared server: two `gradio_client` sessions and one `webuiapi` client interleave 30 generations
on one engine, with three different LoRA sets and two models, and each gets exactly its own image.

What users see: each client's image is bit-identical to the one the same settings give when that
client runs alone, whatever the others did to the engine in between; nobody's LoRA reaches another
client's image (its infotext names only its own); the engine says what it holds and for whom.
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from PIL import Image
from served_app import free_port, running_app
from test_team_engines import SD15, SDXL, private_data

from app.settings import Settings

gradio_client = pytest.importorskip("gradio_client")
webuiapi = pytest.importorskip("webuiapi")

RUNS, SEEDS = 10, (1, 2)  # generations per client (30 in all), alternating these seeds
SMALL = dict(steps=2, width=64, height=64)
# client -> (checkpoint, LoRAs it sets or tags, the LoRA names its infotext must carry)
CLIENTS = {
    "ann": (SD15, [{"name": "demo-style-sd15", "weight": 0.8}], {"demo-style-sd15"}),
    "bob": (SDXL, [{"name": "demo-style-sdxl", "weight": 1.0}, {"name": "demo-detail-sdxl", "weight": 0.5,
                                                                  "te_weight": 1.5}],
            {"demo-style-sdxl", "demo-detail-sdxl"}),
    "web": (SD15, "<lora:demo-detail-sd15:1.2>", {"demo-detail-sd15"}),
}


class GradioUser:
    """A `gradio_client` session that chose its checkpoint and LoRAs once, through the named API."""

    def __init__(self, url: str, model: str, loras: list[dict]) -> None:
        self.client = gradio_client.Client(url, verbose=False)
        self.client.predict(model, api_name="/load_model")
        self.client.predict(loras, api_name="/set_loras")

    def generate(self, seed: int) -> tuple[np.ndarray, str]:
        images, infotext, _details = self.client.predict(prompt="a fox", sampler="Euler", cfg=5.0, seed=seed,
                                                         api_name="/generate", **SMALL)
        with Image.open(images[0]["image"]) as image:
            return np.asarray(image.convert("RGB")), infotext


class WebUser:
    """A `webuiapi` script: its checkpoint chosen once through `/options`, its LoRA by a prompt tag."""

    def __init__(self, url: str, model: str, tag: str) -> None:
        self.api = webuiapi.WebUIApi(baseurl=f"{url}/sdapi/v1", sampler="Euler")
        self.api.set_options({"sd_model_checkpoint": model})
        self.tag = tag

    def generate(self, seed: int) -> tuple[np.ndarray, str]:
        result = self.api.txt2img(prompt=f"a fox {self.tag}", seed=seed, cfg_scale=5.0, **SMALL)
        return np.asarray(result.image.convert("RGB")), result.image.info["parameters"]


def _loras_named(infotext: str) -> set[str]:
    hashes = re.search(r'Lora hashes: "([^"]*)"', infotext)
    return {item.split(":")[0].strip() for item in hashes.group(1).split(",")} if hashes else set()


def _work(user, name: str, out: list, errors: list) -> None:
    try:
        for run in range(RUNS):
            seed = SEEDS[run % len(SEEDS)]
            out.append((name, seed, *user.generate(seed)))
    except Exception as exc:  # collected and asserted in the test thread
        errors.append(f"{name}: {type(exc).__name__}: {exc}")


def test_three_clients_interleave_and_each_gets_its_own_image(tmp_path, demo_dir):
    settings = Settings(data_dir=private_data(demo_dir, tmp_path / "data"), device="cpu", port=free_port(),
                        history_size=400)
    with running_app(settings) as (server, engine):
        url = server.local_url.rstrip("/")
        users = {name: (GradioUser(url, model, loras) if isinstance(loras, list) else WebUser(url, model, loras))
                 for name, (model, loras, _names) in CLIENTS.items()}
        made: list[tuple] = []
        errors: list[str] = []
        threads = [threading.Thread(target=_work, args=(user, name, made, errors)) for name, user in users.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        assert not errors, errors[:3]
        assert len(made) == RUNS * len(CLIENTS)
        held = engine.snapshot()
        alone = {(name, seed): users[name].generate(seed) for name in CLIENTS for seed in SEEDS}  # one at a time
    for name, seed, pixels, infotext in made:
        reference, reference_text = alone[(name, seed)]
        assert np.array_equal(pixels, reference), (name, seed)
        assert _loras_named(infotext) == CLIENTS[name][2] == _loras_named(reference_text), (name, infotext)
        assert f"Model: {CLIENTS[name][0]}" in infotext
    images = {key: value[0] for key, value in alone.items()}
    assert not np.array_equal(images[("ann", 1)], images[("web", 1)])  # the LoRA sets change the pictures
    reconciles = [h for h in held.history if h.command == "reconcile"]
    assert reconciles and all(h.outcome == "ok" for h in held.history)
    assert held.violations_found_total == 0 and held.held_for is not None
    print(f"{len(made)} interleaved generations, {len(reconciles)} reconciles "
          f"({sum('LOADING' == h.state for h in reconciles)} with a model switch)")


def test_a_pages_state_is_its_panel_and_a_scripts_is_what_it_chose(tmp_path, demo_dir):
    """A page's generation carries its panel (no checkpoint picked yet: the app's default); a script's carries
    what its own set_* calls chose; what a session never chose is the app's default (no LoRA, the default
    checkpoint), never what another session left in the engine (issue 43, finding 6), while dtype, offload
    and weight storage are the engine's (engine-wide); a closed or long-unheard-of session starts from the
    defaults again; a checkpoint outside the folder is refused before anything is queued."""
    from types import SimpleNamespace

    from app.adapters.specs import LoraSpec
    from app.engine.desired import Desired
    from app.engine.snapshot import Snapshot
    from app.ui.common import UiContext
    from app.ui.generate_run import panel_desired
    from app.ui.sessions import SessionStates

    held = Desired(model=SDXL, dtype="bf16", offload="model", loras=(LoraSpec("someone-elses", 1.0),))
    defaults = held.replace(model=SD15, loras=())
    settings = Settings(data_dir=private_data(demo_dir, tmp_path / "data"), device="cpu")
    ctx = UiContext(SimpleNamespace(snapshot=lambda: Snapshot(state="READY", desired=held)), settings,
                    sessions=SessionStates(limit=2))
    ctx.sessions.set_default_model(SD15)
    mine = (LoraSpec("demo-style-sdxl", 0.5),)
    assert panel_desired(ctx, None, mine) == defaults.replace(loras=mine)
    assert panel_desired(ctx, SDXL, ()) == held.replace(loras=())
    for bad, message in (("../tiny-sd15.safetensors", "checkpoint"), ("nope.safetensors", "not in")):
        with pytest.raises(ValueError, match=message):
            panel_desired(ctx, bad, ())
    assert ctx.desired_for("never-chose") == defaults
    ctx.sessions.record("s1", model=SDXL, loras=mine)
    assert ctx.desired_for("s1") == held.replace(loras=mine)
    ctx.sessions.record("s2", loras=())
    ctx.sessions.record("s3", model=SDXL)  # past the limit: s1, unheard of longest, is forgotten
    assert ctx.desired_for("s1") == defaults and ctx.desired_for("s3") == held.replace(loras=())
    ctx.sessions.forget("s3")
    assert ctx.desired_for("s3") == defaults
    with pytest.raises(ValueError, match="not a field"):
        ctx.sessions.record("s4", dtype="fp16")  # engine-wide: an admin's `set_dtype`, never a session's
