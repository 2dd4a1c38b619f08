"""Bug-report bundle: one zip with a JSON dump and a PNG card, safe to attach to a public issue.

Why both: the JSON is complete (versions, settings, snapshot, history, per-LoRA counters,
errors with tracebacks, recent log lines) for whoever debugs; the PNG card is what a reporter
pastes into an issue tracker, so a maintainer sees at a glance where every component lives,
which tensors violate the plan and which LoRAs misbehave, without opening anything.

Everything goes through `redact()` before it is written (its folders as every answer of the app
shows them, `app/shown_paths.py`): paths inside the data folder become
relative to it (the folder itself `.`), the app's and Python's install folders become `<app>`,
`<site-packages>` and `<python>` (tracebacks name every file they pass through), the home
folder becomes `~`, share links and known
secrets (passwords from `--auth` or the generated one) are removed wherever they appear, and
keys that name secrets are blanked. The card is drawn from the redacted
dict, so it cannot show more than the JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import io
import json
import logging
import math
import platform
import re
import sys
import time
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from app import diagnostics
from app.report_card import render_card
from app.settings import Settings
from app.shown_paths import folder_redactor

log = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_PNG = "card.png"
REDACTED = "[redacted]"
_SHARE_URL = re.compile(r"https?://[^\s\"'<>]*(?:gradio\.live|gradio\.app|/share)[^\s\"'<>]*", re.IGNORECASE)
_SECRET_KEY = re.compile(r"pass(word|wd)?$|secret|token|share_url|credential", re.IGNORECASE)
_LIBRARIES = ("torch", "diffusers", "transformers", "safetensors", "gradio", "gradio_client", "accelerate",
              "peft", "numpy", "Pillow", "nvidia-ml-py", "psutil")


# --------------------------------------------------------------------------- JSON-able and redacted
def jsonable(value: Any) -> Any:
    """Plain JSON types from dataclasses, mappings (also `MappingProxyType`), paths, enums, dtypes.

    Non-finite floats become strings because strict JSON has no NaN/Infinity.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # Path, torch.dtype, torch.device, anything else: its readable form


def redact(value: Any, secrets: Iterable[str] = (), home: str | None = None, data_dir: str | None = None) -> Any:
    """Return a copy of a JSON-able value that is safe to publish.

    Paths under `data_dir` become relative to it (`models/Lora/x.safetensors`; the folder itself
    `.`), other home-folder paths start with `~`, share URLs are removed, every occurrence of a
    known secret is replaced, and the values of keys that name a secret (`password`, `token`,
    `share_url` …) are blanked whatever they hold.
    """
    secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
    folders = folder_redactor(home, data_dir)

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: (REDACTED if _SECRET_KEY.search(str(k)) and v[k] else clean(v[k])) for k in v}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if not isinstance(v, str):
            return v
        for secret in secrets:
            v = v.replace(secret, REDACTED)
        return folders(_SHARE_URL.sub("[share link removed]", v))

    return clean(jsonable(value))


# --------------------------------------------------------------------------------- collecting
def app_version() -> str:
    """Installed package version, or the one in pyproject.toml when run from a checkout."""
    try:
        return importlib.metadata.version("steady-diffusion")
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        return "unknown"
    match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
    return match.group(1) if match else "unknown"


def versions() -> dict[str, Any]:
    """App, Python, platform, library versions and the torch/CUDA build."""
    libs = {}
    for name in _LIBRARIES:
        try:
            libs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            libs[name] = None
    out: dict[str, Any] = {"app": app_version(), "python": sys.version.split()[0], "platform": platform.platform(),
                           "libraries": libs}
    try:
        import torch

        cuda = torch.cuda.is_available()
        out["torch"] = {"version": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": cuda,
                        "cudnn": torch.backends.cudnn.version() if cuda else None,
                        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                        if cuda else []}
    except Exception as exc:  # a broken torch install is exactly what a bug report must still describe
        out["torch"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def collect_report(engine, settings: Settings, log_lines: Iterable[str] = (), secrets: Iterable[str] = (),
                   shown_errors: Iterable[dict] = ()) -> dict:
    """Everything a maintainer needs, redacted. `engine` may be None (the UI could not start).
    `shown_errors`: what the pages showed as errors (`app.diagnostics.ShownErrors`), listed after the
    engine's last failed transition (a failed generation is both: its toast and the transition)."""
    snapshot = engine.snapshot() if engine is not None else None
    errors: list = []
    if snapshot is not None and snapshot.last_error is not None:
        errors.append(snapshot.last_error)
    errors += list(shown_errors)
    report = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "versions": versions(),
        "gpu": diagnostics.gpu_stats(),
        "process_memory": diagnostics.process_memory(),
        "settings": settings.public_dict(),
        "snapshot": snapshot,
        "weight_storage": diagnostics.storage_summary(
            snapshot.weights, snapshot.stored_layers, snapshot.bytes_saved, snapshot.dtype,
            matmul_layers=snapshot.matmul_layers, matmul_unfit=snapshot.matmul_unfit, stored_as=snapshot.stored_as,
            resting_bytes=snapshot.resting_bytes) if snapshot is not None else "",
        "history": snapshot.history if snapshot is not None else [],
        "lora_counters": snapshot.lora_counters if snapshot is not None else {},
        "errors": errors,
        "failed_transitions": [h for h in snapshot.history if h.failed] if snapshot is not None else [],
        "memory_timeline": engine.timeline.snapshot() if engine is not None else [],
        "other_engines": engine.snapshots()[1:] if engine is not None else (),  # --devices: one snapshot each
        "log": list(log_lines),
    }
    all_secrets = [pw for _user, pw in (*settings.auth, *settings.api_auth)] + list(secrets)
    return redact(report, all_secrets, data_dir=str(settings.data_dir))


def build_bug_report(engine, settings: Settings, log_lines: Iterable[str] = (),
                     secrets: Iterable[str] = (), shown_errors: Iterable[dict] = ()) -> bytes:
    """The zip bundle as bytes: `report.json` and `card.png`."""
    report = collect_report(engine, settings, log_lines, secrets, shown_errors)
    png = io.BytesIO()
    render_card(report).save(png, format="PNG")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr(REPORT_JSON, json.dumps(report, indent=2, allow_nan=False))
        bundle.writestr(REPORT_PNG, png.getvalue())
    return buffer.getvalue()


def write_bug_report_offline(settings: Settings, path: Path) -> Path:
    """Write the bundle without an engine or UI (for `launch.py --bug-report` when the app cannot start).

    Lists the checkpoints and LoRAs that would be found, so a "my model is not listed" report
    carries the evidence.
    """
    path = Path(path)
    lines = [f"offline report: checkpoints folder {settings.checkpoints_dir}, LoRA folder {settings.lora_dir}"]
    try:
        from app.engine.checkpoint_files import discover_checkpoints

        lines += [f"checkpoint: {info.name} ({info.kind}, {info.size_bytes} bytes)"
                  for info in discover_checkpoints(settings.checkpoints_dir)]
    except Exception as exc:  # the report must be written even when the engine cannot import
        lines.append(f"checkpoint discovery failed: {type(exc).__name__}: {exc}")
    if settings.lora_dir.is_dir():
        lines += [f"lora: {p.relative_to(settings.lora_dir).as_posix()}"
                  for p in sorted(settings.lora_dir.rglob("*.safetensors"))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(build_bug_report(None, settings, lines))
    return path.resolve()
