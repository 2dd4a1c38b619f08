"""Live preview: the latent -> RGB projection, and the latents `generate.run` hands out while denoising."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.engine import generate
from app.engine.generate import GenerateParams
from app.families import FAMILIES, family
from app.preview import pictures, preview_pixels


def test_zero_latents_give_the_family_bias_as_grey():
    """A zero latent is "no signal": mid-grey for SD1.5, the bias for SDXL (its fit has one)."""
    sd15, sdxl = (pictures(preview_pixels(torch.zeros(1, 4, 3, 5), family_name))[0] for family_name in ("sd15", "sdxl"))
    assert sd15.size == (5, 3) and sd15.mode == "RGB"
    assert np.asarray(sd15)[0, 0].tolist() == [128, 128, 128]
    assert np.asarray(sdxl)[0, 0].tolist() == [141, 125, 127]  # ((0.1084, -0.0175, -0.0011) + 1) / 2 * 255


@pytest.mark.parametrize("family_name", [name for name, fam in FAMILIES.items() if fam.latent_format.preview_rgb])
def test_each_channel_moves_the_colour_by_its_factors(family_name):
    """Pixel (0, c) has latent channel c at 1.0, the rest 0: its colour is bias + that row, scaled
    from [-1, 1] to [0, 255]; batch items come out separately and bf16 input gives the same."""
    factors, bias = family(family_name).latent_format.preview_rgb
    channels = len(factors)
    latents = torch.zeros(2, channels, 1, channels)
    for channel in range(channels):
        latents[0, channel, 0, channel] = 1.0
    first, second = pictures(preview_pixels(latents.to(torch.bfloat16), family_name))
    expected = [[round((min(max(b + f, -1), 1) + 1) / 2 * 255) for f, b in zip(row, bias, strict=True)]
                for row in factors]
    assert np.abs(np.asarray(first)[0].astype(int) - np.array(expected)).max() <= 1
    flat = np.asarray(second)
    assert (flat == flat[0, 0]).all()  # the all-zero second latent is one flat colour


def test_wrong_shapes_and_families_are_refused():
    with pytest.raises(ValueError, match="expected latents shaped"):
        preview_pixels(torch.zeros(1, 16, 8, 8), "sd15")
    with pytest.raises(ValueError, match="unknown model family 'flux'"):
        preview_pixels(torch.zeros(1, 4, 8, 8), "flux")


def test_the_step_callback_sees_the_latents_without_changing_the_image(engine):
    """`on_step` sees the (batch, 4, h/8, w/8) latents after every step (the live preview projects
    them), and reading them leaves the result bit-identical."""
    engine.load_model("tiny-sd15.safetensors")
    params = GenerateParams("a red cube", steps=5, width=64, height=64, cfg=5.0, sampler="Euler", seed=3)
    plain = generate.run(engine.pipeline, params, 3)
    seen = []

    def collect(step, total, latents):
        seen.append((step, total, tuple(latents.shape), pictures(preview_pixels(latents, "sd15"))[0].size))
        return False

    watched = generate.run(engine.pipeline, params, 3, on_step=collect)
    assert seen == [(step, 5, (1, 4, 8, 8), (8, 8)) for step in range(1, 6)]
    assert np.array_equal(np.asarray(plain[0]), np.asarray(watched[0]))


def test_a_preview_is_shown_one_step_after_it_is_taken(data_dir, monkeypatch):
    """With a preview every 2 steps of 6, the previews of steps 2 and 4 are published at steps 3 and 5,
    labelled 2 and 4: each is read on the host a step later (`HostRead`), so on a GPU it waits for its
    own step's work alone; read at once it drained the queue. The picture published is the one of the
    step it is labelled with (the latents the callback saw then)."""
    from app.engine.worker import Engine
    from app.settings import Settings

    engine = Engine(Settings(data_dir=data_dir, device="cpu", preview_every=2))
    try:
        engine.load_model("tiny-sd15.safetensors")
        published, seen = [], {}
        set_progress, denoise = engine._set_progress, generate.denoise

        def record(phase, step, total, preview=None, preview_step=None):
            if preview is not None:
                published.append((step, preview_step, [np.asarray(p) for p in preview]))
            set_progress(phase, step, total, preview, preview_step)

        def watched(pipe, params, seed, on_step, *args, **kwargs):
            def spy(step, total, latents):
                seen[step] = [np.asarray(p) for p in pictures(preview_pixels(latents, "sd15"))]
                return on_step(step, total, latents)
            return denoise(pipe, params, seed, spy, *args, **kwargs)

        monkeypatch.setattr(engine, "_set_progress", record)
        monkeypatch.setattr(generate, "denoise", watched)
        engine.generate(GenerateParams("a red cube", steps=6, width=64, height=64, cfg=5.0, sampler="Euler", seed=3))
        assert [(step, of) for step, of, _frames in published] == [(3, 2), (5, 4)]
        for _step, of, frames in published:
            assert all(np.array_equal(a, b) for a, b in zip(frames, seen[of], strict=True)), of
    finally:
        engine.close()
