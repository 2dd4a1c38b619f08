"""The bug report's PNG card: what a reporter pastes into an issue tracker, so a maintainer sees at
a glance where every component lives (a strip per component, coloured by device and shaded by
dtype), which tensors violate the plan, which LoRAs misbehave and the last transitions. Drawn from
the redacted report dict (`app.report`), so it cannot show more than the JSON."""

from __future__ import annotations

import time

from PIL import Image, ImageDraw, ImageFont

_WIDTH, _MARGIN, _LABEL_W, _BAR_H = 1100, 20, 130, 24
_INK, _MUTED, _BAD, _WARN, _BG = "#1f2328", "#57606a", "#d1242f", "#bc4c00", "#ffffff"
_DEVICE_COLOURS = {"cpu": ("#1f5fa8", "#4c8fd6", "#9cc3ee"), "cuda": ("#2a7d2e", "#4fae53", "#9fd6a1"),
                   "meta": ("#6e7781", "#8c959f", "#afb8c1"), "mps": ("#6f42c1", "#8a63d2", "#c2a8f0")}
_SHOWN_ERRORS = 6  # the newest errors the pages showed, one line each (the JSON has them all)
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
    errors = report.get("errors") or []
    engine_errors = [err for err in errors if not err.get("shown")]
    shown = [err for err in errors if err.get("shown")]
    for err in engine_errors:
        canvas.text(f"last error in {err['command']}: {err['message']}", 13, _BAD, bold=True)
    canvas.heading(f"Errors shown on the page: {len(shown)}" if shown else "Errors shown on the page: none")
    for err in shown[-_SHOWN_ERRORS:]:
        stamp = time.strftime("%H:%M:%S", time.localtime(err["at"]))
        canvas.text(f"[{stamp}] {err['command']}: {err['message']}", 12, _BAD)


def _versions_line(report: dict) -> str:
    v = report.get("versions", {})
    libs = v.get("libraries", {})
    t = v.get("torch", {})
    gpu = report.get("gpu")
    gpu_text = ", ".join(g["name"] for g in gpu) if isinstance(gpu, list) and gpu else "no NVML GPU"
    return (f"steady-diffusion {v.get('app')} · Python {v.get('python')} · torch {t.get('version')} "
            f"(CUDA {t.get('cuda_build') or 'none'}) · diffusers {libs.get('diffusers')} · "
            f"gradio {libs.get('gradio')} · {gpu_text} · {v.get('platform')}")


def model_line(snap: dict) -> str:
    """The card's line about the loaded model. Reports written before the snapshot's "arch" key became "family"
    (2026-11-29) are still read: a user attaches the card of whatever version they run."""
    kind = snap.get("model_label") or snap.get("family") or snap.get("arch") or "-"
    return (f"state {snap.get('state')} · model {snap.get('model') or 'none'} ({kind}, "
            f"{snap.get('model_hash') or '-'}) · device {snap.get('device')} · dtype {snap.get('dtype') or '-'}"
            f" (asked {snap.get('requested_dtype')}) · offload {snap.get('offload')}")


def render_card(report: dict) -> Image.Image:
    """The PNG card for an issue tracker, drawn from a (redacted) report dict."""
    canvas = _Canvas()
    snap = report.get("snapshot") or {}
    canvas.text("Steady Diffusion - bug report", 22, bold=True)
    canvas.text(report.get("created", ""), 12, _MUTED)
    if snap:
        found, repaired = snap.get("violations_found_total", 0), snap.get("violations_repaired_total", 0)
        canvas.text(model_line(snap), 14)
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
