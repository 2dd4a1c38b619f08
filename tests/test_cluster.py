"""The A1111 API on Ray Serve (`app/cluster.py`): two CPU engine replicas on a local Ray instance.

What users see: the cluster answers `/sdapi/v1/txt2img` with the same images as the app itself,
two requests run at once on the two replicas, and when a replica dies in the middle of a request
Serve replaces it and the request is answered (sent again to a live replica, or a 503 that says
so) within a bounded time. Skipped where `ray[serve]` is not installed (`pip install -e ".[cluster]"`).
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image
from served_app import free_port, running_app
from test_team_engines import SD15, private_data

from app.settings import Settings

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
cluster_app = pytest.importorskip("app.cluster")

REPO = Path(__file__).resolve().parents[1]
BODY = {"prompt": "a fox <lora:demo-style-sd15:0.8>", "seed": 3, "steps": 2, "width": 64, "height": 64,
        "cfg_scale": 5.0, "sampler_name": "Euler"}
BOUND_S = 180  # a request whose replica is killed is answered within this


@pytest.fixture(scope="module")
def data(tmp_path_factory, demo_dir) -> Path:
    return private_data(demo_dir, tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def cluster(data):
    """A local Ray instance with two CPU replicas of one torch thread each; yields the API's base URL."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(cluster_app.build(Settings(data_dir=data), 2, gpus=0, cpus=1, initial_model=SD15), name="steady",
              route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _replicas() -> dict[str, object]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::steady#EngineReplica")]
    return {name: ray.get_actor(name, namespace="serve") for name in names}


def _busy(replicas: dict[str, object]) -> list[str]:
    """Replicas serving a request now (Serve's own count on the replica actor)."""
    out = []
    for name, actor in replicas.items():
        try:
            if ray.get(actor.get_num_ongoing_requests.remote(), timeout=10):
                out.append(name)
        except Exception:  # noqa: BLE001 - a replica being replaced is not busy
            pass
    return out


def _pixels(answer: dict) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))) as image:
        return np.asarray(image.convert("RGB"))


def _post(url: str, body: dict, out: dict, key: str) -> None:
    out[key] = requests.post(f"{url}/sdapi/v1/txt2img", json=body, timeout=BOUND_S)


def test_replicas_answer_with_the_apps_images_two_at_once(cluster, data, tmp_path):
    """The same request gives the same PNG pixels and infotext from the cluster as from the app; two long
    requests with different LoRA sets run at the same time, one on each replica."""
    settings = Settings(data_dir=data, device="cpu", port=free_port())
    with running_app(settings) as (server, _engine):
        reference = requests.post(f"{server.local_url.rstrip('/')}/sdapi/v1/txt2img", json=BODY, timeout=120).json()
    answer = requests.post(f"{cluster}/sdapi/v1/txt2img", json=BODY, timeout=BOUND_S)
    assert answer.status_code == 200, answer.text
    assert np.array_equal(_pixels(answer.json()), _pixels(reference))
    assert json.loads(answer.json()["info"])["infotexts"] == json.loads(reference["info"])["infotexts"]
    replicas, out = _replicas(), {}
    assert len(replicas) == 2
    long = [dict(BODY, steps=150, width=128, height=128, prompt=f"a fox <lora:demo-{kind}-sd15:1>")
            for kind in ("style", "detail")]
    threads = [threading.Thread(target=_post, args=(cluster, body, out, i)) for i, body in enumerate(long)]
    for thread in threads:
        thread.start()
    deadline, both = time.monotonic() + 60, False
    while time.monotonic() < deadline and not both:
        both = len(_busy(replicas)) == 2
        time.sleep(0.2)
    for thread in threads:
        thread.join(BOUND_S)
    assert both and all(out[i].status_code == 200 for i in range(2))


def test_a_replica_killed_mid_request_is_replaced_and_the_request_answered(cluster):
    """Kill the replica running a long request: within BOUND_S the client gets the image (sent again to a
    live replica) or a 503 that says the replica stopped, and Serve brings the replica count back to two."""
    replicas, out = _replicas(), {}
    thread = threading.Thread(target=_post, args=(cluster, dict(BODY, steps=150, seed=9), out, "answer"))
    started = time.monotonic()
    thread.start()
    deadline, busy = time.monotonic() + 60, []
    while time.monotonic() < deadline and not busy:
        busy = _busy(replicas)
        time.sleep(0.1)
    assert busy, "no replica picked the request up"
    ray.kill(replicas[busy[0]], no_restart=True)
    thread.join(BOUND_S)
    answer = out.get("answer")
    assert answer is not None and time.monotonic() - started < BOUND_S
    assert answer.status_code == 200 or (answer.status_code == 503 and "replica" in answer.json()["detail"]), \
        answer.text
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline and (busy[0] in _replicas() or len(_replicas()) != 2):
        time.sleep(0.5)
    assert busy[0] not in _replicas() and len(_replicas()) == 2
    assert requests.post(f"{cluster}/sdapi/v1/txt2img", json=BODY, timeout=BOUND_S).status_code == 200
    print(f"killed {busy[0]}: answered {answer.status_code} after {time.monotonic() - started:.1f} s")
