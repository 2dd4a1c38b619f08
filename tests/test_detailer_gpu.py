"""GPU acceptance for the detail pass (issue 39, speed): on full-size SD1.5 (random weights, fp16, CUDA), a
face pass on a 512² picture costs no more than an inpaint of the same crop size: the same number of
denoiser calls, and a wall time within 15% of the inpaint's (crop, encode and paste are the rest), both
measured warm, the median of three. The face region is the box the built-in detector finds on scikit-image's
`astronaut` at 512² (tests/test_detailer_pass.py runs the detector itself on the CPU): the device image has
neither OpenCV nor scikit-image. Strict mode: every detail stage `ok` with zero violations, every pixel
outside the blurred mask the picture's. Skipped without CUDA.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from test_gpu_sequences import full_model  # noqa: F401 - the fixture

from app.engine.detailing import DetailParams, DetailPass, crop_box, target_size
from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.settings import Settings

pytestmark = pytest.mark.gpu
PARAMS = GenerateParams("a portrait", steps=20, seed=3, width=512, height=512, sampler="Euler", cfg=7.0)
FACE = (176, 66, 274, 164)  # the astronaut's face at 512², dilated by ADetailer's default 4 px


def _timed(engine: Engine, run) -> tuple[float, int]:
    """(median wall seconds of three warm runs, denoiser calls of one)."""
    calls = []
    handle = engine.pipeline.unet.register_forward_hook(lambda *_: calls.append(1))
    try:
        run()  # warm-up (stage pipeline built, kernels chosen)
        calls.clear()
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    finally:
        handle.remove()
    return statistics.median(times), len(calls) // 3


@pytest.mark.parametrize("full_model", ["sd15"], indirect=True)
def test_a_face_pass_costs_no_more_than_an_inpaint_of_its_crop(full_model):  # noqa: F811
    _family_name, data_dir = full_model
    ramp = np.linspace(0, 255, 512, dtype=np.uint8)
    photo = Image.fromarray(np.stack([np.tile(ramp, (512, 1)), np.tile(ramp, (512, 1)).T,
                                      np.full((512, 512), 120, np.uint8)], axis=-1))
    face = Image.new("L", photo.size, 0)
    face.paste(255, FACE)
    unit = DetailPass("face", lambda image: ([face], ""), denoising_strength=0.4)  # ADetailer's defaults
    details = DetailParams((unit,), skip_img2img=True)
    engine = Engine(Settings(data_dir=data_dir, device="cuda", dtype="fp16", strict=True))
    try:
        engine.load_model("full-sd15")
        detailed = engine.img2img(PARAMS, [photo], details=details)[0]
        blurred = face.filter(ImageFilter.GaussianBlur(unit.mask_blur))
        outside = np.asarray(blurred) == 0
        assert np.array_equal(np.asarray(detailed.image)[outside], np.asarray(photo)[outside])
        size = target_size(crop_box(blurred, unit.padding), engine.snapshot().native_size, 8)
        crop = GenerateParams(PARAMS.prompt, steps=20, seed=3, width=size[0], height=size[1], sampler="Euler")
        mask = Image.new("L", size, 0)
        mask.paste(255, (size[0] // 4, size[1] // 4, size[0] * 3 // 4, size[1] * 3 // 4))
        pass_s, pass_calls = _timed(engine, lambda: engine.img2img(PARAMS, [photo], details=details))
        inpaint_s, inpaint_calls = _timed(engine, lambda: engine.inpaint(crop, photo.resize(size), mask,
                                                                         denoising_strength=0.4))
        print(f"detail pass {pass_s * 1000:.0f} ms ({pass_calls} denoiser calls) vs inpaint of {size[0]}x{size[1]} "
              f"{inpaint_s * 1000:.0f} ms ({inpaint_calls} calls): {pass_s / inpaint_s:.2f}x")
        assert pass_calls == inpaint_calls == int(20 * 0.4)
        assert pass_s <= 1.15 * inpaint_s
        snap = engine.snapshot()
        assert snap.violations_found_total == 0 and all(row.outcome == "ok" for row in snap.history)
    finally:
        engine.close()
