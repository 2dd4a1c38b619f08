"""LoRA files written by the tools themselves, for the format tests, and the delta each must add.

Writers: PEFT (`LoraConfig`, `inject_adapter_in_model`/`get_peft_model`, `get_peft_model_state_dict`,
`save_pretrained`), diffusers (`save_lora_weights(..., *_lora_adapter_metadata=...)`,
`convert_state_dict_to_kohya`) and diffusers' legacy attention-processor layout, renamed here from
PEFT's tensors. They cover attention, feed-forward, resnet convs, the time (and SDXL's added)
embeddings and every text encoder, with rank/alpha patterns, rsLoRA and DoRA in play.

The expected delta is the formula, computed in float64 from the PEFT layers themselves (never from
`app.adapters`): D = scale·B@A with PEFT's own `scaling` (lora_alpha/r, per pattern, or /√r for
rsLoRA); DoRA: D = W′ − W0 with W′ = m·V/‖V‖ per output row, V = W0 + scale·B@A.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.utils import convert_state_dict_to_kohya
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, inject_adapter_in_model
from safetensors.torch import save_file

COMPONENTS = {"sd15": ("unet", "text_encoder"), "sdxl": ("unet", "text_encoder", "text_encoder_2")}
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "conv_shortcut",
                "time_emb_proj", "linear_1", "linear_2"]  # linear_N: time_embedding (and SDXL add_embedding)
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "text_projection"]  # SDXL's 2nd encoder
# float32 ulps of a layer's magnitude the fused fp32 weight may be off (measured: ≤ 1.3 for LoRA,
# ≤ 2.9 for DoRA, which normalises whole rows).
FP32_ULPS = 4
Expected = dict[tuple[str, str], torch.Tensor]  # (component, path) -> float64 D at strength 1


@dataclass
class ToolFile:
    """A LoRA file written by a tool, and the float64 delta it must add per module at strength 1."""

    path: Path
    expected: Expected


# ---------------------------------------------------------------------------------- PEFT layers
def _randomise(peft_module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give PEFT's B (and DoRA magnitudes) random values so ΔW is of the weight's order (PEFT
    starts B at zero: a zero delta would prove nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_module.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            elif "lora_magnitude_vector" in name:
                param.mul_(1 + 0.2 * torch.randn(param.shape, generator=generator))
    return peft_module


def peft_copy(module: torch.nn.Module, config: LoraConfig, seed: int) -> torch.nn.Module:
    """A copy of `module` with PEFT LoRA layers injected and randomised."""
    return _randomise(inject_adapter_in_model(config, copy.deepcopy(module)), seed)


def _lora_layers(peft_module: torch.nn.Module):
    """(path, base weight, A, B, PEFT's scaling, DoRA magnitude or None) of every LoRA layer, float64."""
    for path, layer in peft_module.named_modules():
        if not hasattr(layer, "lora_A") or "default" not in layer.lora_A:
            continue
        magnitude = layer.lora_magnitude_vector["default"].weight if "default" in layer.lora_magnitude_vector else None
        yield (path, layer.base_layer.weight.detach().double(), layer.lora_A["default"].weight.detach().double(),
               layer.lora_B["default"].weight.detach().double(), float(layer.scaling["default"]),
               None if magnitude is None else magnitude.detach().double())


def _formula(w0, a, b, scale, magnitude) -> torch.Tensor:
    """D = scale·B@A (conv kernels on A, B 1×1); DoRA: D = m·V/‖V‖ − W0 with V = W0 + scale·B@A."""
    delta = (scale * (b.flatten(1) @ a.flatten(1))).reshape(w0.shape)
    if magnitude is None:
        return delta
    merged = w0 + delta
    norm = merged.flatten(1).norm(dim=1).reshape(-1, *[1] * (w0.dim() - 1))
    return magnitude.reshape(norm.shape) * merged / norm - w0


def expected_deltas(peft_modules: dict[str, torch.nn.Module], *, peft_scale: bool = True) -> Expected:
    """Float64 D per module; `peft_scale=False` for layouts that carry no scale (scale 1)."""
    out = {}
    for component, module in peft_modules.items():
        for path, w0, a, b, scale, magnitude in _lora_layers(module):
            out[(component, path)] = _formula(w0, a, b, scale if peft_scale else 1.0, magnitude)
    return out


def _peft_modules(pipe, family_name: str, configs: dict[str, LoraConfig], seed: int) -> dict[str, torch.nn.Module]:
    return {c: peft_copy(getattr(pipe, c), configs[c], seed + i) for i, c in enumerate(COMPONENTS[family_name])}


def _state_dicts(modules: dict[str, torch.nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    return {c: {k: v.detach().clone() for k, v in get_peft_model_state_dict(m).items()} for c, m in modules.items()}


# --------------------------------------------------------------------------------------- writers
def _configs(family_name: str, *, dora: bool = False) -> dict[str, LoraConfig]:
    """Per component: rank/alpha patterns on the UNet, rsLoRA on the first text encoder."""
    configs = {
        "unet": LoraConfig(r=4, lora_alpha=8, target_modules=UNET_TARGETS, rank_pattern={"conv2": 2},
                           alpha_pattern={"ff.net.2": 3}, use_dora=dora),
        "text_encoder": LoraConfig(r=4, lora_alpha=4, target_modules=TEXT_TARGETS, use_rslora=True),
    }
    if family_name == "sdxl":
        configs["text_encoder_2"] = LoraConfig(r=2, lora_alpha=3, target_modules=TEXT_TARGETS)
    return configs


def write_diffusers(folder: Path, pipe, family_name: str, seed: int, *, dora: bool = False) -> ToolFile:
    """diffusers' `save_lora_weights` with each component's LoraConfig as adapter metadata."""
    configs = _configs(family_name, dora=dora)
    modules = _peft_modules(pipe, family_name, configs, seed)
    layers = {f"{c}_lora_layers": sd for c, sd in _state_dicts(modules).items()}
    metadata = {f"{c}_lora_adapter_metadata": configs[c].to_dict() for c in COMPONENTS[family_name]}
    writer = StableDiffusionXLPipeline if family_name == "sdxl" else StableDiffusionPipeline
    writer.save_lora_weights(folder, **layers, **metadata)
    path = folder / "pytorch_lora_weights.safetensors"
    return ToolFile(path, expected_deltas(modules))


def write_kohya(path: Path, pipe, family_name: str, seed: int) -> ToolFile:
    """diffusers' `convert_state_dict_to_kohya`: `lora_unet_`, `lora_te1_`/`lora_te2_` (also on
    SD1.5), alpha = rank as int64, so scale 1 whatever the LoraConfig said."""
    modules = _peft_modules(pipe, family_name, _configs(family_name), seed)
    prefixed = {f"{c}.{k}": v for c, sd in _state_dicts(modules).items() for k, v in sd.items()}
    save_file(convert_state_dict_to_kohya(prefixed), str(path))
    return ToolFile(path, expected_deltas(modules, peft_scale=False))


_LEGACY_UNET = {".to_out.0.lora_A.weight": ".processor.to_out_lora.down.weight",
                ".to_out.0.lora_B.weight": ".processor.to_out_lora.up.weight",
                **{f".to_{p}.lora_{ab}.weight": f".processor.to_{p}_lora.{du}.weight"
                   for p in "qkv" for ab, du in (("A", "down"), ("B", "up"))}}
_LEGACY_TEXT = {**{f".{p}_proj.lora_{ab}.weight": f".to_{p}_lora.{du}.weight"
                   for p in ("q", "k", "v", "out") for ab, du in (("A", "down"), ("B", "up"))},
                ".lora_A.weight": ".lora_linear_layer.down.weight", ".lora_B.weight": ".lora_linear_layer.up.weight"}


def legacy_key(component: str, key: str) -> str:
    """diffusers' pre-PEFT spelling: attention processors (`attn1.processor.to_q_lora.down`,
    `self_attn.to_q_lora.down` for q_proj), `lora.down` on other UNet layers, `lora_linear_layer`
    on the text encoders' MLPs, text encoders with transformers 4.x's `text_model.` level."""
    table = _LEGACY_UNET if component == "unet" else _LEGACY_TEXT
    for peft, legacy in table.items():
        if key.endswith(peft):
            key = key[: -len(peft)] + legacy
            break
    else:
        key = key.replace(".lora_A.weight", ".lora.down.weight").replace(".lora_B.weight", ".lora.up.weight")
    level = "" if component == "unet" or key.startswith("text_model.") else "text_model."
    return f"{component}.{level}{key}"


def write_legacy(path: Path, pipe, family_name: str, seed: int, strays: dict[str, torch.Tensor]) -> ToolFile:
    """The legacy layout (no alpha: scale 1), plus `strays` that match no module."""
    modules = _peft_modules(pipe, family_name, _configs(family_name), seed)
    tensors = {legacy_key(c, k): v for c, sd in _state_dicts(modules).items() for k, v in sd.items()}
    save_file({**tensors, **strays}, str(path))
    return ToolFile(path, expected_deltas(modules, peft_scale=False))


def write_peft_folder(folder: Path, pipe, seed: int) -> ToolFile:
    """PEFT's own `save_pretrained` of the UNet: `adapter_model.safetensors` with bare
    `base_model.model.` keys, its LoraConfig (alpha 8, r 4) only in `adapter_config.json` beside it."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_out.0", "conv1", "linear_1"])
    model = _randomise(get_peft_model(copy.deepcopy(pipe.unet), config), seed)
    model.save_pretrained(folder)
    return ToolFile(folder / "adapter_model.safetensors", expected_deltas({"unet": model.base_model.model}))
