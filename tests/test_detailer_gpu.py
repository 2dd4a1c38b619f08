"""GPU acceptance for the detail pass (issue 39, speed): on full-size SD1.5 (random weights, fp16, CUDA), a
face pass on a 512² real photograph costs no more than an inpaint of the same crop size: the same number
of denoiser calls, and a wall time within 15% of the inpaint's (detection, crop and paste are the rest),
both measured warm, the median of three. Strict mode: every detail stage `ok` with zero violations, every
pixel outside the blurred mask the photograph's. Skipped without CUDA.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from test_gpu_sequences import full_model  # noqa: F401 - the fixture

from app.detailer import passes
from app.detailer.detect import BUILTIN_FACE, DetectorLibrary
from app.detailer.units import DetailUnit
from app.engine.detailing import crop_box, target_size
from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.settings import Settings

pytestmark = pytest.mark.gpu
PARAMS = GenerateParams("a portrait", steps=20, seed=3, width=512, height=512, sampler="Euler", cfg=7.0)


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
def test_a_face_pass_costs_no_more_than_an_inpaint_of_its_crop(full_model, tmp_path):  # noqa: F811
    skdata = pytest.importorskip("skimage.data")
    _arch, data_dir = full_model
    photo = Image.fromarray(skdata.astronaut()).resize((512, 512), Image.Resampling.LANCZOS)
    engine = Engine(Settings(data_dir=data_dir, device="cuda", dtype="fp16", strict=True))
    try:
        engine.load_model("full-sd15")
        unit = DetailUnit(BUILTIN_FACE, denoising_strength=0.4)
        details = passes.detail_params([unit], DetectorLibrary(tmp_path), skip_img2img=True)
        detailed = engine.img2img(PARAMS, [photo], details=details)[0]
        assert len(detailed.masks) == 1, detailed.notes
        blurred = detailed.masks[0].filter(ImageFilter.GaussianBlur(unit.mask_blur))
        outside = np.asarray(blurred) == 0
        assert np.array_equal(np.asarray(detailed.image)[outside], np.asarray(photo)[outside])
        size = target_size(crop_box(blurred, unit.inpaint_only_masked_padding), engine.snapshot().native_size, 8)
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
