"""The Detailer accordion (ADetailer's tabs) on the Generate and img2img tabs, and its mask previews.

Ticked, a generation runs the engine's detail passes after its own (`Engine.generate(…, details=…)`;
img2img: after the img2img pass, or instead of it with "skip img2img"): each unit detects regions with
its model, redraws them at their own resolution with its prompt, and pastes them back through the
blurred mask. The fields are ADetailer's, by its names and defaults (`app.detailer.units.DetailUnit`);
a unit is checked by the same code as the API's `alwayson_scripts.ADetailer`, so both refuse the same
values with the same message. "Show mask previews" (ADetailer's "save mask previews") adds, after the
images, each redrawn region's mask laid over its picture in red. Send-to fills the panel from the
`ADetailer …` keys of an infotext (`fields_from_infotext`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import gradio as gr
from PIL import Image

from app.detailer import passes, units
from app.detailer.detect import BUILTIN_FACE, DetectorLibrary
from app.engine.detailing import DetailParams
from app.engine.generate import GeneratedImage
from app.ui.common import UiContext

# The fields of a unit the panel shows, in its order (ADetailer's tabs: detection, mask, inpainting).
UNIT_FIELDS = ("model", "prompt", "negative_prompt", "confidence", "mask_k", "mask_min_ratio", "mask_max_ratio",
               "x_offset", "y_offset", "dilate_erode", "mask_merge_invert", "mask_blur", "denoising_strength",
               "inpaint_only_masked", "inpaint_only_masked_padding", "use_inpaint_width_height", "inpaint_width",
               "inpaint_height", "use_steps", "steps", "use_cfg_scale", "cfg_scale")
_DEFAULTS = {f.name: f.default for f in fields(units.DetailUnit) if f.name != "model"}
_LABELS = {"mask_k": "Top k masks (0: all)", "mask_min_ratio": "Mask min area ratio",
           "mask_max_ratio": "Mask max area ratio", "x_offset": "Mask x offset", "y_offset": "Mask y offset (up)",
           "dilate_erode": "Dilate (+) / erode (−) px", "mask_blur": "Mask blur",
           "denoising_strength": "Denoising strength", "inpaint_only_masked_padding": "Padding px",
           "inpaint_width": "Width", "inpaint_height": "Height", "steps": "Steps", "cfg_scale": "CFG scale",
           "confidence": "Detection confidence"}
MASK_TINT = (255, 40, 40)


@dataclass
class DetailerPanel:
    """The accordion's components: the switches, then each unit's fields in `UNIT_FIELDS` order (`inputs`)."""

    enabled: gr.Checkbox
    skip_img2img: gr.Checkbox
    show_masks: gr.Checkbox
    unit_fields: list[dict[str, gr.components.Component]]

    @property
    def inputs(self) -> list:
        return [self.enabled, self.skip_img2img, self.show_masks,
                *(unit[name] for unit in self.unit_fields for name in UNIT_FIELDS)]

    @property
    def send_fields(self) -> dict[str, gr.components.Component]:
        """The components Send-to fills, by the names `fields_from_infotext` gives."""
        named = {"ad_enable": self.enabled}
        for index, unit in enumerate(self.unit_fields):
            named |= {f"ad_{index}_{name}": component for name, component in unit.items()}
        return named


def _unit_fields(index: int, models: list[str], prefix: str) -> dict[str, gr.components.Component]:
    """One ADetailer tab: the detector, the prompts, then the detection, mask and inpainting settings."""
    def number(name: str, step: float = 1) -> gr.Number:
        return gr.Number(_DEFAULTS[name], label=_LABELS[name], step=step, elem_id=f"{prefix}-{index}-{name}")

    def tick(name: str, label: str) -> gr.Checkbox:
        return gr.Checkbox(_DEFAULTS[name], label=label, elem_id=f"{prefix}-{index}-{name}")

    out: dict[str, gr.components.Component] = {}
    out["model"] = gr.Dropdown([units.NO_MODEL, *models], value=BUILTIN_FACE if index == 0 else units.NO_MODEL,
                               label="Detector", elem_id=f"{prefix}-{index}-model",
                               info="models/adetailer: .onnx YOLO exports; the built-in face detector needs none")
    out["prompt"] = gr.Textbox(label="Detail prompt (empty: the prompt; [SEP] per region, [PROMPT] inserts it)",
                               elem_id=f"{prefix}-{index}-prompt")
    out["negative_prompt"] = gr.Textbox(label="Detail negative prompt (empty: the negative prompt)",
                                        elem_id=f"{prefix}-{index}-negative_prompt")
    with gr.Row():
        out |= {name: number(name, 0.05) for name in ("confidence", "mask_min_ratio", "mask_max_ratio")}
        out["mask_k"] = number("mask_k")
    with gr.Row():
        out |= {name: number(name) for name in ("x_offset", "y_offset", "dilate_erode")}
        out["mask_merge_invert"] = gr.Radio(list(units.MERGE_INVERT), value=_DEFAULTS["mask_merge_invert"],
                                            label="Merge / invert", elem_id=f"{prefix}-{index}-mask_merge_invert")
    with gr.Row():
        out["mask_blur"], out["denoising_strength"] = number("mask_blur"), number("denoising_strength", 0.05)
        out["inpaint_only_masked"] = tick("inpaint_only_masked", "Inpaint only masked")
        out["inpaint_only_masked_padding"] = number("inpaint_only_masked_padding")
    with gr.Row():
        out["use_inpaint_width_height"] = tick("use_inpaint_width_height", "Own width/height")
        out["inpaint_width"], out["inpaint_height"] = number("inpaint_width", 8), number("inpaint_height", 8)
    with gr.Row():
        out["use_steps"], out["steps"] = tick("use_steps", "Own steps"), number("steps")
        out["use_cfg_scale"], out["cfg_scale"] = tick("use_cfg_scale", "Own CFG"), number("cfg_scale", 0.5)
    return out


def build_detailer_panel(ctx: UiContext, prefix: str, skip_option: bool) -> DetailerPanel:
    """The accordion (closed), with `units.MAX_UNITS` unit tabs; `skip_option`: the img2img tab's "skip
    img2img" switch is shown (on the Generate tab there is no img2img pass to skip)."""
    models = DetectorLibrary(ctx.settings.adetailer_dir).names()
    with gr.Accordion("Detailer (ADetailer)", open=False, elem_id=prefix):
        with gr.Row():
            enabled = gr.Checkbox(False, label="Enable Detailer", elem_id=f"{prefix}-enable",
                                  info="find faces (or what the detector finds) and redraw them at their own size")
            skip = gr.Checkbox(False, label="Skip img2img", visible=skip_option, elem_id=f"{prefix}-skip",
                               info="detail the init image as it is, with no img2img pass")
            show = gr.Checkbox(False, label="Show mask previews", elem_id=f"{prefix}-show-masks")
        unit_fields = []
        with gr.Tabs():
            for index in range(units.MAX_UNITS):
                with gr.Tab(f"{units.ordinal(index + 1)} unit", id=f"{prefix}-tab-{index}"):
                    unit_fields.append(_unit_fields(index, models, prefix))
    return DetailerPanel(enabled, skip, show, unit_fields)


def details_from_form(ctx: UiContext, enabled, skip_img2img, _show, *values) -> DetailParams | None:
    """None unless ticked; the units whose detector is not "None", checked as the API checks them."""
    if not enabled:
        return None
    count = len(UNIT_FIELDS)
    chosen = []
    for index in range(units.MAX_UNITS):
        row = dict(zip(UNIT_FIELDS, values[index * count:(index + 1) * count], strict=True))
        try:
            unit = units.from_a1111({f"ad_{name}": value for name, value in row.items() if value is not None})
        except ValueError as err:
            raise ValueError(f"Detailer {units.ordinal(index + 1)} unit: {err}") from None
        if unit is not None:
            chosen.append(unit)
    if not chosen:
        raise ValueError("the Detailer is enabled but every unit's detector is None: pick a detector or untick it")
    return passes.detail_params(chosen, DetectorLibrary(ctx.settings.adetailer_dir), bool(skip_img2img))


def mask_previews(images: list[GeneratedImage]) -> list[tuple[Image.Image, str]]:
    """Each region mask a detail pass redrew, over its picture in red at half strength, captioned."""
    shown = []
    for number, image in enumerate(images, 1):
        for region, mask in enumerate(image.masks, 1):
            grey = mask.convert("L").resize(image.image.size).point(lambda v: v // 2)
            tinted = Image.composite(Image.new("RGB", image.image.size, MASK_TINT), image.image.convert("RGB"), grey)
            shown.append((tinted, f"detailer mask {region} · image {number}"))
    return shown


def notes_of(images: list[GeneratedImage]) -> list[str]:
    return list(dict.fromkeys(note for image in images for note in image.notes))


def fields_from_infotext(settings: dict[str, str], notes: list[str]) -> dict[str, object]:
    """The panel values an infotext's `ADetailer …` keys give, for Send-to (none: the Detailer off, its
    units left as they were), so the sent settings make the same image."""
    try:
        found = units.units_from_infotext(settings)
    except ValueError as err:
        notes.append(f"the ADetailer settings could not be read ({err}); the Detailer was left as it was")
        return {}
    values: dict[str, object] = {"ad_enable": bool(found)}
    if not found:
        return values
    for index in range(units.MAX_UNITS):
        unit = found[index] if index < len(found) else None
        for name in UNIT_FIELDS:
            default = units.NO_MODEL if name == "model" else _DEFAULTS[name]
            values[f"ad_{index}_{name}"] = default if unit is None else getattr(unit, name)
    return values
