"""Start-up as a user meets it: `--data-dir`, the port check, `--help`, a bad first checkpoint, and
the console filters for known third-party noise."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from app.console import quiet_third_party
from app.engine.worker import Engine
from app.settings import Settings
from app.ui import views
from app.ui.serve import load_first_working

ROOT = Path(__file__).resolve().parents[1]
BROKEN = "aaa-broken.safetensors"  # sorts before the demo checkpoints, as a user's first file would


def _launch(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_missing_data_dir_is_refused_unless_asked_to_create_it(tmp_path):
    """A typo in --data-dir must not become a new install; --create-data-dir makes the folder, and a
    busy port is then refused before any demo model is written or loaded."""
    missing = tmp_path / "tpyo"
    refused = _launch("--data-dir", str(missing))
    assert refused.returncode == 2 and not missing.exists()
    assert f"--data-dir {missing} does not exist" in refused.stderr and "--create-data-dir" in refused.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        blocked = _launch("--data-dir", str(missing), "--create-data-dir", "--port", str(port), "--device", "cpu")
    assert missing.is_dir() and not (missing / "models").exists(), "demo models written before the port check"
    assert blocked.returncode == 1 and f"port {port} on 127.0.0.1 is not free" in blocked.stdout
    assert time.monotonic() - started < 120


def test_flags_are_read_and_refused_without_importing_torch():
    """`--help` and a mistyped flag answer in a fraction of a second: reading the command line
    imports neither torch nor diffusers nor Gradio (those cost 12-14 CPU s on two cores)."""
    probe = ("import sys, launch\n"
             "launch.settings_from_args(launch.build_parser().parse_args(['--offload', 'balanced']))\n"
             "print(sorted(m for m in ('torch', 'diffusers', 'gradio') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stderr
    mistyped = _launch("--offload", "balance")
    assert mistyped.returncode == 2 and "invalid choice: 'balance'" in mistyped.stderr


def test_help_states_each_default_once_and_only_meaningful_ones():
    text = _launch("--help").stdout
    options = re.split(r"\n  (?=-)", text)  # one block per option, wrapped lines included
    for option in options:
        assert option.count("(default") <= 1, option
    flat = " ".join(text.split())
    for empty in ("(default: None)", "(default: False)", "(default: [])"):
        assert empty not in flat
    assert "--port PORT HTTP port (default: 7860)" in flat and "(default: the first found)" in flat


def _with_broken_checkpoint(data_dir: Path) -> Settings:
    (data_dir / "models" / "Stable-diffusion" / BROKEN).write_bytes(b"PK\x03\x04 a zip, not safetensors")
    return Settings(data_dir=data_dir, device="cpu")


def test_a_bad_first_checkpoint_is_skipped_and_the_reason_kept_for_the_page(data_dir):
    engine = Engine(_with_broken_checkpoint(data_dir))
    try:
        notes: list[str] = []
        assert load_first_working(engine, [BROKEN, "tiny-sd15.safetensors"], notes) == "tiny-sd15.safetensors"
        snap = engine.snapshot()
        assert (snap.state, snap.model) == ("READY", "tiny-sd15.safetensors")
        assert len(notes) == 1 and "so **tiny-sd15.safetensors** was loaded instead" in notes[0]
        assert f"{BROKEN}: not a valid safetensors file (it is a pickled PyTorch checkpoint" in notes[0]
    finally:
        engine.close()


def test_when_no_checkpoint_loads_the_status_line_says_why(data_dir):
    """EMPTY after a failed load is not the green "all is well" pill, and the reason is on the line."""
    engine = Engine(_with_broken_checkpoint(data_dir))
    try:
        notes: list[str] = []
        assert load_first_working(engine, [BROKEN], notes) is None
        line = views.status_html(engine.snapshot())
        assert "sd-empty'>EMPTY" in line and "sd-idle" not in line
        assert f"load_model: ModelLoadError: {BROKEN}: not a valid safetensors file" in line
        assert notes and notes[0].startswith("⚠ No checkpoint could be loaded at start")
    finally:
        engine.close()


def test_known_library_noise_is_dropped_and_other_warnings_kept(engine):
    """diffusers warns "should be kept in float32: []" on every `.to(dtype)` of a model (hundreds of
    times per GPU run); after the start-up filters that exact message is gone, others still show."""
    engine.load_model("tiny-sd15.safetensors")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("diffusers.models.modeling_utils")
    logger.addHandler(handler)
    try:
        engine.pipeline.vae.to(torch.float32)  # a no-op cast that makes diffusers warn
        assert any("should be kept in float32: []" in m for m in seen), "diffusers no longer warns: drop the filter"
        seen.clear()
        quiet_third_party()
        engine.pipeline.vae.to(torch.float32)
        logger.warning("a warning nobody filtered")
        assert seen == ["a warning nobody filtered"]
    finally:
        logger.removeHandler(handler)
