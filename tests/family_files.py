"""What a family's own test file (tests/test_klein.py, tests/test_qwen_image.py) builds alike: its module-scoped
fixtures (`data`: the demo's files of the module's `FAMILY` on hard links; `eng`: a strict CPU engine on them;
`oracle`: diffusers' own pipeline on the same weights), the tiny single file's tensors and configs, ComfyUI's
separate files (fp8 with `weight_scale` for the transformer), LoRA factors and the float64 fuse check, reference
pictures, and the fp32-LoRA-on-bf16/fp8 check. A test module imports the fixtures by name and states `FAMILY`."""

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
    """A data folder holding hard links to the session demo's checkpoints and LoRAs of the module's `FAMILY`."""
    family_name = request.module.FAMILY
    root = tmp_path_factory.mktemp(family_name)
    for sub in ("models/Stable-diffusion", "models/Lora"):
        (root / sub).mkdir(parents=True)
        for path in (demo_dir / sub).glob(f"*{family_name}*"):
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
    pipe = build_tiny_pipeline(request.module.FAMILY)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def params(**changes) -> GenerateParams:
    """The tiny models' job: "a red cube", 2 Euler steps at 64², seed 7, CFG 1, with `changes`."""
    return GenerateParams("a red cube", **{"steps": 2, "width": 64, "height": 64, "seed": 7, "sampler": "Euler",
                                           "cfg": 1.0, **changes})


def ours(images) -> np.ndarray:
    return np.stack([np.asarray(i.image) for i in images])


def equals_oracle_without_and_with_cfg(eng, oracle, theirs, file: str, folder: str) -> None:
    """`file` at CFG 1 and `folder` at CFG 3 with a negative prompt, batch 2, give `theirs(oracle, params)`'s
    pixels exactly; the negative prompt changes the image."""
    eng.load_model(file)
    assert np.array_equal(ours(eng.generate(params())), theirs(oracle, params()))
    eng.load_model(folder)
    cfg = params(cfg=3.0, negative_prompt="blurry", batch=2)
    made = ours(eng.generate(cfg))
    assert np.array_equal(made, theirs(oracle, cfg))
    assert not np.array_equal(made, ours(eng.generate(params(cfg=3.0, negative_prompt="sharp", batch=2))))


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


def trainer_keys(name: str, down: torch.Tensor, up: torch.Tensor, comfy: bool) -> dict[str, torch.Tensor]:
    """One layer's factors (alpha 2 at rank 4) as kohya/musubi write them over the file's module `name`
    (`lora_unet_…`, lora_down/up, alpha) or as ComfyUI does (`diffusion_model.…`, lora_A/B, alpha folded into the
    down factor)."""
    if comfy:
        return {f"diffusion_model.{name}.lora_A.weight": down * 0.5, f"diffusion_model.{name}.lora_B.weight": up}
    key = "lora_unet_" + name.replace(".", "_")
    return {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(2.0)}


def saved_peft_lora(data: Path, pipeline_class, transformer, targets: list[str], name: str
                    ) -> tuple[str, dict[str, torch.Tensor]]:
    """A PEFT LoRA on `targets` (rank 4, alpha 8, alpha 3 on the last target) saved by diffusers' own
    `pipeline_class.save_lora_weights` with its LoraConfig as adapter metadata, as LoRA `name`; and its float64
    ΔW per transformer module."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from tests.lora_tools import expected_deltas, peft_copy

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, alpha_pattern={targets[-1]: 3})
    module = peft_copy(transformer, config, seed=3)
    folder = data / "peft-save"
    pipeline_class.save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(module),
                                     transformer_lora_adapter_metadata=config.to_dict())
    shutil.copyfile(folder / "pytorch_lora_weights.safetensors", data / "models/Lora" / f"{name}.safetensors")
    return name, {path: d for (_c, path), d in expected_deltas({"transformer": module}).items()}


def fuses_to_the_formula(eng, name: str, deltas: dict[str, torch.Tensor], strength: float) -> None:
    """LoRA `name` fused at `strength` on the loaded model: no unmatched key, every transformer module in `deltas`
    (path -> float64 ΔW) is W0 + strength·ΔW, no other weight changes; removing it gives every tensor back bit
    for bit."""
    transformer = eng.pipeline.transformer
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    digests = adapter_state_digests(eng.pipeline)
    assert eng.inspect_lora(name).unmatched_keys == 0
    eng.set_loras([LoraSpec(name, strength)])
    after = transformer.state_dict()
    for key, w0 in before.items():
        path = key.removesuffix(".weight")
        if path in deltas:
            expected = (w0.double() + strength * deltas[path]).float()
            torch.testing.assert_close(after[key], expected, rtol=2e-6, atol=2e-7, msg=path)
        else:
            assert torch.equal(after[key], w0), key
    eng.set_loras([])
    assert adapter_state_digests(eng.pipeline) == digests


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
