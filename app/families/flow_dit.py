"""What the flow-matching DiTs on the 16-channel FLUX autoencoder state alike (FLUX.1, Z-Image).

Why one module: FLUX.1 and Z-Image ship the very same `ae.safetensors` (83.8 M parameters, scale
0.3611, shift 0.1159) and denoise its latents in 2×2 patches with flow-match Euler, so how the VAE's
file is found and named, its tiny demo config, its live preview factors, the samplers and the
`Family` fields that follow (`DIT_SHARED`: `Family(..., **DIT_SHARED)`) are stated once. A family
lists `FLUX_VAE_PART` among its `Files.parts` and starts its tiny configs from `TINY_FLUX_VAE`.
"""

from __future__ import annotations

from types import MappingProxyType

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

from app.families import ComponentFile, LatentFormat, Sampling
from app.families.ldm_layout import vae_layout
from app.families.pipelines import declared_repeated_blocks
from app.families.tiny_parts import TINY_VAE

# In an all-in-one under `vae.` (ComfyUI/Forge) or `first_stage_model.` (LDM), or a file of its own
# in models/VAE (`ae.safetensors`).
FLUX_VAE_PART = ComponentFile("vae", "VAE (ae.safetensors)", AutoencoderKL, ("vae.", "first_stage_model.", ""),
                              "decoder.conv_in.weight", vae_layout, folder="vae_dir")
TINY_FLUX_VAE = dict(TINY_VAE, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                     use_post_quant_conv=False, force_upcast=True)
# ComfyUI's published latent-preview fit for the 16-channel Flux latents (comfy/latent_formats.py, Flux;
# ComfyUI's Z-Image model uses the same latent format)
FLUX_LATENTS = LatentFormat(preview_rgb=(
    ((-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433),
     (-0.0174, 0.0160, 0.0617), (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115),
     (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259), (-0.0245, 0.0250, 0.1180),
     (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
     (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499),
     (-0.1262, -0.0982, -0.0778)), (-0.0329, -0.0718, -0.0851)))


class AncestralFlowEuler(FlowMatchEulerDiscreteScheduler):
    """Flow-match Euler with `stochastic_sampling`: each step predicts the clean latents and re-noises them to the
    next sigma with fresh noise, the flow counterpart of A1111's "Euler a" (Forge and ComfyUI run "Euler a" so on
    these models). Why a subclass: the flow pipelines call `scheduler.step` without a generator, so diffusers would
    draw that noise from the global RNG and a seed would not give its image again; the engine hands the job's
    per-image generators over with `seed_step_noise_` before the loop."""

    _step_generators: list | None = None

    def seed_step_noise_(self, generators: list) -> None:
        self._step_generators = generators

    def step(self, *args, generator=None, **kwargs):
        return super().step(*args, generator=generator or self._step_generators, **kwargs)


# Flow-match Euler with each sigma schedule diffusers offers (the pipelines pass their own sigmas
# and time shift, which only this scheduler family takes). Every entry states all four switches: a
# sampler is built from the previous one's config, which would carry its switch over.
_PLAIN = {"use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
          "stochastic_sampling": False}
SAMPLERS = MappingProxyType({
    "Euler": (FlowMatchEulerDiscreteScheduler, _PLAIN),
    "Euler a": (AncestralFlowEuler, {**_PLAIN, "stochastic_sampling": True}),
    "Euler Karras": (FlowMatchEulerDiscreteScheduler, {**_PLAIN, "use_karras_sigmas": True}),
    "Euler exponential": (FlowMatchEulerDiscreteScheduler, {**_PLAIN, "use_exponential_sigmas": True}),
    "Euler beta": (FlowMatchEulerDiscreteScheduler, {**_PLAIN, "use_beta_sigmas": True}),
})
# A1111's other sampler names on a flow model: DDIM run deterministically on a flow model is flow Euler; the
# multistep solvers (DPM++ 2M, UniPC, PLMS) have no flow-sigma counterpart that takes these pipelines' shifted
# sigmas, so they run flow Euler on the same schedule (Karras: Euler Karras).
NEAREST_SAMPLERS = MappingProxyType({"DDIM": "Euler", "UniPC": "Euler", "PLMS": "Euler", "DPM++ 2M": "Euler",
                                     "DPM++ 2M Karras": "Euler Karras"})
# How such a DiT samples: flow Euler and its kin, A1111's other names run as their nearest
# (`dataclasses.replace(FLOW_SAMPLING, default_steps=…)`).
FLOW_SAMPLING = Sampling(default_sampler="Euler", samplers=SAMPLERS, nearest_samplers=NEAREST_SAMPLERS)
# Where such a DiT's checkpoint markers sit in a single file (`Files.marker_prefixes`): bare, or under ComfyUI's
# `model.diffusion_model.`.
DIT_PREFIXES = ("", "model.diffusion_model.")
# The `Family` fields such a DiT states alike: its transformer is the denoiser (no conv weights:
# only the VAE may rest channels_last), sizes are whole 2×2 patches of 8× latents, the native size is the VAE's
# (each DiT states
# `Precision(fp16_ok=False)`: activations overflow fp16); `--compile` compiles the blocks diffusers declares repeated.
DIT_SHARED = MappingProxyType(dict(
    size_multiple=16,
    denoiser="transformer", conv_components=("vae",),
    native_size=lambda pipe: pipe.vae.config.sample_size, compile_regions=declared_repeated_blocks))
