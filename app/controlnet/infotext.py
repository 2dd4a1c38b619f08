"""ControlNet units in the infotext, as sd-webui-controlnet writes them, and read back for PNG Info.

The extension writes one pair per unit, `ControlNet 0: "Module: canny, Model: name [hash], Weight: 1, …"`:
inside the quotes, `Key: value` pairs in a fixed order (values never hold a comma or a colon: the
extension refuses to write a unit whose values do). Older versions add `Low Vram`, newer ones `Hr Option`;
reading takes whatever keys a unit carries and fills the rest from the unit defaults.
"""

from __future__ import annotations

import re

from app.controlnet.units import ControlUnit

_KEY = re.compile(r"^ControlNet (\d+)$")
FIELDS = (("Module", "module"), ("Model", "model"), ("Weight", "weight"), ("Resize Mode", "resize_mode"),
          ("Processor Res", "processor_res"), ("Threshold A", "threshold_a"), ("Threshold B", "threshold_b"),
          ("Guidance Start", "guidance_start"), ("Guidance End", "guidance_end"), ("Pixel Perfect", "pixel_perfect"),
          ("Control Mode", "control_mode"))


def _number(value: float) -> str:
    return f"{value:g}"


def unit_text(unit: ControlUnit, title: str) -> str:
    """One unit's value, `title` its model's `name [hash]`."""
    values = {"module": unit.module, "model": title, "weight": _number(unit.weight), "resize_mode": unit.resize_mode,
              "processor_res": str(unit.processor_res), "threshold_a": _number(unit.threshold_a),
              "threshold_b": _number(unit.threshold_b), "guidance_start": _number(unit.guidance_start),
              "guidance_end": _number(unit.guidance_end), "pixel_perfect": str(unit.pixel_perfect),
              "control_mode": unit.control_mode}
    return ", ".join(f"{key}: {values[attr]}" for key, attr in FIELDS)


def infotext_pairs(units, titles) -> tuple[tuple[str, str], ...]:
    """(`ControlNet i`, its text) per unit, `titles` the models' `name [hash]` in unit order."""
    return tuple((f"ControlNet {i}", unit_text(unit, title)) for i, (unit, title) in enumerate(zip(units, titles,
                                                                                                    strict=True)))


def read_units(settings: dict[str, str]) -> tuple[ControlUnit, ...]:
    """The units an infotext's settings name (`ControlNet 0`, `ControlNet 1`, … in index order), without
    their pictures; a unit whose values the unit record refuses raises ValueError naming it."""
    found = sorted((int(m[1]), value) for key, value in settings.items() if (m := _KEY.match(key)))
    return tuple(_unit(index, value) for index, value in found)


def _unit(index: int, text: str) -> ControlUnit:
    pairs = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
    pairs = {k.strip(): v.strip() for k, v in pairs.items()}
    kwargs: dict[str, object] = {}
    for key, attr in FIELDS:
        if key not in pairs:
            continue
        raw = pairs[key]
        if attr in ("weight", "threshold_a", "threshold_b", "guidance_start", "guidance_end"):
            kwargs[attr] = float(raw)
        elif attr == "processor_res":
            kwargs[attr] = int(float(raw))
        elif attr == "pixel_perfect":
            kwargs[attr] = raw == "True"
        else:
            kwargs[attr] = raw
    try:
        return ControlUnit(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"ControlNet {index} in the infotext: {exc}") from exc
