"""The API and the page's views tell the engine's truth (through `gradio_client` where there is an API).

What it protects: `/interrupt` and `/skip` reach the engine between two steps and only for the
client that started the job (unless `any_owner`); a client that cancels its job stops it in the
engine instead of leaving it GENERATING; after a model switch the snapshot lists every wanted
LoRA with its status and, when set aside, the engine's reason; the status line and Diagnostics
show that reason, and the LoRA browser's "fits this model" keeps what the engine accepts.
"""

from __future__ import annotations

import html
import time

import pytest
from served_app import MODEL, free_port, make_ui_data, running_app

from app.adapters.specs import LoraSpec
from app.engine.snapshot import LoraState, Snapshot
from app.settings import Settings
from app.ui import views
from app.ui.common import UiContext
from app.ui.lora_browser import fitting, list_entries

gradio_client = pytest.importorskip("gradio_client")
SDXL = "tiny-sdxl.safetensors"
# Half a second a step (tiny model, 256², CPU): a call lands within a step; 150 steps would be minutes.
LONG = dict(prompt="a lighthouse", sampler="Euler", steps=150, cfg=5.0, seed=3, width=256, height=256)


@pytest.fixture(scope="module")
def app(tmp_path_factory, demo_dir):
    data = make_ui_data(tmp_path_factory.mktemp("api-stop"), demo_dir)
    with running_app(Settings(data_dir=data, device="cpu", port=free_port())) as (server, engine):
        yield server.local_url, engine


@pytest.fixture
def client(app):
    return gradio_client.Client(app[0], verbose=False)


def _wait_for_step(engine, step: int, run: int = 1) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        progress = engine.snapshot().progress
        if progress is not None and f"run {run}/" in progress.phase and progress.step >= step:
            return progress.step
        time.sleep(0.02)
    raise AssertionError(f"never reached step {step} of run {run}")


def _outputs(engine) -> int:
    return len(list(engine.settings.outputs_dir.rglob("*.png")))


def test_interrupt_stops_this_clients_job_within_two_steps_and_not_another_clients(app, client):
    url, engine = app
    job = client.submit(**LONG, api_name="/generate")
    _wait_for_step(engine, 2)
    stranger = gradio_client.Client(url, verbose=False)
    assert stranger.predict(api_name="/interrupt") == {"stopped": False, "state": "GENERATING"}
    asked_at = engine.snapshot().progress.step
    assert client.predict(api_name="/interrupt")["stopped"] is True
    _images, infotext, details = job.result(timeout=60)
    (image,) = details
    assert image["complete"] is False and asked_at <= image["stopped_at"] <= asked_at + 2
    assert "Seed: 3" in infotext and image["file"].endswith(".png")
    snap = engine.snapshot()
    assert snap.state == "READY" and not snap.generating and snap.history[-1].outcome == "interrupted"
    assert client.predict(api_name="/interrupt") == {"stopped": False, "state": "READY"}  # nothing left to stop


def test_interrupt_for_any_owner_can_drop_the_partial_result(app, client):
    url, engine = app
    before = _outputs(engine)
    job = client.submit(**LONG, api_name="/generate")
    _wait_for_step(engine, 1)
    other = gradio_client.Client(url, verbose=False)
    assert other.predict(False, True, api_name="/interrupt")["stopped"] is True  # keep_partial=False, any_owner
    images, infotext, details = job.result(timeout=60)
    assert (images, infotext, details) == ([], "", []) and _outputs(engine) == before


def test_skip_ends_one_run_of_a_batch_count(app, client):
    _url, engine = app
    job = client.submit(**dict(LONG, steps=40, width=64, height=64), n_iter=2, api_name="/generate")
    _wait_for_step(engine, 2, run=1)
    assert client.predict(api_name="/skip")["stopped"] is True
    _images, _infotext, details = job.result(timeout=120)
    assert [(d["seed"], d["complete"]) for d in details] == [(3, False), (4, True)]
    assert details[1]["stopped_at"] is None


def test_a_cancelled_request_stops_its_job_in_the_engine(app, client):
    """gradio_client's `job.cancel()` closes the running /generate; the engine drops the job at once
    instead of generating 150 steps for nobody."""
    _url, engine = app
    before = _outputs(engine)
    job = client.submit(**LONG, api_name="/generate")
    _wait_for_step(engine, 1)
    job.cancel()
    deadline = time.monotonic() + 20
    while engine.snapshot().generating:
        assert time.monotonic() < deadline, "the cancelled job is still generating"
        time.sleep(0.05)
    last = engine.snapshot().history[-1]
    assert (last.command, last.outcome) == ("generate", "interrupted") and last.duration_s < 30
    assert _outputs(engine) == before


def test_the_snapshot_shows_set_aside_loras_with_the_engines_reason(client):
    """SD1.5 → SDXL → SD1.5 with an SD1.5 LoRA wanted: the load sets it aside with the reason (and
    Generate works), loading SD1.5 again applies it again. With `set_aside_unfit` a list with a
    misfit applies the rest; without it the whole list is refused and nothing changes."""
    client.predict([{"name": "style", "weight": 0.8}], api_name="/set_loras")
    summary = client.predict(SDXL, api_name="/load_model")
    assert summary["loras"] == []
    (state,) = summary["lora_states"]
    assert (state["name"], state["status"]) == ("style", "set aside")
    assert state["reason"].startswith("LoRA 'style': ") and "SDXL" in state["reason"]
    assert client.predict(api_name="/snapshot")["lora_states"][0]["reason"] == state["reason"]
    _images, infotext, _details = client.predict(**dict(LONG, steps=2, width=64, height=64), api_name="/generate")
    assert "style" not in infotext
    summary = client.predict(MODEL, api_name="/load_model")
    assert [(s["name"], s["status"], s["reason"]) for s in summary["lora_states"]] == [("style", "applied", "")]
    wrong = [{"name": "style", "weight": 0.8}, {"name": "wrong", "weight": 1.0}]
    with pytest.raises(gradio_client.exceptions.AppError, match="'wrong': does not fit this SD15 model"):
        client.predict(wrong, api_name="/set_loras")
    assert [s["name"] for s in client.predict(api_name="/snapshot")["lora_states"]] == ["style"]
    summary = client.predict(wrong, True, api_name="/set_loras")
    assert [(s["name"], s["status"]) for s in summary["lora_states"]] == [("style", "applied"), ("wrong", "set aside")]
    assert [s["name"] for s in summary["loras"]] == ["style"]
    client.predict([], api_name="/set_loras")


def test_status_line_and_lora_table_show_what_the_engine_set_aside():
    """The reason is the engine's, escaped, shortened in the status line (whole in its tooltip) and whole
    in the Diagnostics table, beside the status of every wanted LoRA."""
    reason = "LoRA 'x<1>': does not fit this SDXL model (it looks made for SD15): " + "no layer matches; " * 8
    snap = Snapshot(state="READY", loras=(LoraSpec("a", 0.5, te_weight=1.0),),
                    lora_states=(LoraState("a", 0.5, 1.0, "applied"), LoraState("x<1>", 1.0, 1.0, "set aside", reason)))
    line = views.status_html(snap)
    assert "LoRAs a 0.5/1" in line and "⊘ x&lt;1&gt; set aside: LoRA &#x27;x&lt;1&gt;&#x27;: does not fit" in line
    assert f"title='{html.escape(reason, quote=True)}'" in line and reason not in line and "…</span>" in line
    assert views.lora_rows(snap) == [["a", "applied", "0.5 / 1", "", "", "", "", ""],
                                     ["x<1>", "set aside", "1 / 1", "", "", "", "", reason]]


def test_lora_browser_fit_filter_keeps_what_the_engine_accepts(app):
    _url, engine = app
    ctx = UiContext(engine, engine.settings)
    kept, note = fitting(ctx, list_entries(ctx))
    assert [e.name for e in kept] == ["detail", "partial", "style"]
    assert note == f"3 LoRA(s) fit {MODEL}"
