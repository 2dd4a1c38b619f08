"""The ControlNet accordion of the Generate and img2img tabs: up to `MAX_UNITS` units, each with its picture, a
preprocessor (module), a model, weight, guidance start/end, control mode, resize mode, pixel perfect, the
preprocessor's resolution and thresholds, and a preview of the map the preprocessor makes.

Why its own module: both tabs lay out the same units and read them into the same `ControlUnit`s the API
builds (`units_from_form`), checked once with the same messages; Send-to fills the same fields from an
infotext's `ControlNet N: "Module: …, Model: …, Weight: …"` entries (`fields_from_infotext`; the pictures are
not in the infotext, so they stay as they are). A unit left without a picture uses img2img's init image, as the
extension does; on Generate it is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gradio as gr
from PIL import Image

from app.controlnet.files import bare_name, model_names
from app.controlnet.preprocessors import check_module, detect_map, module_list
from app.controlnet.units import CONTROL_MODES, MAX_UNITS, NO_MODEL, RESIZE_MODES, ControlUnit
from app.settings import Settings
from app.ui.common import UiContext, user_errors

# The unit settings the form holds, in order after the picture; infotext key (the extension's) -> field.
FIELDS = ("enabled", "module", "model", "weight", "guidance_start", "guidance_end", "control_mode", "resize_mode",
          "pixel_perfect", "processor_res", "threshold_a", "threshold_b")
INFOTEXT_KEYS = {"Module": "module", "Preprocessor": "module", "Model": "model", "Weight": "weight",
                 "Guidance Start": "guidance_start", "Guidance End": "guidance_end", "Control Mode": "control_mode",
                 "Resize Mode": "resize_mode", "Pixel Perfect": "pixel_perfect", "Processor Res": "processor_res",
                 "Threshold A": "threshold_a", "Threshold B": "threshold_b"}
NUMBERS = {"weight", "guidance_start", "guidance_end", "processor_res", "threshold_a", "threshold_b"}


@dataclass
class UnitFields:
    """One unit's components: the picture, its settings (`FIELDS` order) and the preview's button and map."""

    image: gr.Image
    settings: dict[str, gr.components.Component]
    preview: gr.Button
    detected: gr.Image

    @property
    def inputs(self) -> list:
        return [self.image, *self.settings.values()]


@dataclass
class ControlNetPanel:
    units: list[UnitFields]
    refresh: gr.Button

    @property
    def inputs(self) -> list:
        """Every unit's picture and settings, in unit order (what `units_from_form` reads)."""
        return [component for unit in self.units for component in unit.inputs]

    def fields(self) -> dict[str, gr.components.Component]:
        """The settings by Send-to's field names (`cn0_module`, …; what `fields_from_infotext` fills)."""
        return {f"cn{i}_{name}": component for i, unit in enumerate(self.units)
                for name, component in unit.settings.items()}


def _module_choices(settings: Settings) -> tuple[list[str], str]:
    """The modules that run here, and a line naming those that need a model file first."""
    rows = module_list(settings.controlnet_preprocessor_dir)
    missing = [row.name for row in rows if not row.available]
    line = (f"needing a model file first: {', '.join(missing)} (put <name>.onnx in models/ControlNetPreprocessor; "
            "never a .pth)") if missing else ""
    return [row.name for row in rows if row.available], line


def _unit_fields(ctx: UiContext, prefix: str, index: int) -> UnitFields:
    modules, unavailable = _module_choices(ctx.settings)
    eid = f"{prefix}-cn{index}"
    with gr.Row():
        image = gr.Image(type="pil", label="Control image", elem_id=f"{eid}-image", height=220)
        detected = gr.Image(type="pil", label="Detected map", elem_id=f"{eid}-map", height=220, interactive=False,
                            format="png")  # lossless: the map as the model will see it
    with gr.Row(equal_height=True):
        enabled = gr.Checkbox(False, label="Enable", elem_id=f"{eid}-enable")
        pixel_perfect = gr.Checkbox(False, label="Pixel perfect", elem_id=f"{eid}-pixel-perfect")
        preview = gr.Button("Preview map", elem_id=f"{eid}-preview", scale=0, min_width=120)
    with gr.Row():
        module = gr.Dropdown(modules, value="none", label="Preprocessor", info=unavailable or None,
                             elem_id=f"{eid}-module")
        model = gr.Dropdown([NO_MODEL, *model_names(ctx.settings.controlnet_dir)], value=NO_MODEL, label="Model",
                            info="models/ControlNet", elem_id=f"{eid}-model")
    with gr.Row():
        weight = gr.Slider(0, 2, 1, step=0.05, label="Control weight", elem_id=f"{eid}-weight")
        start = gr.Slider(0, 1, 0, step=0.01, label="Starting control step", elem_id=f"{eid}-start")
        end = gr.Slider(0, 1, 1, step=0.01, label="Ending control step", elem_id=f"{eid}-end")
    with gr.Row():
        res = gr.Number(512, label="Preprocessor resolution", info="64…2048", elem_id=f"{eid}-res")
        threshold_a = gr.Number(-1, label="Threshold A", info="-1: the preprocessor's default", elem_id=f"{eid}-a")
        threshold_b = gr.Number(-1, label="Threshold B", info="-1: the preprocessor's default", elem_id=f"{eid}-b")
    control_mode = gr.Radio(list(CONTROL_MODES), value=CONTROL_MODES[0], label="Control mode", elem_id=f"{eid}-mode")
    resize_mode = gr.Radio(list(RESIZE_MODES), value=RESIZE_MODES[1], label="Resize mode", elem_id=f"{eid}-resize")
    settings = dict(zip(FIELDS, (enabled, module, model, weight, start, end, control_mode, resize_mode, pixel_perfect,
                                 res, threshold_a, threshold_b), strict=True))
    return UnitFields(image, settings, preview, detected)


def build_controlnet_panel(ctx: UiContext, prefix: str) -> ControlNetPanel:
    """The accordion (closed) with one sub-tab per unit; `prefix` keeps element ids apart per tab."""
    with gr.Accordion("ControlNet", open=False, elem_id=f"{prefix}-controlnet"):
        refresh = gr.Button("↻ models and preprocessors", size="sm", elem_id=f"{prefix}-cn-refresh")
        units = []
        with gr.Tabs():
            for index in range(MAX_UNITS):
                with gr.Tab(f"Unit {index}", id=f"{prefix}-cn-tab{index}"):
                    units.append(_unit_fields(ctx, prefix, index))
    panel = ControlNetPanel(units, refresh)
    _wire(ctx, panel)
    return panel


def preview_map(settings: Settings, image: Image.Image | None, module: str, resolution, threshold_a,
                threshold_b) -> Image.Image:
    """The map `module` detects in the unit's picture (what the engine will condition on, before resizing)."""
    if image is None:
        raise ValueError("add a control image first")
    pre = check_module(module, settings.controlnet_preprocessor_dir)
    return detect_map(pre.name, image, int(resolution), float(threshold_a), float(threshold_b),
                      models_dir=settings.controlnet_preprocessor_dir)


def _wire(ctx: UiContext, panel: ControlNetPanel) -> None:
    def ui_preview(image, module, resolution, threshold_a, threshold_b):
        with user_errors("ControlNet preview", ctx.settings.data_dir):
            return preview_map(ctx.settings, image, module, resolution, threshold_a, threshold_b)

    for unit in panel.units:
        s = unit.settings
        unit.preview.click(ui_preview, [unit.image, s["module"], s["processor_res"], s["threshold_a"],
                                        s["threshold_b"]], unit.detected, api_visibility="private")

    def ui_refresh():
        modules, unavailable = _module_choices(ctx.settings)
        models = [NO_MODEL, *model_names(ctx.settings.controlnet_dir)]
        return [update for _unit in panel.units for update in (gr.Dropdown(choices=modules, info=unavailable or None),
                                                               gr.Dropdown(choices=models))]

    panel.refresh.click(ui_refresh, None, [c for u in panel.units for c in (u.settings["module"], u.settings["model"])],
                        api_visibility="private")


def units_from_form(settings: Settings, values: Sequence, needs_image: bool) -> tuple[ControlUnit, ...]:
    """The enabled units of the form's `values` (`ControlNetPanel.inputs` order) as checked `ControlUnit`s; a
    ValueError naming the unit for a missing picture (when `needs_image`), module or model, or a bad number."""
    width = 1 + len(FIELDS)
    units = []
    for index in range(len(values) // width):
        image, *rest = values[index * width:(index + 1) * width]
        form = dict(zip(FIELDS, rest, strict=True))
        if not form["enabled"]:
            continue
        where = f"ControlNet unit {index}"
        if image is None and needs_image:
            raise ValueError(f"{where} is enabled without a control image: add one, or untick Enable")
        try:
            module = check_module(form["module"] or "none", settings.controlnet_preprocessor_dir).name
            have = model_names(settings.controlnet_dir)
            if form["model"] not in (None, NO_MODEL) and bare_name(form["model"]) not in have:
                raise ValueError(f"model {form['model']!r} is not in models/ControlNet/ (have: "
                                 f"{', '.join(have) or 'none'})")
            units.append(ControlUnit(
                model=bare_name(form["model"] or NO_MODEL), image=image, module=module, weight=float(form["weight"]),
                guidance_start=float(form["guidance_start"]), guidance_end=float(form["guidance_end"]),
                control_mode=form["control_mode"], resize_mode=form["resize_mode"],
                pixel_perfect=bool(form["pixel_perfect"]), processor_res=int(form["processor_res"]),
                threshold_a=float(form["threshold_a"]), threshold_b=float(form["threshold_b"])))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    return tuple(units)


def _unit_from_infotext(text: str, index: int, notes: list[str], models: list[str],
                        modules: list[str]) -> dict[str, object]:
    """One `ControlNet N` entry's settings as form fields (`cnN_…`); unreadable parts, and a model or module
    this app does not have (`models`, `modules`), are named in `notes` and left as they were."""
    fields: dict[str, object] = {f"cn{index}_enabled": True}
    for part in text.split(", "):
        key, sep, value = part.partition(": ")
        field = INFOTEXT_KEYS.get(key.strip())
        if not sep or field is None:
            continue
        value = value.strip()
        if field in NUMBERS:
            try:
                fields[f"cn{index}_{field}"] = float(value)
            except ValueError:
                notes.append(f"ControlNet {index} {key} {value!r} is not a number; left as it was")
        elif field == "pixel_perfect":
            fields[f"cn{index}_{field}"] = value.lower() == "true"
        else:
            value = bare_name(value) if field == "model" else value
            allowed = {"model": models, "module": modules, "control_mode": CONTROL_MODES, "resize_mode": RESIZE_MODES}
            if value in allowed[field]:
                fields[f"cn{index}_{field}"] = value
            else:
                notes.append(f"ControlNet {index}: {field} {value!r} is not available here; left as it was")
    return fields


def fields_from_infotext(settings: dict[str, str], notes: list[str], app_settings: Settings) -> dict[str, object]:
    """The units' settings an infotext's `ControlNet 0…2` entries give (the extension's format); units it names
    none of are switched off, so the sent settings make the same image. Pictures are not carried."""
    fields: dict[str, object] = {f"cn{i}_enabled": False for i in range(MAX_UNITS)}
    models, modules = model_names(app_settings.controlnet_dir), _module_choices(app_settings)[0]
    for index in range(MAX_UNITS):
        if f"ControlNet {index}" in settings:
            fields |= _unit_from_infotext(settings[f"ControlNet {index}"], index, notes, models, modules)
    if any(key.startswith("ControlNet ") and key.removeprefix("ControlNet ").isdigit()
           and int(key.removeprefix("ControlNet ")) >= MAX_UNITS for key in settings):
        notes.append(f"only the first {MAX_UNITS} ControlNet units were filled in")
    return fields
