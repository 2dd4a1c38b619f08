"""What Qwen-Image (1.0) and Qwen-Image 2.1 state alike (`qwen_image1.py`, `qwen_image.py`).

Why one module: both pipelines run true CFG under diffusers' name `true_cfg_scale` (A1111's CFG: no unconditional
pass at 1 or below) and warn at every call where a negative prompt is handed over without it; both make 1024²
images, where a demo-size model makes the demo's side. Neither family's files import the other's, so each can be
taken out alone (tests/families/test_isolation.py).
"""

from __future__ import annotations

import dataclasses

from app.families import DEMO_SIDE
from app.families.flow_dit import FLOW_SAMPLING

# Flow Euler and its kin; the CFG field is the pipelines' `true_cfg_scale`.
QWEN_SAMPLING = dataclasses.replace(FLOW_SAMPLING, guidance_call=lambda cfg: {"true_cfg_scale": cfg})


def native_size(pipe) -> int:
    """1024² as the pipelines make it; a demo-size model (under 1024 wide) the demo's side."""
    return 1024 if pipe.transformer.inner_dim >= 1024 else DEMO_SIDE


class TrueCfg:
    """Mixed into a Qwen-Image pipeline class: the negative prompt is handed over only where CFG reads it."""

    def __call__(self, *args, **kwargs):
        if kwargs.get("true_cfg_scale", 1.0) <= 1:  # no unconditional pass reads it (diffusers warns each call)
            kwargs.pop("negative_prompt", None)
        return super().__call__(*args, **kwargs)
