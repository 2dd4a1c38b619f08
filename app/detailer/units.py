"""A detailer unit: what one ADetailer tab asks of a generation, with ADetailer's own names and defaults.

Why one frozen value: the UI, the A1111 API (`alwayson_scripts.ADetailer.args`), the infotext and
Send-to speak of the same settings; each reads or writes this record, so a unit checked once is the
unit that runs. Field names are ADetailer's `ad_*` arguments (its `adetailer/args.py`, version
`ADETAILER_VERSION`) without the prefix; defaults are its defaults; infotext keys are the ones it writes
(`ADetailer model`, `ADetailer confidence`, … and ` 2nd` after each key of the second unit), leaving
out the same default-valued keys it leaves out, so a PNG reads the same in both tools.

Two spellings of one setting: ADetailer 25.3 renamed `ad_mask_k_largest` to `ad_mask_k` (and added
`ad_mask_filter_method`), while `webuiapi.ADetailer` still sends the old name; both are read here.
Settings this app cannot run (a separate checkpoint or VAE, face restoration, a ControlNet inside the
pass) are refused by name when a dict turns them on, instead of being dropped silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

ADETAILER_VERSION = "25.3.0"  # the ADetailer whose arguments and infotext these are; /adetailer/v1/version
MAX_UNITS = 2  # ADetailer's default number of tabs ("up to 2 detailer units in order")
NO_MODEL = "None"
FILTER_METHODS = ("Area", "Confidence")  # how `mask_k` picks the regions it keeps
MERGE_INVERT = ("None", "Merge", "Merge and Invert")
SAME_SCHEDULER = "Use same scheduler"
# Keys of the second, third… unit carry ADetailer's ordinal suffix: "ADetailer model 2nd".
_ORDINALS = {1: "st", 2: "nd", 3: "rd"}

# ad_* settings this app cannot run: (the switch, the value it turns on, why). A switch left off, or on with
# the value saying "the same" (ADetailer's "Use same checkpoint"), asks for nothing and passes.
_REFUSED = (
    ("ad_use_checkpoint", "ad_checkpoint", "a separate checkpoint for the detail pass is not supported; "
     "switch the checkpoint for the whole generation instead"),
    ("ad_use_vae", "ad_vae", "a separate VAE for the detail pass is not supported"),
    ("ad_restore_face", None, "face restoration (CodeFormer/GFPGAN) is not part of this app"),
    (None, "ad_controlnet_model", "a ControlNet inside the detail pass is not supported"),
)
_SAME = (None, "", "None", "Use same checkpoint", "Use same VAE")
# Keys read and ignored: the UI's own bookkeeping, YOLO-World's class list, the refused features' details.
_IGNORED = frozenset({"is_api", "ad_tab_enable", "ad_model_classes", "ad_controlnet_module", "ad_controlnet_weight",
                      "ad_controlnet_guidance_start", "ad_controlnet_guidance_end"})
_RENAMED = {"ad_mask_k_largest": "ad_mask_k"}
_SKIPPED = _IGNORED | {key for row in _REFUSED for key in row[:2] if key}  # checked first, or not ours


class _Range(NamedTuple):
    low: float
    high: float


# Bounds: ADetailer's where it has them (confidence, ratios, noise multiplier, CLIP skip); elsewhere
# the range its UI sliders offer, widened, so that a hostile number cannot ask for a huge kernel or crop.
_RANGES = {
    "confidence": _Range(0.0, 1.0),
    "mask_k": _Range(0, 64),
    "mask_min_ratio": _Range(0.0, 1.0),
    "mask_max_ratio": _Range(0.0, 1.0),
    "x_offset": _Range(-4096, 4096),
    "y_offset": _Range(-4096, 4096),
    "dilate_erode": _Range(-256, 256),
    "mask_blur": _Range(0, 256),
    "denoising_strength": _Range(0.0, 1.0),
    "inpaint_only_masked_padding": _Range(0, 1024),
    "inpaint_width": _Range(64, 4096),
    "inpaint_height": _Range(64, 4096),
    "steps": _Range(1, 150),
    "cfg_scale": _Range(0.0, 30.0),
    "noise_multiplier": _Range(0.5, 1.5),
    "clip_skip": _Range(1, 12),
}


@dataclass(frozen=True)
class DetailUnit:
    """One enabled detailer unit. `model` names a detector (`app.detailer.detect.model_names`); the
    `use_*` switches say whether the value after each replaces the generation's own, as in ADetailer.
    An empty prompt means the generation's prompt; `[PROMPT]` and `[SEP]` keep ADetailer's meaning."""

    model: str
    prompt: str = ""
    negative_prompt: str = ""
    confidence: float = 0.3
    mask_filter_method: str = FILTER_METHODS[0]
    mask_k: int = 0  # keep only the k largest (or most confident) regions; 0: all
    mask_min_ratio: float = 0.0  # box area / image area bounds
    mask_max_ratio: float = 1.0
    x_offset: int = 0  # px, to the right
    y_offset: int = 0  # px, upwards (ADetailer's sign)
    dilate_erode: int = 4  # px kernel: > 0 dilates, < 0 erodes
    mask_merge_invert: str = MERGE_INVERT[0]
    mask_blur: int = 4
    denoising_strength: float = 0.4
    inpaint_only_masked: bool = True
    inpaint_only_masked_padding: int = 32
    use_inpaint_width_height: bool = False
    inpaint_width: int = 512
    inpaint_height: int = 512
    use_steps: bool = False
    steps: int = 28
    use_cfg_scale: bool = False
    cfg_scale: float = 7.0
    use_sampler: bool = False
    sampler: str = "DPM++ 2M Karras"
    scheduler: str = SAME_SCHEDULER
    use_noise_multiplier: bool = False
    noise_multiplier: float = 1.0
    use_clip_skip: bool = False
    clip_skip: int = 1

    def __post_init__(self) -> None:
        if not self.model or self.model == NO_MODEL:
            raise ValueError("ad_model: a detailer unit needs a detector model (see GET /adetailer/v1/ad_model)")
        for name, bounds in _RANGES.items():
            value = getattr(self, name)
            if not bounds.low <= value <= bounds.high:
                raise ValueError(f"ad_{name} must be in {bounds.low:g}…{bounds.high:g}, got {value!r}")
        if self.mask_min_ratio > self.mask_max_ratio:
            raise ValueError(f"ad_mask_min_ratio ({self.mask_min_ratio:g}) is above ad_mask_max_ratio "
                             f"({self.mask_max_ratio:g}): no region could pass")
        if self.mask_filter_method not in FILTER_METHODS:
            raise ValueError(f"ad_mask_filter_method must be one of {FILTER_METHODS}, got {self.mask_filter_method!r}")
        if self.mask_merge_invert not in MERGE_INVERT:
            raise ValueError(f"ad_mask_merge_invert must be one of {MERGE_INVERT}, got {self.mask_merge_invert!r}")


_FIELDS = {f.name: f for f in dataclasses.fields(DetailUnit)}


def _coerce(key: str, value: Any, kind: type) -> Any:
    """A JSON value as the field's type: ints accept integral floats (webuiapi sends `ad_mask_k_largest`
    as 0.0), floats accept ints; anything else is refused with the key named."""
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, str):
        return value
    raise ValueError(f"{key} must be {kind.__name__}, got {value!r}")


def from_a1111(args: dict[str, Any]) -> DetailUnit | None:
    """The unit one `ad_*` dict (as `webuiapi.ADetailer.to_dict()` writes it) asks for, or None where
    ADetailer skips it (`ad_model` "None" or `ad_tab_enable` false). Raises ValueError naming the key
    for an unknown key, a wrong type, a value out of range or a setting this app cannot run."""
    if not isinstance(args, dict):
        raise ValueError(f"an ADetailer unit must be a dict of ad_* settings, got {type(args).__name__}")
    if args.get("ad_model", NO_MODEL) in (NO_MODEL, None) or args.get("ad_tab_enable", True) is False:
        return None
    for switch, value, why in _REFUSED:
        if (switch is None or args.get(switch) is True) and (value is None or args.get(value) not in _SAME):
            raise ValueError(f"{switch or value}: {why}")
    values: dict[str, Any] = {}
    for key, value in args.items():
        key = _RENAMED.get(key, key)
        if key in _SKIPPED:
            continue
        field = _FIELDS.get(key[3:]) if key.startswith("ad_") else None
        if field is None:
            raise ValueError(f"unknown ADetailer setting {key!r}")
        values[field.name] = _coerce(key, value, _kind(field))
    return DetailUnit(**values)


def _kind(field: dataclasses.Field) -> type:
    return {"bool": bool, "int": int, "float": float}.get(str(field.type), str)


class DetailRequest(NamedTuple):
    """`alwayson_scripts.ADetailer.args` read: whether it runs, ADetailer's "skip img2img", the units."""

    enabled: bool
    skip_img2img: bool
    units: tuple[DetailUnit, ...]


def parse_args(args: list[Any]) -> DetailRequest:
    """Read `[enable, skip_img2img?, {ad_*}, {ad_*}, …]` as ADetailer does: a leading bool is the switch
    (absent: on), a bool second is "skip img2img", the dicts are the units in order, those with
    `ad_model` "None" dropped. Enabled with no unit left runs nothing (`enabled` False), as in ADetailer."""
    if not isinstance(args, list) or not args:
        raise ValueError("alwayson_scripts.ADetailer.args must be a list: [enable, skip_img2img?, {ad_*}, …]")
    enabled = args[0] if isinstance(args[0], bool) else True
    skip_img2img = len(args) >= 2 and isinstance(args[1], bool) and args[1]
    extra = [a for a in args[:2] if not isinstance(a, (bool, dict))] + [a for a in args[2:] if not isinstance(a, dict)]
    if extra:
        raise ValueError(f"alwayson_scripts.ADetailer.args holds {extra[0]!r}; expected bools then ad_* dicts")
    units = []
    for n, item in enumerate((a for a in args if isinstance(a, dict)), 1):
        try:
            unit = from_a1111(item)
        except ValueError as err:
            raise ValueError(f"ADetailer {ordinal(n)} unit: {err}") from None
        if unit is not None:
            units.append(unit)
    if len(units) > MAX_UNITS:
        raise ValueError(f"at most {MAX_UNITS} ADetailer units run at once, got {len(units)}")
    return DetailRequest(enabled and bool(units), bool(skip_img2img), tuple(units))


def from_alwayson(scripts: dict[str, Any] | None) -> DetailRequest | None:
    """The ADetailer entry of a request's `alwayson_scripts` (the name matched without case, as A1111
    matches script titles), or None where there is none."""
    for name, entry in (scripts or {}).items():
        if name.lower() == "adetailer":
            if not isinstance(entry, dict) or "args" not in entry:
                raise ValueError('alwayson_scripts.ADetailer must be {"args": [enable, skip_img2img?, {ad_*}, …]}')
            return parse_args(entry["args"])
    return None


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, … 11th, 12th, 13th, 21st (ADetailer's `ordinal`)."""
    return f"{n}{'th' if 11 <= n % 100 <= 13 else _ORDINALS.get(n % 10, 'th')}"


def _suffix(index: int) -> str:
    return "" if index == 0 else " " + ordinal(index + 1)


# (field, infotext key) in ADetailer's order, and the rule it drops a key by: (key, dropped-with, when).
_INFOTEXT_KEYS = (
    ("model", "ADetailer model"), ("prompt", "ADetailer prompt"),
    ("negative_prompt", "ADetailer negative prompt"), ("confidence", "ADetailer confidence"),
    ("mask_filter_method", "ADetailer method to decide top k masks"), ("mask_k", "ADetailer mask only top k"),
    ("mask_min_ratio", "ADetailer mask min ratio"), ("mask_max_ratio", "ADetailer mask max ratio"),
    ("x_offset", "ADetailer x offset"), ("y_offset", "ADetailer y offset"),
    ("dilate_erode", "ADetailer dilate erode"), ("mask_merge_invert", "ADetailer mask merge invert"),
    ("mask_blur", "ADetailer mask blur"), ("denoising_strength", "ADetailer denoising strength"),
    ("inpaint_only_masked", "ADetailer inpaint only masked"),
    ("inpaint_only_masked_padding", "ADetailer inpaint padding"),
    ("use_inpaint_width_height", "ADetailer use inpaint width height"),
    ("inpaint_width", "ADetailer inpaint width"), ("inpaint_height", "ADetailer inpaint height"),
    ("use_steps", "ADetailer use separate steps"), ("steps", "ADetailer steps"),
    ("use_cfg_scale", "ADetailer use separate CFG scale"), ("cfg_scale", "ADetailer CFG scale"),
    ("use_sampler", "ADetailer use separate sampler"), ("sampler", "ADetailer sampler"),
    ("scheduler", "ADetailer scheduler"),
    ("use_noise_multiplier", "ADetailer use separate noise multiplier"),
    ("noise_multiplier", "ADetailer noise multiplier"),
    ("use_clip_skip", "ADetailer use separate CLIP skip"), ("clip_skip", "ADetailer CLIP skip"),
)
# ADetailer's `extra_params`: when `field` has the value `when` (None: any falsy value), the keys of
# `drops` are left out.
_DROPS = (
    ("prompt", None, ("prompt",)), ("negative_prompt", None, ("negative_prompt",)),
    ("mask_k", 0, ("mask_k", "mask_filter_method")), ("mask_min_ratio", 0.0, ("mask_min_ratio",)),
    ("mask_max_ratio", 1.0, ("mask_max_ratio",)), ("x_offset", 0, ("x_offset",)), ("y_offset", 0, ("y_offset",)),
    ("mask_merge_invert", "None", ("mask_merge_invert",)),
    ("inpaint_only_masked", None, ("inpaint_only_masked_padding",)),
    ("use_inpaint_width_height", None, ("use_inpaint_width_height", "inpaint_width", "inpaint_height")),
    ("use_steps", None, ("use_steps", "steps")), ("use_cfg_scale", None, ("use_cfg_scale", "cfg_scale")),
    ("use_sampler", None, ("use_sampler", "sampler", "scheduler")), ("scheduler", SAME_SCHEDULER, ("scheduler",)),
    ("use_noise_multiplier", None, ("use_noise_multiplier", "noise_multiplier")),
    ("use_clip_skip", None, ("use_clip_skip", "clip_skip")),
)


def infotext_pairs(unit: DetailUnit, index: int) -> list[tuple[str, object]]:
    """The `(key, value)` pairs ADetailer writes for its `index`-th unit (0: no suffix, 1: " 2nd")."""
    dropped: set[str] = set()
    for field, when, drops in _DROPS:
        value = getattr(unit, field)
        if (not value) if when is None else value == when:
            dropped.update(drops)
    suffix = _suffix(index)
    return [(key + suffix, getattr(unit, name)) for name, key in _INFOTEXT_KEYS if name not in dropped]


def infotext_settings(units: tuple[DetailUnit, ...]) -> list[tuple[str, object]]:
    """Every unit's pairs, then `ADetailer version` once, as ADetailer appends it."""
    pairs = [pair for index, unit in enumerate(units) for pair in infotext_pairs(unit, index)]
    return [*pairs, ("ADetailer version", ADETAILER_VERSION)] if pairs else []


def _from_text(key: str, text: str, kind: type) -> Any:
    if kind is bool:
        if text not in ("True", "False"):
            raise ValueError(f"{key} must be True or False, got {text!r}")
        return text == "True"
    try:
        return kind(float(text)) if kind is int and "." in text else kind(text)
    except ValueError:
        raise ValueError(f"{key} must be {kind.__name__}, got {text!r}") from None


def units_from_infotext(settings: dict[str, str]) -> tuple[DetailUnit, ...]:
    """The units an infotext's settings (`app.infotext.parse_infotext(...).settings`) name, in order.
    A key left out takes ADetailer's default, which is why it may be left out."""
    units = []
    for index in range(MAX_UNITS):
        suffix = _suffix(index)
        if f"ADetailer model{suffix}" not in settings:
            break
        values = {}
        for name, key in _INFOTEXT_KEYS:
            if key + suffix in settings:
                values[name] = _from_text(key + suffix, settings[key + suffix], _kind(_FIELDS[name]))
        units.append(DetailUnit(**values))
    return tuple(units)
