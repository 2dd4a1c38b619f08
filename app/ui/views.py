"""Snapshot -> what the UI shows: status line, tables, memory timeline. Pure functions, no Gradio.

Why separate: the tabs re-render these on every timer tick, and the functions are easiest to
check (and to keep honest) when they take an immutable `Snapshot` and return plain rows.
"""

from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Sequence

from app.engine.snapshot import Snapshot
from app.ui.sessions import API_PREFIX

HISTORY_HEADERS = ["time", "command", "detail", "state", "duration s", "outcome", "violations found/repaired"]
SUMMARY_HEADERS = ["component", "modules", "params", "MiB", "devices", "dtypes", "LoRA-patched", "offload",
                   "violations"]
MODULE_HEADERS = ["component", "module", "class", "device", "storage dtype", "compute dtype", "params", "MiB", "LoRAs",
                  "hooks", "offload", "violation"]
LORA_HEADERS = ["LoRA", "status", "weight (UNet / TE)", "matched layers", "unmatched tensors", "apply errors",
                "runtime errors", "reason / note"]
TIMER_HEADERS = ["timer", "count", "last s", "total s", "mean s"]
GPU_HEADERS = ["GPU", "name", "memory used MiB", "memory total MiB", "utilisation %", "temperature °C"]
MAX_MODULE_ROWS = 400
_BUSY_STATES = {"LOADING", "PATCHING", "MOVING", "GENERATING"}
REASON_CHARS = 90  # a set-aside reason in the status line; the full text is its tooltip and in Diagnostics


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def loras_text(snap: Snapshot) -> str:
    return ", ".join(f"{s.name} {s.schedule_text or format(s.unet_strength, 'g')}/{s.te_strength:g}"
                     for s in snap.loras) or "none"


def _shortened(text: str) -> str:
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"


def not_applied_html(snap: Snapshot) -> list[str]:
    """Each wanted LoRA the engine did not apply (set aside or disabled), with its reason, shortened;
    the whole reason is the tooltip."""
    out = []
    for s in snap.lora_states:
        if s.status in ("applied", "no model loaded"):
            continue
        out.append(f"<span class='sd-aside' title='{html.escape(s.reason, quote=True)}'>⊘ {html.escape(s.name)} "
                   f"{html.escape(s.status)}: {html.escape(_shortened(s.reason))}</span>")
    return out


def applied_in_part_html(snap: Snapshot) -> list[str]:
    """Each applied LoRA of which some tensors matched nothing in the model, with the count and the
    first keys (shortened; the whole message is the tooltip): a LoRA that lost layers is never quiet."""
    out = []
    for s in snap.loras:
        counters = snap.lora_counters.get(s.name)
        if counters is not None and counters.unmatched_keys:
            out.append(f"<span class='sd-partial' title='{html.escape(counters.message, quote=True)}'>⚠ "
                       f"{html.escape(s.name)} applied in part: {html.escape(_shortened(counters.message))}</span>")
    return out


def holder_text(owner: str | None) -> str:
    """Who asked for what an engine holds: a Gradio session (shortened), the A1111 API, or a direct change."""
    if owner is None:
        return "set directly"
    return "for the A1111 API" if owner.startswith(API_PREFIX) else f"for session {owner[:8]}"


def engines_html(snaps: tuple[Snapshot, ...]) -> str:
    """The status line of every engine (one per device with `--devices`), numbered when there are several."""
    if len(snaps) == 1:
        return status_html(snaps[0])
    return "".join(status_html(snap, index) for index, snap in enumerate(snaps))


def status_html(snap: Snapshot, index: int | None = None) -> str:
    """The always-visible engine line: state pill, progress and queue, model, placement policy, whose job
    the engine holds that state for, LoRAs (applied, those applied without some of their tensors, then
    those set aside or disabled with the reason), violations. `index`: the engine's number in a pool."""
    state = snap.state
    css = {"ERROR": "error", "EMPTY": "empty"}.get(state, "busy" if state in _BUSY_STATES else "idle")
    progress = ""
    if snap.progress is not None:
        progress = f" — {html.escape(snap.progress.phase)} {snap.progress.step}/{snap.progress.total}"
    if snap.queued:
        progress += f" · {snap.queued} waiting"
    model = html.escape(snap.model or "no model loaded")
    parts = [
        ("" if index is None else f"engine {index} ") + f"<span class='sd-state sd-{css}'>{state}</span>{progress}",
        f"model <b>{model}</b>" + (f" ({html.escape(snap.model_label or snap.family)})" if snap.family else ""),
        f"{snap.device} · {snap.dtype or snap.requested_dtype} · offload {snap.offload}"
        + (f" · {html.escape(holder_text(snap.held_for))}" if snap.model else ""),
        f"LoRAs {html.escape(loras_text(snap))}" + (f" ({snap.lora_mode})" if snap.loras else ""),
        *applied_in_part_html(snap),
        *not_applied_html(snap),
    ]
    if snap.violations_found_total:
        parts.append(f"<span class='sd-bad'>violations found {snap.violations_found_total}, "
                     f"repaired {snap.violations_repaired_total}</span>")
    # In ERROR, and when EMPTY because the last command failed (a checkpoint that would not load), say why.
    failed_last = bool(snap.history) and snap.history[-1].failed
    if snap.last_error is not None and (snap.state == "ERROR" or (snap.state == "EMPTY" and failed_last)):
        parts.append(f"<span class='sd-bad'>{html.escape(snap.last_error.command)}: "
                     f"{html.escape(snap.last_error.message)}</span>")
    elem_id = "sd-status" if not index else f"sd-status-{index}"
    return f"<div class='sd-status' id='{elem_id}'>" + " · ".join(parts) + "</div>"


def history_rows(snap: Snapshot, limit: int = 25) -> list[list]:
    """Most recent first: what ran, how long, how it ended."""
    return [[_clock(h.started), h.command, h.detail, h.state, round(h.duration_s, 3), h.outcome,
             f"{h.violations_found}/{h.violations_repaired}"] for h in reversed(snap.history[-limit:])]


def component_rows(snap: Snapshot) -> list[list]:
    """One row per component: size, where its tensors are, how many modules carry LoRAs or violate."""
    acc: dict[str, dict] = {}
    for row in snap.placement:
        c = acc.setdefault(row.component, {"modules": 0, "params": 0, "mib": 0.0, "devices": set(), "dtypes": set(),
                                           "patched": 0, "offload": set(), "bad": 0})
        c["modules"] += 1
        c["params"] += row.params
        c["mib"] += row.mib
        c["devices"].update(row.device.split("+"))
        c["dtypes"].update(row.storage.split("+"))
        c["patched"] += bool(row.loras)
        c["offload"].add(row.offload)
        c["bad"] += row.violation
    return [[name, c["modules"], c["params"], round(c["mib"], 2), ", ".join(sorted(c["devices"])),
             ", ".join(sorted(c["dtypes"])), c["patched"], ", ".join(sorted(c["offload"])), c["bad"]]
            for name, c in acc.items()]


def module_rows(snap: Snapshot, component: str = "all", text: str = "", only_violations: bool = False,
                only_patched: bool = False, limit: int = MAX_MODULE_ROWS) -> tuple[list[list], int]:
    """The per-module table after filters; returns (rows shown, rows matching) so the UI can say it cut."""
    needle = text.strip().lower()
    matching = [
        r for r in snap.placement
        if (component in ("all", "", None) or r.component == component)
        and (not needle or needle in f"{r.module} {r.cls}".lower())
        and (not only_violations or r.violation)
        and (not only_patched or r.loras)
    ]
    rows = [[r.component, r.module or "(root)", r.cls, r.device, r.storage, r.compute, r.params, r.mib,
             ", ".join(r.loras), " → ".join(r.hooks), r.offload, "✗ VIOLATION" if r.violation else ""]
            for r in matching[:limit]]
    return rows, len(matching)


def lora_rows(snap: Snapshot) -> list[list]:
    """Every wanted LoRA with the engine's status (applied, set aside, disabled) and reason, then the
    counters of any other LoRA the engine has seen this session."""
    states = {s.name: s for s in snap.lora_states}
    rows = []
    for name in dict.fromkeys([*states, *snap.lora_counters]):
        state, c = states.get(name), snap.lora_counters.get(name)
        status = state.status if state is not None else "not wanted"
        weight = f"{state.unet_shown} / {state.te_strength:g}" if state is not None else ""
        note = (state.reason if state is not None and state.reason else "") or (c.message if c is not None else "")
        counts = [c.matched_layers, c.unmatched_keys, c.apply_errors, c.runtime_errors] if c else ["", "", "", ""]
        rows.append([name, status, weight, *counts, note])
    return rows


def timer_rows(snap: Snapshot) -> list[list]:
    """The engine's timers, then one row per phase of the last generation (`Snapshot.last_generation`:
    where the time of one image went), its wall time as "last s" and its thread-CPU time in the name."""
    rows = [[name, t.count, round(t.last_s, 4), round(t.total_s, 3), round(t.total_s / max(t.count, 1), 4)]
            for name, t in sorted(snap.timers.items())]
    last = snap.last_generation
    if last is not None:
        rows += [[f"last image › {p.name} (CPU {p.cpu_ms:.1f} ms)", p.count, round(p.wall_ms / 1e3, 4), "", ""]
                 for p in last.phases]
    return rows


def gpu_rows(stats: list[dict] | str) -> tuple[list[list], str]:
    """NVML readings as rows, or no rows and the reason NVML is not available."""
    if isinstance(stats, str):
        return [], stats
    rows = [[g["index"], g["name"], round(g["memory_used_mib"]), round(g["memory_total_mib"]), g["utilization_pct"],
             g["temperature_c"]] for g in stats]
    return rows, f"{len(rows)} GPU(s) via NVML"


def error_text(snap: Snapshot, shown: Sequence[dict] = ()) -> str:
    """The engine's last failed transition (with its traceback) and the errors the pages showed
    (`app.diagnostics.ShownErrors`), newest last."""
    err = snap.last_error
    parts = [f"[{_clock(err.at)}] {err.command}: {err.message}\n\n{err.traceback}"] if err is not None else []
    if shown:
        parts.append(f"{len(shown)} error(s) shown on the page:\n" + "\n".join(
            f"[{_clock(e['at'])}] {e['command']}: {e['message']}" for e in shown))
    return "\n\n".join(parts) or "no errors this session"


def _series_path(points: Sequence[tuple[float, float]], x0: float, span: float, lo: float, hi: float, w: int,
                 h: int, top: int = 0) -> str:
    """The line through `points`, time across `w`, `lo`…`hi` from `h` up to `top`."""
    coords = [f"{(t - x0) / span * w:.1f},{h - (v - lo) / (hi - lo) * (h - top):.1f}" for t, v in points]
    return "M" + " L".join(coords) if coords else ""


_LABEL_BAND = 16  # px above the plot where the transition labels go (font size 10), clear of the memory lines
_CHAR_PX = 6.0  # a generous width per character at font size 10, so labels never touch
_LABEL_GAP = 4.0  # px kept free between a label and the next transition's line
_MIN_LABEL = 8  # characters a label is never cut below ("txt… (9)"): closer lines share one label


@dataclasses.dataclass
class _MarkGroup:
    """Transitions named by one label: one alone, or several whose lines are too close for a label each
    (a hires fix with detail passes runs nine within a second: their labels crossed each other's lines).
    The label starts at `left` and has the room up to the next group; its tooltip names every transition."""

    xs: list[float]
    names: list[str]
    left: float

    def label(self, room: float) -> str:
        """The name (for several, their distinct names and how many) cut with "…" to fit `room` px."""
        count = f" ({len(self.names)})" if len(self.names) > 1 else ""
        text = " · ".join(dict.fromkeys(self.names))
        chars = max(int(room // _CHAR_PX), _MIN_LABEL)
        if len(text) + len(count) <= chars:
            return text + count
        return text[:max(chars - len(count) - 1, 1)].rstrip(" ·") + "…" + count


def marker_groups(marks: Sequence[tuple[float, str]], width: int) -> list[tuple[_MarkGroup, str]]:
    """The transitions (x, name), in time order, as groups with their labels. A label starts right of its
    first line (left of the chart's right edge where it must); a line, or label, that would fall under
    the current group's shortest label, or a label that would cover that group's last line, joins the
    group. Each label ends before the next group's line and label: no line crosses a label that does
    not name it, and no two labels meet."""
    shortest = _MIN_LABEL * _CHAR_PX
    groups: list[_MarkGroup] = []
    for x, name in marks:
        left = min(x + 2, width - shortest)
        last = groups[-1] if groups else None
        if last is not None and (min(x, left) < last.left + shortest + _LABEL_GAP or left < last.xs[-1] + _LABEL_GAP):
            last.xs.append(x)
            last.names.append(name)
        else:
            groups.append(_MarkGroup([x], [name], left))
    ends = [min(after.xs[0], after.left) - _LABEL_GAP for after in groups[1:]] + [width]
    return [(group, group.label(end - group.left)) for group, end in zip(groups, ends, strict=True)]


def _markers(marks: Sequence[tuple[float, str]], width: int, height: int) -> str:
    """The dashed lines down the plot, each group's label in the band above them (so no line crosses a
    label); a group's lines and label share one tooltip naming every transition in it."""
    lines, labels = [], []
    for group, label in marker_groups(marks, width):
        tip = f"<title>{html.escape(' → '.join(group.names))}</title>"
        lines.append("<g>" + tip + "".join(
            f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{_LABEL_BAND}' y2='{height}' stroke='#bc4c00' "
            "stroke-dasharray='3,3'/>" for x in group.xs) + "</g>")
        labels.append(f"<g>{tip}<text x='{group.left:.1f}' y='{_LABEL_BAND - 4}' font-size='10' fill='#bc4c00'>"
                      f"{html.escape(label)}</text></g>")
    return "".join(lines + labels)


def timeline_svg(samples: Sequence[dict], width: int = 760, height: int = 180) -> str:
    """RAM (and VRAM where present) over the sampled window, one dashed line per transition, named
    in a band above the plot (`marker_groups`).

    Inline SVG keeps the chart in the page (no image files written per tick, nothing fetched).
    The y axis spans the observed range (labelled), so a few hundred MiB freed stay visible.
    """
    if len(samples) < 2:
        return "<div class='sd-muted' id='sd-timeline'>collecting memory samples…</div>"
    x0, x1 = samples[0]["t"], samples[-1]["t"]
    span = max(x1 - x0, 1.0)
    series = {"RAM": "ram_mib", "VRAM allocated": "vram_allocated_mib", "VRAM reserved": "vram_reserved_mib"}
    colours = {"RAM": "#1f5fa8", "VRAM allocated": "#2a7d2e", "VRAM reserved": "#8fbf6b"}
    present = {label: key for label, key in series.items() if any(key in s for s in samples)}
    values = [s[key] for s in samples for key in present.values() if key in s]
    lo, hi = min(values) * 0.95, max(values) * 1.05 + 1.0
    lines, marks = [], []
    for label, key in present.items():
        path = _series_path([(s["t"], s[key]) for s in samples if key in s], x0, span, lo, hi, width, height,
                            _LABEL_BAND + 2)
        lines.append(f"<path d='{path}' fill='none' stroke='{colours[label]}' stroke-width='2'/>")
    for s in samples:
        if s.get("marker"):
            marks.append(((s["t"] - x0) / span * width, s["marker"]))
    axis = (f"<text x='4' y='{height - 4}' font-size='10' fill='#57606a'>{lo:,.0f} MiB</text>"
            f"<text x='4' y='{_LABEL_BAND + 14}' font-size='10' fill='#57606a'>{hi:,.0f} MiB</text>")
    legend = " ".join(f"<span style='color:{colours[label]}'>■ {label}</span>" for label in present)
    last = samples[-1]
    now = ", ".join(f"{label} {last[key]:,.0f} MiB" for label, key in present.items() if key in last)
    return (f"<div id='sd-timeline'><div class='sd-muted'>{legend} — now: {now}; last {span:.0f} s; "
            f"dashed lines = transitions (hover a label for each one it stands for)</div>"
            f"<svg viewBox='0 0 {width} {height}' width='100%' height='{height}' role='img' "
            f"style='background:#f6f8fa;border-radius:6px'>{axis}{_markers(marks, width, height)}{''.join(lines)}"
            "</svg></div>")
