"""Bug-report bundle: one zip with a JSON dump and a PNG card, safe to attach to a public issue.

Why both: the JSON is complete (versions, settings, snapshot, history, per-LoRA counters,
errors with tracebacks, recent log lines) for whoever debugs; the PNG card is what a reporter
pastes into an issue tracker, so a maintainer sees at a glance where every component lives,
which tensors violate the plan and which LoRAs misbehave, without opening anything.

Everything goes through `redact()` before it is written: paths inside the data folder become
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
import sysconfig
import time
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from app import diagnostics
from app.settings import Settings

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


def install_folders() -> list[tuple[str, str]]:
    """(folder, stand-in) for where the app and Python are installed, the most specific first: a
    traceback names them in every line, and they tell the reader the user's name and layout."""
    paths = sysconfig.get_paths()
    named = {str(Path(__file__).resolve().parents[1]): "<app>", paths["purelib"]: "<site-packages>",
             paths["platlib"]: "<site-packages>", paths["stdlib"]: "<python>", sys.prefix: "<python>"}
    return sorted(((folder, name) for folder, name in named.items() if len(folder) > 1),
                  key=lambda pair: len(pair[0]), reverse=True)


def redact(value: Any, secrets: Iterable[str] = (), home: str | None = None, data_dir: str | None = None) -> Any:
    """Return a copy of a JSON-able value that is safe to publish.

    Paths under `data_dir` become relative to it (`models/Lora/x.safetensors`; the folder itself
    `.`), other home-folder paths start with `~`, share URLs are removed, every occurrence of a
    known secret is replaced, and the values of keys that name a secret (`password`, `token`,
    `share_url` …) are blanked whatever they hold.
    """
    home = str(Path.home()) if home is None else home
    secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
    installs = install_folders()

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: (REDACTED if _SECRET_KEY.search(str(k)) and v[k] else clean(v[k])) for k in v}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if not isinstance(v, str):
            return v
        for secret in secrets:
            v = v.replace(secret, REDACTED)
        v = _SHARE_URL.sub("[share link removed]", v)
        if data_dir and data_dir != "/":
            v = re.sub(re.escape(data_dir) + r"[/\\]", "", v)
            v = re.sub(re.escape(data_dir) + r"(?![\w.-])", ".", v)
        for folder, name in installs:
            v = v.replace(folder, name)
        if home and home != "/":
            v = re.sub(re.escape(home) + r"(?=[/\\]|$|\W)", "~", v)
        return v

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


def collect_report(engine, settings: Settings, log_lines: Iterable[str] = (), secrets: Iterable[str] = ()) -> dict:
    """Everything a maintainer needs, redacted. `engine` may be None (the UI could not start)."""
    snapshot = engine.snapshot() if engine is not None else None
    errors = []
    if snapshot is not None and snapshot.last_error is not None:
        errors.append(snapshot.last_error)
    report = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "versions": versions(),
        "gpu": diagnostics.gpu_stats(),
        "process_memory": diagnostics.process_memory(),
        "settings": settings.public_dict(),
        "snapshot": snapshot,
        "weight_storage": diagnostics.storage_summary(snapshot.weights, snapshot.stored_layers, snapshot.bytes_saved,
                                                      snapshot.dtype) if snapshot is not None else "",
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
                     secrets: Iterable[str] = ()) -> bytes:
    """The zip bundle as bytes: `report.json` and `card.png`."""
    report = collect_report(engine, settings, log_lines, secrets)
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


# ------------------------------------------------------------------------------------ the card
_WIDTH, _MARGIN, _LABEL_W, _BAR_H = 1100, 20, 130, 24
_INK, _MUTED, _BAD, _WARN, _BG = "#1f2328", "#57606a", "#d1242f", "#bc4c00", "#ffffff"
_DEVICE_COLOURS = {"cpu": ("#1f5fa8", "#4c8fd6", "#9cc3ee"), "cuda": ("#2a7d2e", "#4fae53", "#9fd6a1"),
                   "meta": ("#6e7781", "#8c959f", "#afb8c1"), "mps": ("#6f42c1", "#8a63d2", "#c2a8f0")}
_DTYPE_SHADE = {"fp32": 0, "bf16": 1, "fp16": 2}
# Typographic characters engine messages use, spelled so any fallback font can draw them.
_ASCII_PUNCTUATION = str.maketrans({"—": "-", "–": "-", "→": "->", "←": "<-", "…": "...", "✗": "x", "✓": "v",
                                    "⚠": "!", "‘": "'", "’": "'", "“": '"', "”": '"'})


def _font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
    """DejaVu where the system has it, else Pillow's bundled font: never a download."""
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    try:
        return ImageFont.truetype(name, size)
    except OSError:
        return ImageFont.load_default(size=size)


def placement_colour(device: str, dtype: str) -> str:
    """Hue by device type, shade by dtype; mixed or unknown combinations are orange."""
    shades = _DEVICE_COLOURS.get(device.split(":")[0])
    if shades is None or "+" in device or dtype not in _DTYPE_SHADE:
        return "#e8a33d"
    return shades[_DTYPE_SHADE[dtype]]


def _runs(rows: list[dict]) -> list[tuple[str, str, bool, float]]:
    """Merge consecutive modules with the same placement into (device, dtype, violation, MiB) runs."""
    runs: list[list] = []
    for row in rows:
        dtype = next((d for d in row["storage"].split("+") if d.startswith(("fp", "bf", "float"))), None)
        if dtype is None and not row["violation"]:
            continue  # integer-only buffers (position ids) have no float dtype to show
        dtype = dtype or row["storage"]
        key = (row["device"], dtype, bool(row["violation"]))
        if runs and tuple(runs[-1][:3]) == key:
            runs[-1][3] += row["mib"]
        else:
            runs.append([*key, row["mib"]])
    return [tuple(r) for r in runs]


class _Canvas:
    """A growing card: sections append lines; the image is cropped to what was drawn.

    Card text sticks to Latin-1 punctuation: Pillow's bundled fallback font (used where DejaVu is
    missing, e.g. minimal GPU hosts) has no glyphs for arrows, dashes or check marks.
    """

    def __init__(self) -> None:
        self.image = Image.new("RGB", (_WIDTH, 4000), _BG)
        self.draw = ImageDraw.Draw(self.image)
        self.y = _MARGIN

    def text(self, text: str, size: int = 14, colour: str = _INK, bold: bool = False, x: int = _MARGIN) -> None:
        font = _font(size, bold)
        text = text.translate(_ASCII_PUNCTUATION)
        max_chars = max(20, int((_WIDTH - x - _MARGIN) / (size * 0.55)))
        line = text if len(text) <= max_chars else text[: max_chars - 3] + "..."
        self.draw.text((x, self.y), line, fill=colour, font=font)
        self.y += int(size * 1.45)

    def heading(self, text: str) -> None:
        self.y += 8
        self.text(text, 16, bold=True)
        self.draw.line((_MARGIN, self.y, _WIDTH - _MARGIN, self.y), fill="#d0d7de", width=1)
        self.y += 6

    def finish(self) -> Image.Image:
        return self.image.crop((0, 0, _WIDTH, self.y + _MARGIN))


def _draw_strip(canvas: _Canvas, component: str, rows: list[dict]) -> set[tuple[str, str]]:
    """One bar per component, each run as wide as its share of the component's MiB."""
    total = sum(r["mib"] for r in rows) or 1.0
    bad = sum(1 for r in rows if r["violation"])
    x0, width = _MARGIN + _LABEL_W, _WIDTH - 2 * _MARGIN - _LABEL_W - 190
    canvas.draw.text((_MARGIN, canvas.y + 4), component, fill=_INK, font=_font(13, bold=True))
    x, seen = float(x0), set()
    runs = _runs(rows)
    for device, dtype, violation, mib in runs:
        w = max(1.0, width * mib / total)
        canvas.draw.rectangle((x, canvas.y, x + w, canvas.y + _BAR_H), fill=placement_colour(device, dtype))
        if violation:
            canvas.draw.rectangle((x, canvas.y - 3, x + max(w, 4), canvas.y + _BAR_H + 3), outline=_BAD, width=3)
        elif w > 70:
            canvas.draw.text((x + 4, canvas.y + 5), f"{device}/{dtype}", fill="#ffffff", font=_font(11))
        seen.add((device, dtype))
        x += w
    summary = f"{total:,.1f} MiB" + (f" · {bad} violating" if bad else "")
    canvas.draw.text((x0 + width + 10, canvas.y + 4), summary, fill=_BAD if bad else _MUTED, font=_font(12))
    canvas.y += _BAR_H + 10
    return seen


def _draw_placement(canvas: _Canvas, snapshot: dict) -> None:
    canvas.heading("Placement (each bar: one component, width by MiB; red frame = violation)")
    by_component: dict[str, list[dict]] = {}
    for row in snapshot.get("placement") or []:
        by_component.setdefault(row["component"], []).append(row)
    if not by_component:
        canvas.text("no model loaded", colour=_MUTED)
        return
    seen: set[tuple[str, str]] = set()
    for component, rows in by_component.items():
        seen |= _draw_strip(canvas, component, rows)
    x = _MARGIN + _LABEL_W
    for device, dtype in sorted(seen):
        canvas.draw.rectangle((x, canvas.y + 2, x + 14, canvas.y + 16), fill=placement_colour(device, dtype))
        canvas.draw.text((x + 20, canvas.y + 2), f"{device} / {dtype}", fill=_INK, font=_font(12))
        x += 40 + int(_font(12).getlength(f"{device} / {dtype}"))
    canvas.y += 26
    violations = snapshot.get("violations") or []
    for v in violations[:5]:
        canvas.text(f"X {v['component']}.{v['module']}.{v['tensor']}: expected {v['expected']}, found {v['actual']}",
                    12, _BAD)
    if len(violations) > 5:
        canvas.text(f"... and {len(violations) - 5} more violations", 12, _BAD)


def _strength(spec: dict, key: str) -> float:
    """A serialised `LoraSpec`'s UNet or text-encoder strength (falls back to `weight`, as the spec does)."""
    return spec["weight"] if spec.get(key) is None else spec[key]


def _draw_loras(canvas: _Canvas, snapshot: dict, counters: dict) -> None:
    mode = f", {snapshot['lora_mode']}" if snapshot.get("loras") and snapshot.get("lora_mode") else ""
    canvas.heading(f"LoRAs{mode} (matched layers / unmatched keys / apply errors / runtime errors)")
    weights = {s["name"]: s for s in snapshot.get("loras") or []}
    aside = {s["name"] for s in snapshot.get("lora_states") or [] if s.get("status") == "set aside"}
    names = list(dict.fromkeys([*weights, *counters]))
    if not names:
        canvas.text("none", colour=_MUTED)
    for name in names:
        c = counters.get(name, {})
        spec = weights.get(name)
        applied = ("set aside" if name in aside else "not applied") if spec is None else \
            f"weight {_strength(spec, 'unet_weight'):g} / TE {_strength(spec, 'te_weight'):g}"
        line = (f"{name}: {applied} · matched {c.get('matched_layers', 0)} · unmatched {c.get('unmatched_keys', 0)}"
                f" · apply errors {c.get('apply_errors', 0)} · runtime errors {c.get('runtime_errors', 0)}")
        errors = c.get("apply_errors", 0) + c.get("runtime_errors", 0)
        colour = _BAD if errors or (spec is not None and not c.get("matched_layers")) else \
            _WARN if c.get("unmatched_keys") else _INK
        canvas.text(line, 13, colour)
        if c.get("message"):
            canvas.text(f"    {c['message']}", 12, colour if colour != _INK else _MUTED)


def _draw_history(canvas: _Canvas, report: dict) -> None:
    canvas.heading("Recent transitions")
    history = report.get("history") or []
    if not history:
        canvas.text("none", colour=_MUTED)
    for h in history[-8:]:
        colour = _BAD if h["outcome"].startswith("failed") else _INK
        fixes = f" · {h['violations_found']} violations, {h['violations_repaired']} repaired" \
            if h["violations_found"] else ""
        canvas.text(f"{h['command']} {h['detail']} -> {h['outcome']} ({h['duration_s']:.2f} s){fixes}", 12, colour)
    for err in report.get("errors") or []:
        canvas.text(f"last error in {err['command']}: {err['message']}", 13, _BAD, bold=True)


def _versions_line(report: dict) -> str:
    v = report.get("versions", {})
    libs = v.get("libraries", {})
    t = v.get("torch", {})
    gpu = report.get("gpu")
    gpu_text = ", ".join(g["name"] for g in gpu) if isinstance(gpu, list) and gpu else "no NVML GPU"
    return (f"steady-diffusion {v.get('app')} · Python {v.get('python')} · torch {t.get('version')} "
            f"(CUDA {t.get('cuda_build') or 'none'}) · diffusers {libs.get('diffusers')} · "
            f"gradio {libs.get('gradio')} · {gpu_text} · {v.get('platform')}")


def render_card(report: dict) -> Image.Image:
    """The PNG card for an issue tracker, drawn from a (redacted) report dict."""
    canvas = _Canvas()
    snap = report.get("snapshot") or {}
    canvas.text("Steady Diffusion - bug report", 22, bold=True)
    canvas.text(report.get("created", ""), 12, _MUTED)
    if snap:
        found, repaired = snap.get("violations_found_total", 0), snap.get("violations_repaired_total", 0)
        canvas.text(f"state {snap.get('state')} · model {snap.get('model') or 'none'} ({snap.get('arch') or '-'}, "
                    f"{snap.get('model_hash') or '-'}) · device {snap.get('device')} · dtype {snap.get('dtype') or '-'}"
                    f" (asked {snap.get('requested_dtype')}) · offload {snap.get('offload')}", 14)
        canvas.text(f"violations found {found}, repaired {repaired} since start", 14, _BAD if found else _INK)
        if report.get("weight_storage"):
            canvas.text(report["weight_storage"].translate(_ASCII_PUNCTUATION), 14)
    else:
        canvas.text("written from the command line: no engine was running", 14, _MUTED)
    _draw_placement(canvas, snap)
    _draw_loras(canvas, snap, report.get("lora_counters") or {})
    _draw_history(canvas, report)
    canvas.y += 8
    canvas.text(_versions_line(report), 12, _MUTED)
    return canvas.finish()
