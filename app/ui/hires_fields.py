"""A1111's "Hires. fix" on the Generate tab: a checkbox that opens the second pass's fields.

Ticked, Generate runs the engine's hires fix (`Engine.generate(params, hires=…)`: the txt2img pass,
the upscale, the img2img pass, each a transition of its own) with the same previews, Interrupt
and Skip as a plain generation. The numbers are checked by the workflow rules
(`stage_params.STAGE_LIMITS`), as the named API's `/txt2img_hires` checks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app.engine.generate import SCHEDULERS
from app.engine.stage_params import SAME, STAGE_LIMITS, HiresParams, stage_values
from app.ui.common import UiContext

HIRES_NUMBERS = ("hires_scale", "hires_steps", "denoising_strength")


@dataclass
class HiresFields:
    """The checkbox and the fields it shows, in `hires_from_form` order (`inputs`)."""

    enabled: gr.Checkbox
    upscaler: gr.Dropdown
    steps: gr.Number
    strength: gr.Number
    scale: gr.Number
    sampler: gr.Dropdown
    prompt: gr.Textbox
    negative: gr.Textbox

    @property
    def inputs(self) -> list:
        return [self.enabled, self.scale, self.upscaler, self.steps, self.strength, self.sampler, self.prompt,
                self.negative]


def hires_params(stage: dict, upscaler, sampler, prompt, negative) -> HiresParams:
    """The engine's hires settings from checked numbers (`stage`) and the other fields as sent."""
    return HiresParams(stage["hires_scale"], str(upscaler), stage["hires_steps"], stage["denoising_strength"],
                       str(sampler or SAME), str(prompt or ""), str(negative or ""))


def hires_from_form(enabled, scale, upscaler, steps, strength, sampler, prompt, negative) -> HiresParams | None:
    """None unless ticked; a number out of its range is refused (ValueError) with the range."""
    if not enabled:
        return None
    stage = stage_values({"hires_scale": scale, "hires_steps": steps, "denoising_strength": strength}, HIRES_NUMBERS)
    return hires_params(stage, upscaler, sampler, prompt, negative)


def _number(field: str, label: str, value: float, step: float) -> gr.Number:
    return gr.Number(value, label=label, step=step, info=str(STAGE_LIMITS[field]), elem_id=f"sd-hires-{field}")


def build_hires_fields(ctx: UiContext) -> HiresFields:
    """The checkbox, and under it (shown while ticked) A1111's hires fields in its order; the upscalers
    are the latent and pixel resamplers and the upscaler model files the engine finds."""
    enabled = gr.Checkbox(False, label="Hires. fix", elem_id="sd-hires",
                          info="upscale the first pass and denoise it again (A1111's hires fix)")
    with gr.Group(visible=False, elem_id="sd-hires-fields") as group:
        with gr.Row():
            upscaler = gr.Dropdown(ctx.engine.hires_upscalers(), value="Latent", label="Upscaler",
                                   elem_id="sd-hires-upscaler")
            steps = _number("hires_steps", "Hires steps (0: same)", 0, 1)
            strength = _number("denoising_strength", "Denoising strength", 0.7, 0.05)
            scale = _number("hires_scale", "Upscale by", 2.0, 0.25)
        sampler = gr.Dropdown([SAME, *SCHEDULERS], value=SAME, label="Hires sampler", elem_id="sd-hires-sampler")
        prompt = gr.Textbox(label="Hires prompt (empty: the prompt; its <lora:…> tags set this pass's LoRAs)",
                            elem_id="sd-hires-prompt")
        negative = gr.Textbox(label="Hires negative prompt (empty: the negative prompt)", elem_id="sd-hires-negative")
    enabled.change(lambda on: gr.Group(visible=bool(on)), enabled, group, api_visibility="private",
                   show_progress="hidden")
    return HiresFields(enabled, upscaler, steps, strength, scale, sampler, prompt, negative)
