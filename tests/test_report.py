"""The bug-report bundle: redaction, JSON completeness, the PNG card, and the offline CLI path."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from served_app import LORAS, write_kohya_lora

from app.engine.checkpoint_files import ModelLoadError
from app.engine.worker import Engine
from app.report import build_bug_report, jsonable, redact
from app.report_card import model_line, placement_colour, render_card
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
HOME = str(Path.home())


def _unzip(data: bytes) -> tuple[dict, Image.Image]:
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        assert sorted(bundle.namelist()) == ["card.png", "report.json"]
        report = json.loads(bundle.read("report.json"))
        card = Image.open(io.BytesIO(bundle.read("card.png")))
        card.load()
    return report, card


def test_redact_home_share_links_and_secrets():
    raw = {
        "path": f"{HOME}/models/Lora/x.safetensors",
        "nested": [f"loaded {HOME}/a and {HOME}"],
        "url": "public at https://abcd1234.gradio.live/?x=1 now",
        "share_url": "anything at all",
        "password": "hunter2",
        "log": "login with hunter2-long-secret failed",
        "elsewhere": "/opt/homeless/file",
    }
    out = redact(raw, secrets=["hunter2-long-secret"])
    assert out["path"] == "~/models/Lora/x.safetensors"
    assert out["nested"] == ["loaded ~/a and ~"]
    assert "gradio.live" not in out["url"] and out["url"].startswith("public at ")
    assert out["share_url"] == out["password"] == "[redacted]"
    assert "hunter2" not in json.dumps(out)
    assert out["elsewhere"] == "/opt/homeless/file"


def test_jsonable_handles_snapshots_and_non_finite_numbers(data_dir):
    engine = Engine(Settings(data_dir=data_dir, device="cpu"))
    try:
        engine.load_model("tiny-sd15.safetensors")
        out = jsonable(engine.snapshot())
    finally:
        engine.close()
    json.dumps(out, allow_nan=False)  # strict JSON: mapping proxies, dataclasses, tuples all converted
    assert out["placement"] and out["timers"]["load"]["count"] == 1
    assert jsonable({"w": float("inf")}) == {"w": "inf"}


def _row(component: str, module: str, device: str, dtype: str, mib: float, violation: bool = False) -> dict:
    return {"component": component, "module": module, "device": device, "storage": dtype, "compute": dtype,
            "mib": mib, "violation": violation}


def test_card_colours_placement_and_frames_violations():
    """A stray CPU bias beside CUDA weights (the #3614 shape) must show as a red-framed run."""
    report = {
        "created": "now",
        "snapshot": {"state": "READY", "model": "m", "device": "cuda:0", "dtype": "bf16", "requested_dtype": "bf16",
                     "offload": "none", "violations_found_total": 1, "violations_repaired_total": 1,
                     "placement": [_row("unet", "a", "cuda:0", "bf16", 50.0), _row("unet", "b", "cpu", "fp32", 50.0,
                                                                                   violation=True)],
                     "violations": [{"component": "unet", "module": "b", "tensor": "bias", "expected": "cuda:0/bf16",
                                     "actual": "cpu/fp32"}],
                     "loras": [{"name": "style", "weight": 1.0, "unet_weight": None, "te_weight": 0.0}]},
        "lora_counters": {"style": {"matched_layers": 0, "unmatched_keys": 3, "apply_errors": 1, "runtime_errors": 0,
                                    "message": "does not fit"}},
        "history": [], "errors": [], "versions": {}, "gpu": "no NVML",
    }
    card = np.asarray(render_card(report).convert("RGB"))
    colours = {tuple(int(placement_colour(d, t)[i:i + 2], 16) for i in (1, 3, 5)) for d, t in
               (("cuda:0", "bf16"), ("cpu", "fp32"))}
    pixels = {tuple(p) for p in card.reshape(-1, 3)}
    assert colours <= pixels, "both placements must appear in the strip"
    assert (209, 36, 47) in pixels, "the violation frame (and the failing LoRA) must be drawn in red"
    assert placement_colour("cuda:0", "bf16") != placement_colour("cpu", "bf16") != placement_colour("cpu", "fp32")


def test_card_names_the_family_of_old_and_new_reports():
    """The card names the loaded model's family from the snapshot's "family" key, and from "arch" in a report
    written before the key was renamed (a user attaches whatever their version wrote)."""
    for key in ("family", "arch"):
        assert "model m (sdxl, -)" in model_line({"state": "READY", "model": "m", key: "sdxl"}), key
    assert "model m (SDXL, -)" in model_line({"model": "m", "model_label": "SDXL", "family": "sdxl"})
    assert "model none (-, -)" in model_line({})


def test_bundle_from_a_live_engine_is_complete_and_redacted(data_dir):
    lora_dir = data_dir / "models" / "Lora"
    write_kohya_lora(lora_dir / "style.safetensors", LORAS["style"], seed=0)
    (data_dir / "models" / "Stable-diffusion" / "broken.safetensors").write_bytes(b"\x00" * 16)
    settings = Settings(data_dir=data_dir, device="cpu", auth=(("alice", "pa55-word-xyz"),))
    engine = Engine(settings)
    try:
        engine.load_model("tiny-sd15.safetensors")
        from app.adapters.specs import LoraSpec

        engine.set_loras([LoraSpec("style", 0.8)])
        with pytest.raises(ModelLoadError):
            engine.load_model("broken.safetensors")
        log_lines = [f"opened {HOME}/private/notes.txt", "user typed pa55-word-xyz", "link https://x.gradio.live"]
        report, card = _unzip(build_bug_report(engine, settings, log_lines, secrets=["generated-pw-123"]))
    finally:
        engine.close()
    text = json.dumps(report)
    assert "pa55-word-xyz" not in text and "gradio.live" not in text and HOME + "/" not in text
    assert report["settings"]["auth_users"] == 1 and "auth" not in report["settings"]
    assert report["errors"][0]["command"] == "load_model" and "Traceback" in report["errors"][0]["traceback"]
    assert report["failed_transitions"][0]["outcome"] == "failed, rolled back"
    assert report["lora_counters"]["style"]["matched_layers"] == 2
    assert (report["snapshot"]["lora_mode"], report["snapshot"]["native_size"]) == ("fused", 64)
    assert [h["command"] for h in report["history"]] == ["load_model", "set_loras", "load_model"]
    assert report["log"][0] == "opened ~/private/notes.txt"
    assert report["versions"]["python"] and "torch" in report["versions"]
    assert isinstance(report["gpu"], (list, str))
    assert card.format == "PNG" and card.height > 300


def test_cli_bug_report_works_without_the_ui(demo_dir, tmp_path):
    out = tmp_path / "report.zip"
    result = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--data-dir", str(demo_dir), "--bug-report",
                             str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report, card = _unzip(out.read_bytes())
    assert report["snapshot"] is None
    assert any(line.startswith("checkpoint: tiny-sd15.safetensors") for line in report["log"])
    assert card.format == "PNG"
