"""Latent formats (`app.families.LatentFormat`): what the engine's own VAE encode and decode must do for a
VAE that is not an image VAE, proven before a family with one arrives.

* A video VAE (diffusers' `AutoencoderKLQwenImage`, Wan-style: (batch, channels, frames, h, w) in and out)
  decodes and encodes the engine's image-shaped latents as one frame (Qwen-Image's first family crashed
  at decode: `not enough values to unpack (expected 5, got 4)`).
* Per-channel statistics stated as the pipeline computes them: Qwen-Image's pipelines divide by the
  reciprocal of the std (`x / (1/std)`), which rounds differently from `x * std` (an image off by a grey
  level); `LatentStats.inverse_std` states that order and is bit-exact with the pipeline's own lines.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageImg2ImgPipeline, QwenImagePipeline
from diffusers.image_processor import VaeImageProcessor

from app.engine import decoding, stages
from app.families import LatentFormat, family, inverse_std_stats, vae_latent_stats

MEAN, STD = [0.1, -0.2, 0.3, 0.05], [1.7, 0.9, 2.3, 1.1]


@pytest.fixture(scope="module")
def video_pipe():
    """A stand-in pipeline holding a tiny `AutoencoderKLQwenImage` (4 latent channels, 8× down, no temporal
    downsampling), whose family states a video latent format with the reciprocal-std rule."""
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, False, False], latents_mean=MEAN, latents_std=STD).eval()
    fam = dataclasses.replace(family("sd15"), latent_format=LatentFormat(stats=inverse_std_stats, frames=True))
    return SimpleNamespace(vae=vae, family=fam, compute_dtypes={}, _execution_device=torch.device("cpu"),
                           vae_scale_factor=8, image_processor=VaeImageProcessor(vae_scale_factor=8))


def test_a_video_vae_decodes_and_encodes_image_latents_as_one_frame(video_pipe):
    """`decoding.decode` gives the pixels of the VAE's one-frame decode of the de-normalised latents, bit for
    bit; `stages.encode` gives back image-shaped (batch, channels, h, w) latents: the one frame of the VAE's
    sample, normalised as the pipeline does, bit for bit."""
    vae, stats = video_pipe.vae, inverse_std_stats(video_pipe.vae.config)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    images = decoding.decode(video_pipe, latents)
    with torch.no_grad():
        frames = vae.decode(stats.to_vae(latents).unsqueeze(2), return_dict=False)[0]
    expected = video_pipe.image_processor.postprocess(frames[:, :, 0], output_type="pil")
    assert [np.asarray(i).tolist() for i in images] == [np.asarray(i).tolist() for i in expected]
    encoded = stages.encode(video_pipe, images[:1], seed=3)
    pixels = video_pipe.image_processor.preprocess(images[0]).unsqueeze(2)
    with torch.no_grad():
        sample = vae.encode(pixels).latent_dist.sample(torch.Generator().manual_seed(3))
    assert encoded.shape == (1, 4, 8, 8) and torch.equal(encoded, stats.from_vae(sample[:, :, 0]))


def _pipeline_lines(function, first: str, last: str) -> str:
    """The lines of a diffusers function from the one starting with `first` to the one starting with `last`,
    dedented: the pipeline's own arithmetic, run here as it is written there."""
    lines = inspect.getsource(function).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
    end = next(i for i, line in enumerate(lines) if i > start and line.strip().startswith(last))
    return textwrap.dedent("\n".join(lines[start:end + 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_channel_statistics_are_the_pipelines_arithmetic_bit_for_bit(dtype):
    """Qwen-Image's decode (`QwenImagePipeline.__call__`) and encode (`QwenImageImg2ImgPipeline._encode_vae_image`)
    lines, run as diffusers writes them on the real VAE's statistics, equal `LatentStats.to_vae`/`from_vae` of the
    reciprocal-std rule bit for bit, in fp32 and bf16; the plain rule (`x * std`) does not (the grey level
    the first Qwen-Image family was off by)."""
    config = SimpleNamespace(**{k: v.default for k, v in inspect.signature(AutoencoderKLQwenImage.__init__)
                                .parameters.items() if k in ("z_dim", "latents_mean", "latents_std")})
    pipe = SimpleNamespace(vae=SimpleNamespace(config=config))
    latents = (3 * torch.randn(2, config.z_dim, 1, 16, 16, generator=torch.Generator().manual_seed(0))).to(dtype)
    decode = {"self": pipe, "torch": torch, "latents": latents}
    exec(_pipeline_lines(QwenImagePipeline.__call__, "latents_mean = (", "latents = latents / latents_std"), decode)
    encode = {"self": pipe, "torch": torch, "image_latents": latents}
    exec(_pipeline_lines(QwenImageImg2ImgPipeline._encode_vae_image, "latents_mean = (",
                         "image_latents = (image_latents - latents_mean)"), encode)
    ours = inverse_std_stats(config)
    assert torch.equal(ours.to_vae(latents[:, :, 0]), decode["latents"][:, :, 0])
    assert torch.equal(ours.from_vae(latents[:, :, 0]), encode["image_latents"][:, :, 0])
    plain = vae_latent_stats(config)
    assert not torch.equal(plain.to_vae(latents[:, :, 0]), decode["latents"][:, :, 0])
    assert not torch.equal(plain.from_vae(latents[:, :, 0]), encode["image_latents"][:, :, 0])
