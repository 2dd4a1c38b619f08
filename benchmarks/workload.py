"""What the benchmark runs on: full-size SD1.5/SDXL/Flux architectures with random weights (speed
and load time do not depend on weight values), as a diffusers folder or (SD) an LDM single file, and
random LoRAs that both our loader and diffusers read."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline
from app.engine.checkpoint_shapes import build_components, meta_components
from app.families import family
from app.families.ldm_layout import to_ldm_state_dict
from app.settings import Settings
from benchmarks.denoiser import default_dtype, denoiser_of
from benchmarks.measure import free_memory

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class PreparedModel:
    """A random-weight pipeline saved as a diffusers folder in an A1111-layout data dir, with LoRAs."""

    family: str
    data_dir: Path
    name: str  # the folder's name under models/Stable-diffusion (what Engine.load_model takes)
    folder: Path
    loras: tuple[str, ...]  # LoRA library names, in the order the 1- and 3-LoRA rows use them
    lora_paths: tuple[Path, ...]
    denoiser_config: dict  # the UNet's or transformer's config
    latent_scale: int  # pixels per latent pixel (the VAE's scale factor)
    denoiser_params_m: float


def random_pipeline(family_name: str, device: torch.device, dtype: torch.dtype):
    """The full-size pipeline from the bundled configs with random weights, initialised on `device`
    (seconds on a GPU, where the CPU would take minutes for SDXL) directly in `dtype` (the default
    dtype during the build), tensors the family pins (a rotary `inv_freq`) in their own dtype,
    as a load keeps them."""
    fam = family(family_name)
    config_dir = fam.files.config_dir
    index = json.loads((config_dir / "model_index.json").read_text())
    with torch.device(device), default_dtype(dtype), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parts = {name: module.eval() for name, module in build_components(family_name, config_dir).items()}
    for name, module in parts.items():
        for path, tensor in [*module.named_parameters(), *module.named_buffers()]:
            module_path, _, leaf = path.rpartition(".")
            want = fam.pinned_dtype(name, module_path, leaf) or dtype
            if tensor.is_floating_point() and tensor.dtype != want:
                tensor.data = tensor.data.to(want)
    parts["scheduler"] = getattr(diffusers, index["scheduler"][1]).from_pretrained(config_dir, subfolder="scheduler")
    return fam.plain_pipeline_class(**parts, **fam.tokenizers(), **fam.pipeline_kwargs)


def _random_like(key: str, shape: torch.Size, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Values a trained model could hold: weights ~ N(0, 1/fan_in), norm scales 1, biases 0, so
    activations stay finite and no denormals slow a CPU forward down."""
    if key.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    fan_in = math.prod(shape[1:])
    return (torch.randn(shape, generator=generator) / math.sqrt(fan_in)).to(dtype)


def write_random_single_file(family_name: str, path: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """A full-size LDM single file with random weights, written one tensor at a time so that even
    SDXL (6.9 GB in bf16) never sits in memory whole. The layout comes from `ldm_plan` on meta
    components, i.e. exactly the keys and shapes our loader and diffusers' single-file loader read."""
    fam = family(family_name)
    state = to_ldm_state_dict(meta_components(family_name, fam.files.config_dir), fam)
    shapes = {key: t.shape for key, t in sorted(state.items())}
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


def lora_targets(family_name: str, denoiser: torch.nn.Module, convs: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(module path, weight shape) of the layers a bench LoRA covers: the linears the family names
    (`TestKit.bench.lora_layers`: attention and feed-forward), plus its convs for a LoCon."""
    spec = family(family_name).test_kit.bench
    linears = re.compile(spec.lora_layers)
    conv_layers = re.compile(spec.lora_convs) if convs and spec.lora_convs else None
    found = []
    for name, module in denoiser.named_modules():
        linear = isinstance(module, torch.nn.Linear) and linears.search(name)
        conv = conv_layers and isinstance(module, torch.nn.Conv2d) and conv_layers.search(name)
        if linear or conv:
            found.append((name, tuple(module.weight.shape)))
    return found


def lora_shapes(targets: list[tuple[str, tuple[int, ...]]], rank: int, component: str) -> dict[str, tuple[int, ...]]:
    """Key and shape of every tensor of a rank-`rank` LoRA on `targets`, in the PEFT layout
    (`<component>.<module>.lora_A/B.weight`, no alpha): both our loader and diffusers read it, and both
    scale it by 1, so the two sides apply the same deltas."""
    shapes = {}
    for name, (out_dim, in_dim, *kernel) in targets:
        shapes[f"{component}.{name}.lora_A.weight"] = (rank, in_dim, *kernel)
        shapes[f"{component}.{name}.lora_B.weight"] = (out_dim, rank, *([1] * len(kernel)))
    return shapes


def write_lora(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> Path:
    """A random fp16 LoRA file: down factors ~ N(0, 1/fan_in), up factors small, so deltas stay modest."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in shapes.items():
        values = torch.randn(shape, generator=generator)
        scaled = values / math.sqrt(math.prod(shape[1:])) if key.endswith("lora_A.weight") else values * 0.02
        tensors[key] = scaled.half()
    save_file(tensors, str(path))
    return path


def lora_kinds(family_name: str, denoiser: torch.nn.Module) -> tuple[str, ...]:
    """The three LoRAs every LoRA row uses: two on attention + feed-forward, and a LoCon that also
    covers the convs where the family names some (a third plain LoRA on a DiT)."""
    with_convs = len(lora_targets(family_name, denoiser, True)) > len(lora_targets(family_name, denoiser, False))
    return ("lora", "lora", "locon" if with_convs else "lora")


def write_loras(denoiser: torch.nn.Module, lora_dir: Path, family_name: str, rank: int) -> tuple[list[str], list[Path]]:
    """The three LoRA files (`lora_kinds`) for `denoiser`, in the LoRA library `lora_dir`."""
    lora_dir.mkdir(parents=True, exist_ok=True)
    names, paths = [], []
    for i, kind in enumerate(lora_kinds(family_name, denoiser)):
        names.append(f"bench-{family_name}-{kind}{i}")
        targets = lora_targets(family_name, denoiser, convs=kind == "locon")
        shapes = lora_shapes(targets, rank, family(family_name).denoiser)
        paths.append(write_lora(lora_dir / f"{names[-1]}.safetensors", shapes, i))
    return names, paths


def prepare_model(family_name: str, tmp: Path, device: torch.device, dtype: torch.dtype, tiny: bool,
                  rank: int) -> PreparedModel:
    """Build, save and free the random pipeline; write its three LoRAs."""
    settings = Settings(data_dir=tmp / family_name)
    folder = settings.checkpoints_dir / f"bench-{family_name}"
    pipe = build_tiny_pipeline(family_name) if tiny else random_pipeline(family_name, device, dtype)
    pipe.save_pretrained(folder, safe_serialization=True)
    denoiser = denoiser_of(pipe)
    names, paths = write_loras(denoiser, settings.lora_dir, family_name, rank)
    model = PreparedModel(family_name, settings.data_dir, folder.name, folder, tuple(names), tuple(paths),
                          dict(denoiser.config), pipe.vae_scale_factor,
                          sum(p.numel() for p in denoiser.parameters()) / 1e6)
    del pipe
    free_memory()
    return model


def lora_specs(names: tuple[str, ...], count: int, last_weight: float = 1.0) -> list[LoraSpec]:
    """The first `count` LoRAs at strength 1, the last one at `last_weight` (what a re-weight moves)."""
    specs = [LoraSpec(name) for name in names[:count]]
    if specs:
        specs[-1] = LoraSpec(specs[-1].name, last_weight)
    return specs
