"""ControlNets on an SD UNet (SD1.5, SDXL): the stack that runs a generation's units, the family kit's parts.

Control modes, as sd-webui-controlnet runs them (its `soft_injection` / `cfg_injection` per unit):

* "Balanced": each ControlNet's residuals times the unit's weight (diffusers' `controlnet_conditioning_scale`);
* "My prompt is more important": the extension's soft injection — residual i of n (the down residuals, then
  the middle one) is also scaled by 0.825^(12 − i), the extension's formula for SD's 13 residuals (SDXL's 10
  take the first 10 factors, as the extension's `zip` does), on both halves of the CFG batch;
* "ControlNet is more important": diffusers' `guess_mode` for that unit — residuals scaled by
  `logspace(-1, 0, n)` (≈ the extension's 0.825^(12 − i)) and added to the conditional half of the CFG batch
  only (the extension's `cfg_injection`), so the unconditional pass runs without the control. diffusers
  feeds the ControlNet the conditional half alone; we run it on the whole batch and zero the other half's
  residuals, so the result equals diffusers' within CPU batch-size rounding (same math, another batch shape).

Why one stack per generation rather than diffusers' single/multi switch: a unit is a unit whatever their
number, the pipeline always takes the multi path (bit-identical to the single one for one net), and per-unit
modes need a forward of our own.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch
from diffusers import ControlNetModel
from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

from app.controlnet.units import CONTROL_MODES

BALANCED, PROMPT_FIRST, CONTROL_FIRST = CONTROL_MODES
SOFT_BASE, SOFT_TOP = 0.825, 12  # the extension's soft-injection factor 0.825^(12 - i)


class ControlNetStack(MultiControlNetModel):
    """The ControlNets of one generation's units as one module (one entry per unit, in unit order; two units
    naming one model share it). `arm` states each unit's control mode and whether the batch is CFG-doubled
    (unconditional half first, as diffusers' SD pipelines build it) before a call."""

    def __init__(self, controlnets) -> None:
        super().__init__(list(controlnets))
        self.modes: tuple[str, ...] = ()
        self.cfg_halves = False

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale, class_labels=None,
                timestep_cond=None, attention_mask=None, added_cond_kwargs=None, cross_attention_kwargs=None,
                guess_mode: bool = False, return_dict: bool = True):
        down_total, mid_total = None, None
        for i, (image, scale, net) in enumerate(zip(controlnet_cond, conditioning_scale, self.nets, strict=True)):
            mode = self.modes[i] if i < len(self.modes) else BALANCED
            down, mid = net(sample=sample, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                            controlnet_cond=image, conditioning_scale=scale, class_labels=class_labels,
                            timestep_cond=timestep_cond, attention_mask=attention_mask,
                            added_cond_kwargs=added_cond_kwargs, cross_attention_kwargs=cross_attention_kwargs,
                            guess_mode=guess_mode or mode == CONTROL_FIRST, return_dict=False)
            if mode == PROMPT_FIRST:
                factors = [SOFT_BASE ** float(SOFT_TOP - k) for k in range(len(down) + 1)]
                down, mid = [d * f for d, f in zip(down, factors, strict=False)], mid * factors[len(down)]
            elif mode == CONTROL_FIRST and self.cfg_halves:
                down, mid = [_conditional_half(d) for d in down], _conditional_half(mid)
            if down_total is None:  # merged as diffusers' MultiControlNetModel merges (bit-identical for one)
                down_total, mid_total = down, mid
            else:
                down_total = [prev + cur for prev, cur in zip(down_total, down, strict=True)]
                mid_total += mid
        return down_total, mid_total


def _conditional_half(residual: torch.Tensor) -> torch.Tensor:
    """The residual with its unconditional (first) half zeroed, as diffusers' guess mode concatenates it."""
    half = residual.shape[0] // 2
    return torch.cat([torch.zeros_like(residual[:half]), residual[half:]])


def arm(stack: ControlNetStack, kind: str, maps: Sequence, units: Sequence, guidance: float) -> dict:
    """The SD control pipelines' arguments for one call (see `ControlArm`): the maps as `image` (txt2img) or
    `control_image` (img2img, inpaint), one weight, start and end per unit; the stack told each unit's mode."""
    stack.modes = tuple(u.control_mode for u in units)
    stack.cfg_halves = guidance > 1.0  # diffusers' SD pipelines run CFG exactly when guidance_scale > 1
    key = "image" if kind == "txt2img" else "control_image"
    return {key: list(maps), "controlnet_conditioning_scale": [float(u.weight) for u in units],
            "control_guidance_start": [float(u.guidance_start) for u in units],
            "control_guidance_end": [float(u.guidance_end) for u in units], "guess_mode": False}


_CONTROLNET_ARGS = frozenset(inspect.signature(ControlNetModel.__init__).parameters) - {"self"}
# A small conditioning embedding for tiny models: three stride-2 steps like the real one (the VAE's factor 8)
TINY_EMBEDDING = (8, 8, 16, 16)


def controlnet_config(unet_config: Mapping[str, object], **overrides) -> dict:
    """The ControlNet config matching a UNet config (what `ControlNetModel.from_unet` copies)."""
    config = {k: v for k, v in unet_config.items() if k in _CONTROLNET_ARGS}
    config.update(overrides)
    return config


def bundled_unet_config(config_dir: Path) -> dict:
    return json.loads((config_dir / "unet" / "config.json").read_text())


def _cross_width(shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """The cross-attention input width of a ControlNet file (diffusers or LDM names)."""
    return next((shape[1] for key, shape in shapes.items() if key.endswith("attn2.to_k.weight") and len(shape) == 2),
                None)


def _is_sd_controlnet(shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """A ControlNet for an SD UNet: its hint embedding, in diffusers' or LDM names."""
    return any(k.startswith("controlnet_cond_embedding.") or k.startswith("control_model.input_hint_block.")
               or k.startswith("input_hint_block.") for k in shapes)


def matcher(text_time: bool, widths: tuple[int, ...]):
    """`ControlNetKit.matches` for an SD family: an SD ControlNet with (SDXL) or without (SD1.5) the
    text-time embedding, whose cross-attention reads one of `widths` (the text encoders' width: 768 for
    SD1.5, 2048 for SDXL, and the tiny models'). SD2's (1024) match neither: a foreign ControlNet."""
    def matches(shapes: Mapping[str, tuple[int, ...]]) -> bool:
        timed = any(k.startswith(("add_embedding.", "control_model.label_emb.", "label_emb.")) for k in shapes)
        return _is_sd_controlnet(shapes) and timed == text_time and _cross_width(shapes) in widths
    return matches


def to_ldm_controlnet(state: dict, layers_per_block: int) -> dict:
    """diffusers ControlNet names -> the LDM names of lllyasviel's files (`control_model.*`): the UNet's own
    LDM names for its blocks (`ldm_layout`), diffusers' converter table read backwards for the rest, zero
    convs and the hint embedding by their index rule. The tests' writer; the reader is diffusers' converter."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    from app.families.ldm_layout import unet_module_to_ldm

    table = dict(DIFFUSERS_TO_LDM_MAPPING["controlnet"]["layers"])
    table.update(DIFFUSERS_TO_LDM_MAPPING["controlnet"]["addition_embed_type"])
    table.update({"controlnet_mid_block.weight": "middle_block_out.0.weight",
                  "controlnet_mid_block.bias": "middle_block_out.0.bias"})
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if key in table:
            name = table[key]
        elif parts[0] == "controlnet_down_blocks":
            name = f"zero_convs.{parts[1]}.0.{parts[2]}"
        elif parts[:2] == ["controlnet_cond_embedding", "blocks"]:
            name = f"input_hint_block.{2 * int(parts[2]) + 2}.{parts[3]}"
        else:
            name = unet_module_to_ldm(key, layers_per_block)
        if name is None:
            raise KeyError(f"no LDM name for ControlNet tensor {key}")
        out["control_model." + name] = value
    return out


def sd_controlnet_kit(pipelines: Mapping[str, type], *, text_time: bool, widths: tuple[int, ...], config_dir: Path,
                      tiny_unet: Mapping[str, object], ldm_files: bool):
    """An SD family's `ControlNetKit`: diffusers' `ControlNetModel`, this module's stack and `arm`, single files
    read by diffusers' converter (LDM `control_model.*` names, or diffusers names as they are) with the family's
    UNet config or the tiny one. `ldm_files`: users' single files are in LDM names (lllyasviel's SD1.5 ones;
    SDXL's are diffusers-named, and diffusers' converter drops an LDM file's text-time embedding)."""
    from app.families import ControlNetKit

    tiny = MappingProxyType(controlnet_config(tiny_unet, conditioning_embedding_out_channels=TINY_EMBEDDING))
    return ControlNetKit(
        model_classes=(ControlNetModel,), pipelines=MappingProxyType(dict(pipelines)), stack_class=ControlNetStack,
        matches=matcher(text_time, widths),
        single_file_configs=lambda: (controlnet_config(bundled_unet_config(config_dir)), dict(tiny)),
        tiny_config=tiny, arm=arm,
        to_single_file=(lambda state, config: to_ldm_controlnet(state, int(config["layers_per_block"])))
        if ldm_files else None)
