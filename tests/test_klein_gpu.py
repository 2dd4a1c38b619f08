"""`-m gpu`: the full-size FLUX.2 Klein 4B architecture (random weights, bf16, 1024², 4 steps) through our
pipeline beside diffusers' `Flux2KleinPipeline` on the same components in the same run: the same latents,
ours at least as fast with no more VRAM; each offload mode's it/s and peak VRAM printed. The device
check's Klein section measures the same engine-level in ABBA rounds, with fp8 storage and 3 LoRAs
(`benchmarks/devicecheck.py`, `--families flux2-klein-4b`).

    python -m pytest -o addopts=-ra -m gpu tests/test_klein_gpu.py -s
"""

from __future__ import annotations

import time

import pytest
import torch

from app.engine import offload, placement
from app.families import family
from app.hooks import HookRegistry

FAMILY, STEPS, SIDE = "flux2-klein-4b", 4, 1024


def _full_size_pipeline():
    """diffusers' pipeline, every component from the bundled full-size configs, random weights, bf16 on the GPU."""
    import diffusers
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fam = family(FAMILY)
    folder = fam.files.config_dir
    with torch.device("cuda"):
        parts = dict(transformer=Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(
                         folder / "transformer")),
                     vae=AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(folder / "vae")),
                     text_encoder=Qwen3ForCausalLM(Qwen3Config.from_pretrained(folder / "text_encoder")))
    parts = {k: v.to(torch.bfloat16).eval() for k, v in parts.items()}
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    pipe = Flux2KleinPipeline(scheduler=scheduler, **parts, **fam.tokenizers(), is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe) -> tuple[float, float, torch.Tensor]:
    """(it/s, peak GiB, latents) of one generation."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        latents = pipe(prompt="a lighthouse at dusk", num_inference_steps=STEPS, height=SIDE, width=SIDE,
                       output_type="latent", generator=[torch.Generator("cpu").manual_seed(0)]).images
    torch.cuda.synchronize()
    return STEPS / (time.perf_counter() - start), torch.cuda.max_memory_allocated() / 2**30, latents.float()


@pytest.mark.gpu
@pytest.mark.gpu_long  # the device check's Klein section measures the same (benchmarks/devicecheck.py)
@pytest.mark.timeout(1800)
def test_klein_4b_full_size_ours_vs_flux2_klein_pipeline():
    from app.families.klein import SteadyKleinPipeline

    theirs = _full_size_pipeline()
    _run(theirs)  # warm-up
    baseline, their_peak, their_latents = _run(theirs)
    ours = SteadyKleinPipeline(**theirs.components, is_distilled=True)
    ours.family, ours.execution_device = family(FAMILY), torch.device("cuda", 0)
    _run(ours)
    mine, my_peak, my_latents = _run(ours)
    print(f"{FAMILY} 1024² bf16 {STEPS} steps: ours {mine:.3f} it/s {my_peak:.2f} GiB, "
          f"Flux2KleinPipeline {baseline:.3f} it/s {their_peak:.2f} GiB")
    assert torch.equal(my_latents, their_latents)  # the same components, the same call: the same latents
    assert mine >= 0.97 * baseline and my_peak <= their_peak * 1.01
    rows, hooks = [], HookRegistry()
    for mode in offload.MODES:
        plan = offload.plan_for(ours, torch.bfloat16, torch.device("cuda", 0), mode)
        placement.apply_plan(ours, plan, reason="bench")
        strategy = offload.make_strategy(ours, plan, hooks, None, 0.85)
        strategy.install()
        its, peak, latents = _run(ours)
        assert torch.isfinite(latents).all(), mode
        rows.append((mode, its, peak))
        strategy.settle()
        strategy.remove()
    for mode, its, peak in rows:
        print(f"  ours {mode:10} {its:7.3f} it/s  peak {peak:6.2f} GiB")
