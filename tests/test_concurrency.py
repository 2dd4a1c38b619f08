"""20 gradio_client clients × 5 requests against one launched app: every request completes, every
generation's infotext shows the LoRA weights it actually ran with, and no placement violation appears.

Each generation names its own, unique weight for the `style` LoRA in a `<lora:…>` prompt tag while
other clients keep re-weighting `style` and `detail` through `/set_loras`; only a serialised engine
(patch and denoise in one transition) can report that exact weight for every image.
"""

from __future__ import annotations

import re
import threading

import pytest
from served_app import free_port, make_ui_data, running_app

from app.settings import Settings

gradio_client = pytest.importorskip("gradio_client")

CLIENTS, REQUESTS = 20, 5


def _client_session(url: str, index: int, results: list, errors: list) -> None:
    try:
        client = gradio_client.Client(url, verbose=False)
        for r in range(REQUESTS):
            kind = ("generate", "set_loras", "snapshot")[r % 3]
            if kind == "generate":
                weight = round(0.01 * (index * REQUESTS + r + 1), 2)  # unique per request
                _images, infotext, _details = client.predict(
                    prompt=f"a fox <lora:style:{weight}>", sampler="Euler", steps=2, cfg=5.0, seed=index,
                    width=64, height=64, api_name="/generate")
                results.append((weight, infotext))
            elif kind == "set_loras":
                client.predict([{"name": "style", "weight": -1.5}, {"name": "detail", "weight": 0.1 * index}],
                               api_name="/set_loras")
            else:
                client.predict(api_name="/snapshot")
    except Exception as exc:  # collected and asserted in the test thread
        errors.append(f"client {index}: {type(exc).__name__}: {exc}")


def test_twenty_clients_mixing_generate_set_loras_and_snapshot(tmp_path, demo_dir):
    data = make_ui_data(tmp_path / "data", demo_dir)
    settings = Settings(data_dir=data, device="cpu", port=free_port(), history_size=400)
    with running_app(settings) as (server, engine):
        results: list[tuple[float, str]] = []
        errors: list[str] = []
        threads = [threading.Thread(target=_client_session, args=(server.local_url, i, results, errors))
                   for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        assert not errors, errors[:3]
        assert len(results) == CLIENTS * 2  # requests 0 and 3 of each client generate
        for weight, infotext in results:
            applied = re.search(r'Lora weights: "([^"]*)"', infotext)
            assert applied is not None, infotext
            assert f"style: {weight:g}" in applied.group(1).split(", "), (weight, applied.group(1))
        snap = engine.snapshot()
        assert snap.violations_found_total == 0
        assert all(row.outcome == "ok" for row in snap.history)
        assert sum(row.command == "generate" for row in snap.history) == CLIENTS * 2
