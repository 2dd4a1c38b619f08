"""`-m gpu`: a full-size GFPGAN (v1 clean, random weights, ~330 MiB) restoring the astronaut's face on the GPU
under every offload mode.

What it protects: the face restorer computes in bf16 on the GPU (GFPGAN declares no fp16), rests where the
mode says (CPU where weights move), no placement violation appears, only the face's square changes, and every
mode gives the same picture (±2 levels: other kernels may be picked).

    python -m pytest -o addopts=-ra -m gpu tests/test_face_restore_gpu.py -s
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from app.engine.upscaler_slot import FACE_COMPONENT
from app.engine.worker import Engine
from app.settings import OFFLOAD_CHOICES, Settings
from app.upscalers.extras import ExtrasParams

pytestmark = pytest.mark.gpu
skdata = pytest.importorskip("skimage.data")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from spandrel.architectures.GFPGAN import GFPGAN

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GFPGAN(out_size=512, num_style_feat=512, channel_multiplier=2, decoder_load_path=None,
                       fix_decoder=False, num_mlp=8, input_is_latent=True, different_w=True, narrow=1, sft_half=True)
    root = tmp_path_factory.mktemp("gpu-faces")
    (root / "models" / "GFPGAN").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(root / "models" / "GFPGAN" / "random-gfpgan.safetensors"))
    return root


@pytest.mark.timeout(900)
def test_gfpgan_on_the_astronaut_under_every_offload_mode(data_dir, record_property):
    image = Image.fromarray(skdata.astronaut())
    engine = Engine(Settings(data_dir=data_dir, device="cuda", dtype="bf16"))  # GFPGAN declares bf16, not fp16
    figures, pictures = {}, {}
    try:
        for mode in OFFLOAD_CHOICES:
            engine.set_offload(mode)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            [result] = engine.extras([image], ExtrasParams(gfpgan_visibility=1.0))
            torch.cuda.synchronize()
            figures[mode] = {"seconds": round(time.perf_counter() - started, 2),
                             "peak_vram_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}
            snap = engine.snapshot()
            assert snap.violations_found_total == 0, (mode, snap.violations)
            rows = [row for row in snap.placement if row.component == FACE_COMPONENT]
            assert rows and {row.compute for row in rows} == {"bf16"}, mode
            assert {row.device for row in rows} == ({"cuda:0"} if mode in ("none", "balanced") else {"cpu"}), mode
            pixels = np.asarray(result.image, dtype=np.int16)
            changed = np.any(pixels != np.asarray(image, dtype=np.int16), axis=2)
            ys, xs = np.nonzero(changed)
            assert 100 < xs.min() and xs.max() < 360 and ys.max() < 260, (mode, xs.min(), xs.max(), ys.max())
            pictures[mode] = pixels
    finally:
        engine.close()
    print(f"GFPGAN on the astronaut ({torch.cuda.get_device_name()}): {figures}")
    record_property("gfpgan_astronaut", figures)
    first = pictures[OFFLOAD_CHOICES[0]]
    assert {mode: int(np.abs(p - first).max()) <= 2 for mode, p in pictures.items()} == dict.fromkeys(pictures, True)
