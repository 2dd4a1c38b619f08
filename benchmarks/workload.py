"""What the benchmark runs on: full-size SD1.5/SDXL architectures with random weights (speed and
load time do not depend on weight values), as a diffusers folder or an LDM single file, and random
LoRAs that both our loader and diffusers read."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline
from app.engine.checkpoint_shapes import meta_components
from app.families import family
from app.families.ldm_layout import to_ldm_state_dict
from app.settings import Settings
from benchmarks.measure import free_memory

_LORA_LINEAR = re.compile(r"\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$")
_LORA_CONV = re.compile(r"resnets\.\d+\.conv[12]$")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class PreparedModel:
    """A random-weight pipeline saved as a diffusers folder in an A1111-layout data dir, with LoRAs."""

    arch: str
    data_dir: Path
    name: str  # the folder's name under models/Stable-diffusion (what Engine.load_model takes)
    folder: Path
    loras: tuple[str, ...]  # LoRA library names, in the order the 1- and 3-LoRA rows use them
    lora_paths: tuple[Path, ...]
    unet_config: dict
    latent_scale: int  # pixels per latent pixel (the VAE's scale factor)
    unet_params_m: float


def random_pipeline(arch: str, device: torch.device, dtype: torch.dtype):
    """The full-size pipeline from the bundled configs with random weights, initialised on `device`
    (seconds on a GPU, where the CPU would take minutes for SDXL)."""
    config_dir = family(arch).config_dir
    index = json.loads((config_dir / "model_index.json").read_text())
    text_classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parts = {
            "unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(config_dir / "unet")),
            "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(config_dir / "vae")),
        }
        for name, cls in text_classes.items():
            if name in index:
                parts[name] = cls(CLIPTextConfig.from_pretrained(config_dir / name))
    parts = {name: module.to(dtype).eval() for name, module in parts.items()}
    parts["scheduler"] = getattr(diffusers, index["scheduler"][1]).from_pretrained(config_dir, subfolder="scheduler")
    return family(arch).plain_pipeline_class(**parts, **family(arch).tokenizers(), **family(arch).pipeline_kwargs)


def _random_like(key: str, shape: torch.Size, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Values a trained model could hold: weights ~ N(0, 1/fan_in), norm scales 1, biases 0, so
    activations stay finite and no denormals slow a CPU forward down."""
    if key.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    fan_in = math.prod(shape[1:])
    return (torch.randn(shape, generator=generator) / math.sqrt(fan_in)).to(dtype)


def write_random_single_file(arch: str, path: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """A full-size LDM single file with random weights, written one tensor at a time so that even
    SDXL (6.9 GB in bf16) never sits in memory whole. The layout comes from `ldm_plan` on meta
    components, i.e. exactly the keys and shapes our loader and diffusers' single-file loader read."""
    fam = family(arch)
    shapes = {key: t.shape for key, t in sorted(to_ldm_state_dict(meta_components(arch, fam.config_dir), fam).items())}
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    generator = torch.Generator().manual_seed(seed)
    partial = path.with_suffix(".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)) + blob)
        for key, shape in shapes.items():
            handle.write(_random_like(key, shape, generator, dtype).view(torch.uint8).numpy().tobytes())
    partial.replace(path)  # a run killed half-way leaves no truncated checkpoint behind
    return path


def single_file_numel(path: Path) -> int:
    """How many weights a safetensors file holds, from its header alone."""
    with safe_open(str(path), "pt") as handle:
        return sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())


def lora_targets(unet: torch.nn.Module, convs: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(module path, weight shape) of the layers a LoRA covers: attention projections and
    feed-forward linears, plus the resnet 3×3 convs for a LoCon."""
    found = []
    for name, module in unet.named_modules():
        linear = isinstance(module, torch.nn.Linear) and _LORA_LINEAR.search(name)
        conv = convs and isinstance(module, torch.nn.Conv2d) and _LORA_CONV.search(name)
        if linear or conv:
            found.append((name, tuple(module.weight.shape)))
    return found


def write_lora(path: Path, targets: list[tuple[str, tuple[int, ...]]], rank: int, seed: int) -> Path:
    """A random LoRA in the PEFT layout (`unet.<module>.lora_A/B.weight`, fp16, no alpha): both our
    loader and diffusers read it, and both scale it by 1, so the two sides apply the same deltas."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in targets:
        out_dim, in_dim, *kernel = shape
        fan_in = in_dim * math.prod(kernel)
        down = torch.randn(rank, in_dim, *kernel, generator=generator) / math.sqrt(fan_in)
        up = torch.randn(out_dim, rank, *([1] * len(kernel)), generator=generator) * 0.02
        tensors[f"unet.{name}.lora_A.weight"] = down.half()
        tensors[f"unet.{name}.lora_B.weight"] = up.half()
    save_file(tensors, str(path))
    return path


def write_loras(unet: torch.nn.Module, lora_dir: Path, arch: str, rank: int) -> tuple[list[str], list[Path]]:
    """The three LoRAs every LoRA row uses: two on attention + feed-forward, one LoCon with the convs."""
    lora_dir.mkdir(parents=True, exist_ok=True)
    names, paths = [], []
    for i, kind in enumerate(("lora", "lora", "locon")):
        names.append(f"bench-{arch}-{kind}{i}")
        targets = lora_targets(unet, convs=kind == "locon")
        paths.append(write_lora(lora_dir / f"{names[-1]}.safetensors", targets, rank, i))
    return names, paths


def prepare_model(arch: str, tmp: Path, device: torch.device, dtype: torch.dtype, tiny: bool,
                  rank: int) -> PreparedModel:
    """Build, save and free the random pipeline; write its three LoRAs."""
    settings = Settings(data_dir=tmp / arch)
    folder = settings.checkpoints_dir / f"bench-{arch}"
    pipe = build_tiny_pipeline(arch) if tiny else random_pipeline(arch, device, dtype)
    pipe.save_pretrained(folder, safe_serialization=True)
    names, paths = write_loras(pipe.unet, settings.lora_dir, arch, rank)
    model = PreparedModel(arch, settings.data_dir, folder.name, folder, tuple(names), tuple(paths),
                          dict(pipe.unet.config), pipe.vae_scale_factor,
                          sum(p.numel() for p in pipe.unet.parameters()) / 1e6)
    del pipe
    free_memory()
    return model


def lora_specs(names: tuple[str, ...], count: int, last_weight: float = 1.0) -> list[LoraSpec]:
    """The first `count` LoRAs at strength 1, the last one at `last_weight` (what a re-weight moves)."""
    specs = [LoraSpec(name) for name in names[:count]]
    if specs:
        specs[-1] = LoraSpec(specs[-1].name, last_weight)
    return specs
