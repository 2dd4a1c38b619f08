"""The op-count proxy (`--sections ops`): aten ops per denoiser call of the full-size architecture,
ours without LoRAs, with three rank-64 LoRAs fused and as bypass forwards, and plain diffusers.

Why on the meta device: FLUX.1-dev's transformer alone holds 11.9 B parameters (24 GB in bf16), more
than this machine's RAM, and an op list depends on shapes only. Every model here is built from the
bundled full-size config on `meta` and called once at the GPU bench's resolution, in the proxies'
storage dtype (bf16, what the GPU bench runs Flux in); a dispatch mode inside the denoiser's hooks
(`measure.OpCounter`) counts what it dispatches. Meta tensors take the same Python paths as real
ones; what differs is a choice a backend makes inside one op: attention runs as the math
decomposition (softmax, bmm) instead of a fused CPU or CUDA kernel, alike for every variant, so the
lists compare with each other but not with the real-weight `step` section's counts (SD1.5 in bf16:
2385 per call here; 1616 in the fp32 step rows, where attention is one fused op per call).

Why not through the engine: `Engine.load_model` reads and checks real weights, so it cannot build a
meta model. Ours is the denoiser class our loader builds (`component_files` for Flux), from the same
config as diffusers', so ours-without-LoRA against diffusers checks that nothing the LoRA stack sets
up (its key table, hooks left after a removal) adds work. The LoRAs go through the engine's own
LoRA machinery, `app.adapters.patcher.LoraStack` (what the engine's transitions call), on the meta
denoiser: `reconcile` fuses them into
the weights in place (what weights resting on the compute device get), `set_bypass` turns them into
`lora.bypass` hooks (what streamed offload and fp8 storage get), a one-LoRA `reconcile` keeps the
first (the cost three bypassed LoRAs are held to: they run as one pair of matmuls per layer), and an
empty `reconcile` removes them. The adapter files are built in memory on `meta`, in the layout
`workload.write_loras` writes.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import AutoencoderKL

from app.adapters.files import AdapterFile
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.engine.placement import DTYPES
from app.families import family
from benchmarks.config import PRESETS
from benchmarks.denoiser import call_inputs, meta_denoiser
from benchmarks.measure import OpCounter
from benchmarks.proxy_steps import DIFFUSERS, FUSED, NONE, ops_summary
from benchmarks.workload import lora_kinds, lora_shapes, lora_targets

META = torch.device("meta")
BYPASS, REMOVED = ("none", 3, "ours bypass", 1), ("none", 0, "ours, LoRAs removed", 1)
BYPASS_ONE = ("none", 1, "ours bypass", 1)


def count_call(family_name: str, denoiser: torch.nn.Module, latent_side: int) -> dict[str, float]:
    """aten ops of one steady-state call of `denoiser` at batch 1 (CFG-doubled where the family uses
    CFG): a first call goes uncounted, since LoRA bypasses prepare their factors on the first forward
    after a re-weight, once, not per step."""
    inputs = call_inputs(family_name, denoiser, 1, latent_side)
    with torch.no_grad():
        denoiser(**inputs)
        counter = OpCounter(denoiser)
        try:
            denoiser(**inputs)
        finally:
            counter.remove()
    return counter.per_call()


def meta_loras(family_name: str, denoiser: torch.nn.Module, rank: int) -> dict[str, AdapterFile]:
    """The three bench LoRAs (`workload.lora_kinds`) as in-memory adapter files of fp16 meta tensors."""
    files = {}
    for i, kind in enumerate(lora_kinds(family_name, denoiser)):
        name = f"bench-{family_name}-{kind}{i}"
        targets = lora_targets(family_name, denoiser, convs=kind == "locon")
        shapes = lora_shapes(targets, rank, family(family_name).denoiser)
        tensors = {key: torch.empty(shape, dtype=torch.float16, device=META) for key, shape in shapes.items()}
        files[name] = AdapterFile(name, Path(f"{name}.safetensors"), tensors, {}, name, 0)
    return files


def latent_side(family_name: str) -> int:
    """The GPU bench's latent side for `family_name`: its resolution over the VAE's downscale factor."""
    vae = AutoencoderKL.load_config(family(family_name).files.config_dir / "vae")
    return PRESETS["full"].resolution[family_name] // 2 ** (len(vae["block_out_channels"]) - 1)


def ops_section(family_name: str, config) -> dict[str, Any]:
    """Op lists of ours (no LoRA, three fused, three then one as bypass, removed again) and of plain
    diffusers, and a summary saying which equal ours-without-LoRA's."""
    fam = family(family_name)
    denoiser_config = fam.denoiser_class.load_config(fam.files.config_dir / fam.denoiser)
    side = latent_side(family_name)
    dtype = DTYPES[config.storage_dtype]  # what the GPU bench computes Flux in
    ours = meta_denoiser(family_name, denoiser_config, dtype)
    files = meta_loras(family_name, ours, config.lora_rank)
    specs = [LoraSpec(name) for name in files]
    stack = LoraStack(SimpleNamespace(**{fam.denoiser: ours}), family_name, META)
    ops = {NONE: count_call(family_name, ours, side)}
    stack.reconcile(specs, files)
    ops[FUSED] = count_call(family_name, ours, side)
    stack.set_bypass(frozenset({fam.denoiser}))
    ops[BYPASS] = count_call(family_name, ours, side)
    stack.reconcile(specs[:1], files)
    ops[BYPASS_ONE] = count_call(family_name, ours, side)
    stack.reconcile([], files)
    ops[REMOVED] = count_call(family_name, ours, side)
    ops[DIFFUSERS] = count_call(family_name, meta_denoiser(family_name, denoiser_config, dtype), side)
    return {"family": family_name, "denoiser": type(ours).__name__, "dtype": config.storage_dtype,
            "resolution": PRESETS["full"].resolution[family_name],
            "latent_side": side, "params_b": sum(p.numel() for p in ours.parameters()) / 1e9,
            "loras": {name: {"layers": len(f.tensors) // 2, "rank": config.lora_rank} for name, f in files.items()},
            "layers_touched": len(lora_targets(family_name, ours, convs=True)), "ops": ops_summary(ops),
            "per_call": {" / ".join(map(str, key)): counts for key, counts in ops.items()}}
