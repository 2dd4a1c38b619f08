"""`-m gpu`: the full-size FLUX.1-dev architecture (random weights, bf16, 1024², 20 steps) through our
pipeline beside plain diffusers `FluxPipeline` in the same run: ours must not be slower, and each
offload mode's it/s and peak VRAM are printed beside diffusers' model/sequential offload.

    python -m pytest -o addopts=-ra -m gpu tests/test_flux_gpu.py -s
"""

from __future__ import annotations

import time

import pytest
import torch

from app.engine import offload, placement
from app.families import family
from app.hooks import HookRegistry

STEPS, SIDE = 20, 1024


def _full_size_pipeline(cls):
    """Every component from the bundled full-size configs with random weights, built on the GPU in bf16."""
    import diffusers
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    fam = family("flux-dev")
    folder = fam.files.config_dir
    with torch.device("cuda"):
        parts = dict(
            transformer=FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(folder / "transformer")),
            vae=AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae")),
            text_encoder=CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder")),
            text_encoder_2=T5EncoderModel(T5Config.from_pretrained(folder / "text_encoder_2")),
        )
    parts = {k: v.to(torch.bfloat16).eval() for k, v in parts.items()}
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    pipe = cls(scheduler=scheduler, **parts, **fam.tokenizers())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _its(pipe) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        pipe("a cat", num_inference_steps=STEPS, height=SIDE, width=SIDE, output_type="latent",
             generator=torch.Generator("cpu").manual_seed(0))
    torch.cuda.synchronize()
    return STEPS / (time.perf_counter() - start)


@pytest.mark.gpu
@pytest.mark.gpu_long  # the device check's Flux section measures the same (benchmarks/devicecheck.py)
@pytest.mark.timeout(1800)
def test_flux_full_size_ours_vs_diffusers():
    from diffusers import FluxPipeline

    from app.families.flux import SteadyFluxPipeline

    theirs = _full_size_pipeline(FluxPipeline)
    _its(theirs)  # warm-up
    baseline = _its(theirs)
    ours = SteadyFluxPipeline(**theirs.components)
    ours.family, ours.execution_device = family("flux-dev"), torch.device("cuda", 0)
    _its(ours)
    mine = _its(ours)
    print(f"flux-dev 1024² bf16 {STEPS} steps: ours {mine:.3f} it/s, diffusers {baseline:.3f} it/s")
    assert mine >= 0.97 * baseline
    rows = []
    for mode in offload.MODES:
        plan = offload.plan_for(ours, torch.bfloat16, torch.device("cuda", 0), mode)
        placement.apply_plan(ours, plan, reason="bench")
        strategy = offload.make_strategy(ours, plan, HookRegistry(), None, 0.85)
        strategy.install()
        torch.cuda.reset_peak_memory_stats()
        rows.append((mode, _its(ours), torch.cuda.max_memory_allocated() / 2**30))
        strategy.settle()
        strategy.remove()
    for mode, its, peak in rows:
        print(f"  ours {mode:10} {its:7.3f} it/s  peak {peak:6.2f} GiB")
