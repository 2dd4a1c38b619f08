"""GPU acceptance for the workflows: txt2img → hires fix → img2img → inpaint on full-size SD1.5 and
SDXL architectures (random weights, the LoCon of tests/test_gpu_sequences.py), in strict mode, in
fp16 and bf16, in every offload mode and with the mode switched between workflows. What it
protects: zero placement violations and every transition `ok` on CUDA, where rest and compute
devices really differ (the VAE encoder under model/sequential/group offload, carried latents on
the GPU); the stage pipelines share every weight; one seed gives the same images in every mode
(the same per-dtype tolerance as the txt2img sequences). The GPU fuzz (tests/test_fuzz.py) runs
the stage commands too. Skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_form import WORKFLOW_CASES, skip_outside
from PIL import Image
from test_gpu_sequences import LORA, SIZE, STEPS, full_model, in_every_mode  # noqa: F401 - full_model: the fixture

from app.adapters.specs import LoraSpec
from app.engine.generate import GenerateParams
from app.engine.stage_params import HiresParams
from app.engine.worker import Engine

pytestmark = pytest.mark.gpu

PARAMS = GenerateParams("a lighthouse", steps=STEPS, seed=7, width=SIZE, height=SIZE, sampler="Euler")
HIRES = HiresParams(scale=1.5, steps=STEPS, denoising_strength=0.5, prompt=f"a lighthouse <lora:{LORA}:0.5>")


def _mask() -> Image.Image:
    mask = Image.new("L", (SIZE, SIZE), 0)
    mask.paste(255, (SIZE // 4, SIZE // 4, SIZE * 3 // 4, SIZE * 3 // 4))
    return mask


def _sequence(engine: Engine, offloads: tuple[str, str, str]) -> list[np.ndarray]:
    """hires fix (LoRA 1.0, 0.5 in the second pass) → img2img (1.1) → inpaint (no LoRA), the
    offload mode set before each workflow."""
    images = []
    engine.set_offload(offloads[0])
    engine.set_loras([LoraSpec(LORA, 1.0)])
    hires = engine.generate(PARAMS, hires=HIRES)[0].image
    images.append(hires)
    engine.set_offload(offloads[1])
    engine.set_loras([LoraSpec(LORA, 1.1)])
    images.append(engine.img2img(PARAMS, [hires], denoising_strength=0.6, resize_mode="crop and resize")[0].image)
    engine.set_offload(offloads[2])
    engine.set_loras([])
    images.append(engine.inpaint(PARAMS, images[-1], _mask(), inpainting_fill="latent noise")[0].image)
    return [np.asarray(im, dtype=np.int16) for im in images]


def _shares_weights(engine: Engine) -> bool:
    """Every stage pipeline's UNet holds the loaded UNet's tensors (data pointers), no copy."""
    pointers = {p.data_ptr() for p in engine.pipeline.unet.parameters()}
    return all({p.data_ptr() for p in stage.unet.parameters()} == pointers for stage in engine.stage_pipelines.values())


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_workflow_sequence_in_every_offload_mode(full_model, dtype):  # noqa: F811 - the fixture
    """Strict mode on CUDA: zero violations, all rows ok, stage pipelines on the loaded weights, and
    the same images in every mode (fp16 0.3, bf16 1.5 grey levels mean, as for txt2img)."""
    family_name, data_dir = full_model
    skip_outside(WORKFLOW_CASES, pytest, family_name, dtype)
    runs, snap, shared = in_every_mode(data_dir, family_name, dtype, _sequence,
                                       {"switching": ("sequential", "group", "balanced")}, _shares_weights)
    assert snap.last_error is None and snap.violations_found_total == 0
    assert all(row.outcome == "ok" for row in snap.history)
    assert shared and {"hires upscale", "img2img encode", "inpaint encode"} <= {r.command for r in snap.history}
    tolerance = 0.3 if dtype == "fp16" else 1.5
    for name, images in runs.items():
        for stage, (image, expected) in enumerate(zip(images, runs["none"], strict=True)):
            diff = np.abs(image - expected).mean()
            assert diff <= tolerance, f"{family_name} {dtype} {name}, stage {stage}: mean difference {diff:.3f}"
