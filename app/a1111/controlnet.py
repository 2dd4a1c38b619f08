"""The ControlNet extension's API as sd-webui-controlnet speaks it: `/controlnet/*` and its txt2img/img2img units.

Routes: `GET /controlnet/version` (its API version, 2), `/controlnet/model_list` (the models in
`models/ControlNet/`), `/controlnet/module_list` (the preprocessors that can run here, with the extension's
`module_detail` sliders, plus ours: `available` and `reason` for each module, those that cannot run
included), `/controlnet/settings` (units per generation) and `POST /controlnet/detect` (base64 pictures
-> base64 maps; `controlnet_input_images`, or `controlnet_images` as `webuiapi` sends them).

Units: `alwayson_scripts.controlnet.args` (the script's title in any case, as A1111 matches it: `webuiapi`
sends "ControlNet") is a list of unit dicts as `webuiapi.ControlNetUnit.to_dict` and the extension's
`external_code` write them: `image` or `input_image` (base64, or `{"image", "mask"}`), `mask`, `module`,
`model`, `weight`, `guidance_start`, `guidance_end` (or `guidance`), `control_mode` and `resize_mode`
(index or name, the extension's aliases too), `pixel_perfect`, `processor_res`, `threshold_a/b`,
`enabled`, `hr_option` (which passes of a hires fix it guides). A disabled unit is skipped, as the
extension skips it; every other unit the app cannot run (unknown module or model, a picture that is not one, a
bad number, more than `MAX_UNITS`) is refused with a 422 naming the unit and the fix, never dropped. `low_vram`
is accepted and has no effect.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from app.a1111.errors import A1111Route, ApiError
from app.a1111.pnginfo import decode_images
from app.a1111.schema import Name
from app.a1111.state import ApiState
from app.controlnet.files import bare_name, model_names
from app.controlnet.preprocessors import check_module, detect_map, module_list
from app.controlnet.units import CONTROL_MODES, HR_OPTIONS, MAX_UNITS, NO_MODEL, RESIZE_MODES, ControlUnit
from app.settings import Settings

API_VERSION = 2  # the extension's `external_code.get_api_version()`
SCRIPT_TITLE = "controlnet"
# The extension's older names of the resize modes (its `resize_mode_aliases`) and of unit keys (`ext_compat_keys`).
RESIZE_ALIASES = {"Inner Fit (Scale to Fit)": "Crop and Resize", "Outer Fit (Shrink to Fit)": "Resize and Fill",
                  "Scale to Fit (Inner Fit)": "Crop and Resize", "Envelope (Outer Fit)": "Resize and Fill"}
KEY_ALIASES = {"input_image": "image", "guidance": "guidance_end", "lowvram": "low_vram"}
# Keys that change nothing here: memory hints, and the UI's own state the extension's unit also carries.
HARMLESS_KEYS = {"low_vram", "guessmode", "guess_mode", "save_detected_map", "is_ui", "input_mode", "hr_option",
                 "use_preview_as_input", "generated_image"}
UNIT_KEYS = {"image", "mask", "module", "model", "weight", "guidance_start", "guidance_end", "control_mode",
             "resize_mode", "pixel_perfect", "processor_res", "threshold_a", "threshold_b", "enabled"}


def _model(asked: Any, settings: Settings, where: str) -> str:
    """The listed model a unit names (bare, or titled `name [hash]` as the extension's list titles it)."""
    if not isinstance(asked, str) or asked.strip() in ("", NO_MODEL, "none"):
        raise ApiError(422, f"{where}: model is missing; choose one of GET /controlnet/model_list")
    name = bare_name(asked)
    have = model_names(settings.controlnet_dir)
    if name not in have:
        raise ApiError(422, f"{where}: ControlNet model {asked!r} not found in models/ControlNet/; available: "
                            f"{', '.join(have) or 'none'}")
    return name


def _choice(value: Any, names: tuple[str, ...], field: str, where: str,
            aliases: Mapping[str, str] | None = None) -> str:
    """An index into `names` or one of them (or an alias), as the extension takes control and resize modes."""
    aliases = aliases or {}
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int) and 0 <= value < len(names):
        return names[value]
    if isinstance(value, int) and field == "resize_mode" and value == 3:  # "Just Resize (Latent upscale)"
        return names[0]
    if isinstance(value, str) and aliases.get(value, value) in names:
        return aliases.get(value, value)
    raise ApiError(422, f"{where}: {field} {value!r} is not one of {', '.join(names)} (or their index 0…"
                        f"{len(names) - 1})")


def _image_fields(unit: Mapping[str, Any], where: str) -> tuple[str | None, str | None]:
    """(image, mask) base64 strings of a unit: `image` as a string or `{"image", "mask"}`; "" or None: no image."""
    image, mask = unit.get("image"), unit.get("mask")
    if isinstance(image, Mapping):
        image, mask = image.get("image"), image.get("mask", mask)
    for value, name in ((image, "image"), (mask, "mask")):
        if value not in (None, "") and not isinstance(value, str):
            raise ApiError(422, f"{where}: {name} must be a base64 image (a data: URL works too)")
    return image or None, mask or None


def _number(unit: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = unit.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(422, f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def parse_unit(raw: Any, index: int, settings: Settings) -> ControlUnit | None:
    """One entry of `args` as a checked `ControlUnit` (None when `enabled` is false); 422 naming what is wrong."""
    where = f"ControlNet unit {index}"
    if not isinstance(raw, Mapping):
        raise ApiError(422, f"{where}: a unit is a JSON object (webuiapi's ControlNetUnit.to_dict()), got "
                            f"{type(raw).__name__}")
    unit = {KEY_ALIASES.get(k, k): v for k, v in raw.items()}
    asked = sorted(k for k in set(unit) - UNIT_KEYS - HARMLESS_KEYS if unit[k] not in (None, "", [], {}, False, 0))
    if asked:  # other extension features (advanced weighting, regions, union types, batches) set to something
        raise ApiError(422, f"{where}: not supported by this app: {', '.join(asked)}; a unit takes "
                            f"{', '.join(sorted(UNIT_KEYS))}")
    if not unit.get("enabled", True):
        return None
    try:
        module = check_module(unit.get("module") or "none", settings.controlnet_preprocessor_dir).name
    except ValueError as exc:
        raise ApiError(422, f"{where}: {exc}") from None
    image_b64, mask_b64 = _image_fields(unit, where)
    sent = [(data, f"{where} {name}") for data, name in ((image_b64, "image"), (mask_b64, "mask")) if data]
    decoded = iter(decode_images(sent))
    image = next(decoded) if image_b64 else None
    mask = next(decoded) if mask_b64 else None
    res = _number(unit, "processor_res", 512, where)
    try:
        return ControlUnit(
            model=_model(unit.get("model"), settings, where), image=image, mask=mask, module=module,
            weight=_number(unit, "weight", 1.0, where), guidance_start=_number(unit, "guidance_start", 0.0, where),
            guidance_end=_number(unit, "guidance_end", 1.0, where),
            control_mode=_choice(unit.get("control_mode", 0), CONTROL_MODES, "control_mode", where),
            resize_mode=_choice(unit.get("resize_mode", 1), RESIZE_MODES, "resize_mode", where, RESIZE_ALIASES),
            pixel_perfect=bool(unit.get("pixel_perfect", False)), processor_res=512 if res == -1 else int(res),
            threshold_a=_number(unit, "threshold_a", -1, where), threshold_b=_number(unit, "threshold_b", -1, where),
            hr_option=_choice(unit.get("hr_option", HR_OPTIONS[0]), HR_OPTIONS, "hr_option", where))
    except ValueError as exc:
        raise ApiError(422, f"{where}: {exc}") from None


def request_units(scripts: Mapping[str, Any] | None, settings: Settings) -> tuple[ControlUnit, ...]:
    """The enabled units of `alwayson_scripts` (none when ControlNet is not named); 422 for a unit the app
    cannot run, and for more than `MAX_UNITS` enabled ones."""
    entry = next((value for name, value in (scripts or {}).items() if name.lower() == SCRIPT_TITLE), None)
    if entry is None:
        return ()
    args = entry.get("args") if isinstance(entry, Mapping) else None
    if not isinstance(args, list):
        raise ApiError(422, 'alwayson_scripts.controlnet takes {"args": [unit, ...]} (webuiapi ControlNetUnit dicts)')
    units = tuple(unit for i, raw in enumerate(args) if (unit := parse_unit(raw, i, settings)) is not None)
    if len(units) > MAX_UNITS:
        raise ApiError(422, f"at most {MAX_UNITS} ControlNet units run at once, got {len(units)} enabled")
    return units


MAX_DETECT_IMAGES = 16


class DetectRequest(BaseModel):
    """`POST /controlnet/detect`, the extension's body (`controlnet_images`: `webuiapi`'s name for the inputs)."""

    controlnet_module: Name = "none"
    controlnet_input_images: Annotated[list[str], Field(max_length=MAX_DETECT_IMAGES)] = Field(default_factory=list)
    controlnet_images: Annotated[list[str], Field(max_length=MAX_DETECT_IMAGES)] = Field(default_factory=list)
    controlnet_masks: Annotated[list[str], Field(max_length=MAX_DETECT_IMAGES)] = Field(default_factory=list)
    controlnet_processor_res: int = -1
    controlnet_threshold_a: float = -1
    controlnet_threshold_b: float = -1
    low_vram: bool = False


def detect(req: DetectRequest, models_dir: Path) -> dict:
    """The maps of the pictures (base64 PNG, in order), as the extension answers: `{"images", "info"}`."""
    try:
        module = check_module(req.controlnet_module, models_dir)
    except ValueError as exc:
        raise ApiError(422, str(exc)) from None
    sent = req.controlnet_input_images or req.controlnet_images
    if not sent:
        raise ApiError(422, "No image selected: send controlnet_input_images (base64 pictures)")
    if req.controlnet_masks and len(req.controlnet_masks) != len(sent):
        raise ApiError(422, f"controlnet_masks has {len(req.controlnet_masks)} entries for {len(sent)} images")
    pictures = decode_images([(data, f"controlnet_input_images[{i}]") for i, data in enumerate(sent)])
    masks = decode_images([(data, f"controlnet_masks[{i}]") for i, data in enumerate(req.controlnet_masks)])
    resolution = 512 if req.controlnet_processor_res == -1 else req.controlnet_processor_res
    try:
        maps = [detect_map(module.name, picture, resolution, req.controlnet_threshold_a, req.controlnet_threshold_b,
                           mask=masks[i] if masks else None, models_dir=models_dir)
                for i, picture in enumerate(pictures)]
    except ValueError as exc:
        raise ApiError(422, str(exc)) from None
    return {"images": [_png_b64(m) for m in maps], "info": "Success"}


def _png_b64(image) -> str:
    """A map as the extension sends it: base64 PNG, no header, no text chunks."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def controlnet_router(state: ApiState) -> APIRouter:
    """The extension's routes, behind the API's login like `/sdapi/v1` (the request guard checks it)."""
    router = APIRouter(prefix="/controlnet", route_class=A1111Route)
    settings = state.ctx.settings

    @router.get("/version")
    def version() -> dict:
        return {"version": API_VERSION}

    @router.get("/model_list")
    def model_list(update: bool = True) -> dict:
        return {"model_list": model_names(settings.controlnet_dir)}

    @router.get("/module_list")
    def modules(alias_names: bool = False) -> dict:
        rows = module_list(settings.controlnet_preprocessor_dir)
        shown = [(row.alias if alias_names else row.name, row) for row in rows]
        return {"module_list": [name for name, row in shown if row.available],
                "module_detail": {name: {"model_free": False, "sliders": row.sliders, "available": row.available,
                                         "reason": row.reason} for name, row in shown}}

    @router.get("/settings")
    def unit_count() -> dict:
        return {"control_net_unit_count": MAX_UNITS}

    @router.post("/detect")
    async def detect_maps(req: DetectRequest, request: Request) -> dict:
        """In the API's lane, counted against the login's quota like Extras: a detection is CPU work."""
        account = state.account(request)
        return await state.run("controlnet-detect", lambda: detect(req, settings.controlnet_preprocessor_dir),
                               account)

    return router
