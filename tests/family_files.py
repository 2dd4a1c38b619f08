"""What a family's own test file (tests/test_klein.py, tests/test_qwen_image.py) builds alike: its module-scoped
fixtures (`data`: the demo's files of the module's `ARCH` on hard links; `eng`: a strict CPU engine on them;
`oracle`: diffusers' own pipeline on the same weights), the tiny single file's tensors and configs, ComfyUI's
separate files (fp8 with `weight_scale` for the transformer), LoRA factors, reference pictures, and the
fp32-LoRA-on-bf16/fp8 check. A test module imports the fixtures by name and states `ARCH`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from app.adapters.specs import LoraSpec
from app.adapters.synthetic import adapter_state_digests
from app.demo import build_tiny_pipeline
from app.engine.component_files import CONFIGS_METADATA_KEY
from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.settings import Settings


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory, request) -> Path:
    """A data folder holding hard links to the session demo's checkpoints and LoRAs of the module's `ARCH`."""
    arch = request.module.ARCH
    root = tmp_path_factory.mktemp(arch)
    for sub in ("models/Stable-diffusion", "models/Lora"):
        (root / sub).mkdir(parents=True)
        for path in (demo_dir / sub).glob(f"*{arch}*"):
            (shutil.copytree(path, root / sub / path.name, copy_function=os.link) if path.is_dir()
             else os.link(path, root / sub / path.name))
    return root


@pytest.fixture(scope="module")
def eng(data):
    engine = Engine(Settings(data_dir=data, device="cpu", strict_forwards=True))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def oracle(request):
    """diffusers' own pipeline on the demo's weights (the demo builds them from seed 0)."""
    pipe = build_tiny_pipeline(request.module.ARCH)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def params(**changes) -> GenerateParams:
    """The tiny models' job: "a red cube", 2 Euler steps at 64², seed 7, CFG 1, with `changes`."""
    return GenerateParams("a red cube", **{"steps": 2, "width": 64, "height": 64, "seed": 7, "sampler": "Euler",
                                           "cfg": 1.0, **changes})


def ours(images) -> np.ndarray:
    return np.stack([np.asarray(i.image) for i in images])


def references() -> list[Image.Image]:
    """Two pictures of other sizes than the output, as users send them: a colour ramp and a flat colour."""
    ramp = np.linspace(0, 255, 64 * 96, dtype=np.float32).reshape(64, 96)
    return [Image.fromarray(np.stack([ramp, ramp[::-1], 255 - ramp], -1).astype(np.uint8)),
            Image.new("RGB", (64, 64), (200, 40, 90))]


def all_in_one(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A demo single file's tensors and its embedded component configs."""
    with safe_open(str(path), "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, json.loads(handle.metadata()[CONFIGS_METADATA_KEY])


def load_separate_files(eng, oracle, checkpoint: Path, pieces: dict[str, tuple[str, str]], name: str) -> dict:
    """What a ComfyUI user has, from a demo single file: each of `pieces` (file name -> (its prefix in the single
    file, component); the text encoder's file in models/text_encoder, the VAE's in models/VAE) written bare, and
    the transformer (under `model.diffusion_model.`) written bare as checkpoint `name`, every 2-D weight in fp8
    e4m3 with its per-tensor `weight_scale`. Loads `name`: the encoder and the VAE equal the oracle's bit for
    bit. Returns the transformer file's tensors."""
    settings = eng.settings
    tensors, configs = all_in_one(checkpoint)
    for file, (prefix, component) in pieces.items():
        path = (settings.vae_dir if component == "vae" else settings.text_encoder_dir) / file
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}, str(path),
                  metadata={CONFIGS_METADATA_KEY: json.dumps({component: configs[component]})})
    fp8 = {}
    for key, tensor in tensors.items():
        if not key.startswith("model.diffusion_model."):
            continue
        key = key.removeprefix("model.diffusion_model.")
        if key.endswith(".weight") and tensor.dim() == 2:
            scale = tensor.abs().max() / 448
            fp8[key], fp8[key + "_scale"] = (tensor / scale).to(torch.float8_e4m3fn), scale.reshape(())
        else:
            fp8[key] = tensor
    save_file(fp8, str(checkpoint.parent / name), metadata={CONFIGS_METADATA_KEY: json.dumps(
        {"transformer": configs["transformer"]})})
    eng.load_model(name)
    for component in ("text_encoder", "vae"):
        mine, reference = getattr(eng.pipeline, component).state_dict(), getattr(oracle, component).state_dict()
        assert all(torch.equal(mine[k], reference[k]) for k in reference), component
    return fp8


def lora_factors(out_features: int, in_features: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(down, up) LoRA factors of a weight's order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, in_features, generator=g) * 0.1, torch.randn(out_features, rank, generator=g) * 0.1


def fp32_lora_generates(data: Path, checkpoint: str, lora: str, params, weights: str) -> None:
    """An fp32 LoRA file `lora` on `checkpoint` computing in bf16 (weights bf16, or fp8 with bypass forwards)
    generates with no dtype error, changes the image, zero violations, and comes off leaving the stored bytes."""
    engine = Engine(Settings(data_dir=data, device="cpu", dtype="bf16", weights=weights, strict_forwards=True))
    try:
        engine.load_model(checkpoint)
        digests, plain = adapter_state_digests(engine.pipeline), ours(engine.generate(params))
        engine.set_loras([LoraSpec(lora, 1.0)])
        assert not np.array_equal(ours(engine.generate(params)), plain)
        assert engine.snapshot().violations_found_total == 0
        engine.set_loras([])
        assert adapter_state_digests(engine.pipeline) == digests
    finally:
        engine.close()
