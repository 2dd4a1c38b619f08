"""A restart brings back the checkpoint the user last chose (issue 45, item 10).

What it protects: every start loaded the first checkpoint in alphabetical order (a broken file's error,
then FLUX.1 at 28 steps), where A1111 loads the `sd_model_checkpoint` it kept. The test runs
`python launch.py` on a fresh folder, picks the SD1.5 demo checkpoint as the page's dropdown does (the
`load_model` endpoint), stops the app, starts it again, and reads the checkpoint an A1111 client sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import gradio_client
import httpx
from served_app import free_port

from app.ui import default_checkpoint
from app.ui.serve import wait_until_ready

ROOT = Path(__file__).resolve().parents[1]
CHOSEN = "tiny-sd15.safetensors"


def _start(data: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--data-dir", str(data), "--port", str(port),
                             "--device", "cpu"], cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}/", timeout_s=120)
    except BaseException:  # a start that never answers must not outlive the test
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _loaded_title(port: int, timeout_s: float = 120) -> str:
    """`sd_model_checkpoint` once the start-up load is done (a loaded checkpoint's title carries its hash)."""
    deadline, answer = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        answer = httpx.get(f"http://127.0.0.1:{port}/sdapi/v1/options", timeout=60)
        title = answer.json().get("sd_model_checkpoint") if answer.status_code == 200 else None
        if title and "[" in title:
            return title
        time.sleep(1)
    raise AssertionError(f"no checkpoint loaded within {timeout_s} s: {answer.status_code} {answer.text[:300]}")


def test_a_restart_loads_the_checkpoint_chosen_before_it(tmp_path):
    port = free_port()
    first = _start(tmp_path, port)
    try:
        loaded_at_first_start = _loaded_title(port)
        assert not loaded_at_first_start.startswith(CHOSEN), "choose a checkpoint other than the first one"
        gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False).predict(CHOSEN, api_name="/load_model")
        assert _loaded_title(port).startswith(CHOSEN)
    finally:
        _stop(first)
    second = _start(tmp_path, port)
    try:
        title = _loaded_title(port)
        assert title.startswith(CHOSEN), f"the restart loaded {title}, not {CHOSEN} chosen before it"
    finally:
        _stop(second)


def test_an_unreadable_memory_is_ignored_and_a_write_is_whole(tmp_path):
    """A damaged file is not a reason to refuse to start: it is logged and the start goes on in order; a write
    replaces the file whole (no half-written JSON after a crash)."""
    path = tmp_path / "default-checkpoint.json"
    assert default_checkpoint.remembered(path) is None
    for damaged in ("{not json", "[1, 2]", '{"checkpoint": 7}'):
        path.write_text(damaged)
        assert default_checkpoint.remembered(path) is None
    default_checkpoint.remember(path, CHOSEN)
    assert default_checkpoint.remembered(path) == CHOSEN and not path.with_name(path.name + ".part").exists()
