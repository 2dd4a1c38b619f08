"""LoRA files as the tools really write them, fused into the tiny SD1.5 and SDXL pipelines.

Files come from the tools' own writers, not from our synthetic one: PEFT (`LoraConfig`,
`get_peft_model`, `get_peft_model_state_dict`, `save_pretrained`), diffusers
(`save_lora_weights(..., *_lora_adapter_metadata=...)`, `convert_state_dict_to_kohya`) and the
legacy diffusers attention-processor layout renamed from PEFT's tensors. They cover attention,
feed-forward, resnet convs, the time (and SDXL's added) embeddings and every text encoder.

The reference is the formula, computed here in float64 from the PEFT layers themselves:
W = W0 + Σ wᵢ·Dᵢ with D = scale·B@A and PEFT's own `scaling` (lora_alpha/r, per pattern, or
/√r for rsLoRA), D = W′ − W0 for DoRA (W′ = m·V/‖V‖ per output row, V = W0 + scale·B@A).
fp32 models must land within a few float32 ulps of each layer's magnitude.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.utils import convert_state_dict_to_kohya
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, inject_adapter_in_model
from safetensors.torch import save_file

from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline

COMPONENTS = {"sd15": ("unet", "text_encoder"), "sdxl": ("unet", "text_encoder", "text_encoder_2")}
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "conv_shortcut",
                "time_emb_proj", "linear_1", "linear_2"]  # linear_N: time_embedding (and SDXL add_embedding)
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
FP32_ULPS = 4
DORA_ULPS = 12  # DoRA normalises whole rows and adds a float32 eps to the norm
Expected = dict[tuple[str, str], torch.Tensor]  # (component, path) -> float64 D at strength 1


@dataclass
class ToolFile:
    """A LoRA file written by a tool, and the float64 delta it must add per module at strength 1."""

    path: Path
    expected: Expected
    ulps: int = FP32_ULPS


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


def _peft_copy(module: torch.nn.Module, config: LoraConfig, seed: int) -> torch.nn.Module:
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


def _expected(peft_modules: dict[str, torch.nn.Module], *, peft_scale: bool = True) -> Expected:
    """Float64 D per module; `peft_scale=False` for layouts that carry no scale (scale 1)."""
    out = {}
    for component, module in peft_modules.items():
        for path, w0, a, b, scale, magnitude in _lora_layers(module):
            out[(component, path)] = _formula(w0, a, b, scale if peft_scale else 1.0, magnitude)
    return out


def _peft_modules(pipe, arch: str, configs: dict[str, LoraConfig], seed: int) -> dict[str, torch.nn.Module]:
    return {c: _peft_copy(getattr(pipe, c), configs[c], seed + i) for i, c in enumerate(COMPONENTS[arch])}


def _state_dicts(modules: dict[str, torch.nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    return {c: {k: v.detach().clone() for k, v in get_peft_model_state_dict(m).items()} for c, m in modules.items()}


# --------------------------------------------------------------------------------------- writers
def _configs(arch: str, *, dora: bool = False) -> dict[str, LoraConfig]:
    """Per component: rank/alpha patterns on the UNet, rsLoRA on the first text encoder."""
    configs = {
        "unet": LoraConfig(r=4, lora_alpha=8, target_modules=UNET_TARGETS, rank_pattern={"conv2": 2},
                           alpha_pattern={"ff.net.2": 3}, use_dora=dora),
        "text_encoder": LoraConfig(r=4, lora_alpha=4, target_modules=TEXT_TARGETS, use_rslora=True),
    }
    if arch == "sdxl":
        configs["text_encoder_2"] = LoraConfig(r=2, lora_alpha=3, target_modules=TEXT_TARGETS)
    return configs


def write_diffusers(folder: Path, pipe, arch: str, seed: int, *, dora: bool = False) -> ToolFile:
    """diffusers' `save_lora_weights` with each component's LoraConfig as adapter metadata."""
    configs = _configs(arch, dora=dora)
    modules = _peft_modules(pipe, arch, configs, seed)
    layers = {f"{c}_lora_layers": sd for c, sd in _state_dicts(modules).items()}
    metadata = {f"{c}_lora_adapter_metadata": configs[c].to_dict() for c in COMPONENTS[arch]}
    writer = StableDiffusionXLPipeline if arch == "sdxl" else StableDiffusionPipeline
    writer.save_lora_weights(folder, **layers, **metadata)
    return ToolFile(folder / "pytorch_lora_weights.safetensors", _expected(modules), DORA_ULPS if dora else FP32_ULPS)


def write_kohya(path: Path, pipe, arch: str, seed: int) -> ToolFile:
    """diffusers' `convert_state_dict_to_kohya`: `lora_unet_`, `lora_te1_`/`lora_te2_` (also on
    SD1.5), alpha = rank as int64, so scale 1 whatever the LoraConfig said."""
    modules = _peft_modules(pipe, arch, _configs(arch), seed)
    prefixed = {f"{c}.{k}": v for c, sd in _state_dicts(modules).items() for k, v in sd.items()}
    save_file(convert_state_dict_to_kohya(prefixed), str(path))
    return ToolFile(path, _expected(modules, peft_scale=False))


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


def write_legacy(path: Path, pipe, arch: str, seed: int, strays: dict[str, torch.Tensor]) -> ToolFile:
    """The legacy layout (no alpha: scale 1), plus `strays` that match no module."""
    modules = _peft_modules(pipe, arch, _configs(arch), seed)
    tensors = {legacy_key(c, k): v for c, sd in _state_dicts(modules).items() for k, v in sd.items()}
    save_file({**tensors, **strays}, str(path))
    return ToolFile(path, _expected(modules, peft_scale=False))


def write_peft_folder(folder: Path, pipe, seed: int) -> ToolFile:
    """PEFT's own `save_pretrained` of the UNet: `adapter_model.safetensors` with bare
    `base_model.model.` keys, its LoraConfig (alpha 8, r 4) only in `adapter_config.json` beside it."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_out.0", "conv1", "linear_1"])
    model = _randomise(get_peft_model(copy.deepcopy(pipe.unet), config), seed)
    model.save_pretrained(folder)
    return ToolFile(folder / "adapter_model.safetensors", _expected({"unet": model.base_model.model}))


# -------------------------------------------------------------------------------------- fixtures
FORMATS = ("diffusers", "diffusers_dora", "kohya", "legacy", "peft_folder")
# Tensors in the legacy file that name modules the tiny models lack: counted, never applied.
STRAYS = {f"{layer}_lora.{part}.weight": torch.ones(4, 4) for part in ("down", "up") for layer in (
    "unet.down_blocks.5.attentions.0.transformer_blocks.0.attn1.processor.to_q",
    "text_encoder.text_model.encoder.layers.99.self_attn.to_k")}
UNMATCHED = {"legacy": len(STRAYS)}


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory):
    """`tool_files(arch)`: every format's file for `arch`, written once per module."""
    cache: dict[str, dict[str, ToolFile]] = {}

    def get(arch: str) -> dict[str, ToolFile]:
        if arch not in cache:
            pipe, root = build_tiny_pipeline(arch), tmp_path_factory.mktemp(f"tool-{arch}")
            cache[arch] = {
                "diffusers": write_diffusers(root / "diffusers", pipe, arch, seed=1),
                "diffusers_dora": write_diffusers(root / "dora", pipe, arch, seed=2, dora=True),
                "kohya": write_kohya(root / "kohya.safetensors", pipe, arch, seed=3),
                "legacy": write_legacy(root / "legacy.safetensors", pipe, arch, seed=4, strays=STRAYS),
                "peft_folder": write_peft_folder(root / "peft", pipe, seed=5),
            }
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def model():
    """`model(arch)`: a tiny fp32 pipeline built once per module, every weight and bias put back
    to its original bits on each call, and those original tensors."""
    cache: dict[str, tuple[object, dict[str, torch.Tensor]]] = {}

    def get(arch: str):
        if arch not in cache:
            pipe = build_tiny_pipeline(arch)
            cache[arch] = (pipe, {f"{c}.{k}": v.clone() for c in COMPONENTS[arch]
                                  for k, v in getattr(pipe, c).state_dict().items()})
        pipe, pristine = cache[arch]
        with torch.no_grad():
            for component in COMPONENTS[arch]:
                for key, tensor in getattr(pipe, component).state_dict().items():
                    tensor.copy_(pristine[f"{component}.{key}"])
        return pipe, pristine

    return get


def _fuse(pipe, arch: str, entries: list[tuple[str, ToolFile, float]]):
    """Fuse (name, file, strength) through a fresh LoraStack reading each file from disk."""
    stack = LoraStack(pipe, arch)
    files = {name: read_adapter(name, tool.path) for name, tool, _ in entries}
    return stack, stack.reconcile([LoraSpec(name, w) for name, _, w in entries], files)


def _assert_fused(pipe, arch: str, pristine: dict[str, torch.Tensor], entries: list[tuple[ToolFile, float]]) -> float:
    """Every weight equals W0 + Σ w·D within its ulps budget, every other tensor keeps its bits;
    returns the largest error seen, in float32 ulps of the layer's magnitude."""
    worst = 0.0
    for component in COMPONENTS[arch]:
        for key, tensor in getattr(pipe, component).state_dict().items():
            target, original = (component, key.removesuffix(".weight")), pristine[f"{component}.{key}"]
            touching = [(tool, w) for tool, w in entries if key.endswith(".weight") and target in tool.expected]
            if not touching:
                assert torch.equal(tensor, original), f"{component}.{key} changed but no file targets it"
                continue
            reference = original.double() + sum(w * tool.expected[target] for tool, w in touching)
            ulp = torch.finfo(torch.float32).eps * float(reference.abs().max())
            error = float((tensor.double() - reference).abs().max()) / ulp
            assert error <= max(t.ulps for t, _ in touching), f"{component}.{key}: off by {error:.1f} ulps"
            worst = max(worst, error)
    return worst


def _assert_restored(pipe, arch: str, pristine: dict[str, torch.Tensor]) -> None:
    for component in COMPONENTS[arch]:
        for key, tensor in getattr(pipe, component).state_dict().items():
            original = pristine[f"{component}.{key}"]
            assert torch.equal(tensor.view(torch.int32), original.view(torch.int32)), f"{component}.{key} not restored"


# ------------------------------------------------------------------------ fused = the formula
@pytest.mark.parametrize("strength", [1.0, 0.6])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_tool_written_files_fuse_to_the_formula(model, tool_files, arch, fmt, strength):
    """Each tool's file, alone at strength w, moves every module it names to W0 + w·scale·B@A (PEFT's
    scale, from the file's metadata or adapter_config.json), reaches every layer (attention,
    feed-forward, resnet convs, time/added embeddings, every text encoder), counts exactly the
    tensors that match nothing, and restores every bit when removed."""
    pipe, pristine = model(arch)
    tool = tool_files(arch)[fmt]
    stack, report = _fuse(pipe, arch, [("a", tool, strength)])
    assert (report["a"].matched_layers, report["a"].unmatched_keys) == (len(tool.expected), UNMATCHED.get(fmt, 0))
    _assert_fused(pipe, arch, pristine, [(tool, strength)])
    stack.reconcile([], {})
    _assert_restored(pipe, arch, pristine)


def test_the_files_cover_every_kind_of_layer(tool_files):
    """Guards the test above: the written files really reach attention, feed-forward, resnet
    convs, the time embedding (and SDXL's added embedding) and every text encoder, with rank and
    alpha patterns, rsLoRA and DoRA in play."""
    for arch in ("sd15", "sdxl"):
        targets = {f"{c}.{p}" for tool in tool_files(arch).values() for c, p in tool.expected}
        needles = ["attn1.to_q", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2", "resnets.0.conv1", "conv2",
                   "conv_shortcut", "time_emb_proj", "time_embedding.linear_2", "self_attn.out_proj", "mlp.fc2"]
        needles += ["add_embedding.linear_1", "text_encoder_2."] if arch == "sdxl" else []
        for needle in needles:
            assert any(needle in t for t in targets), (arch, needle)
    meta = json.loads(load_file_metadata(tool_files("sd15")["diffusers"].path)["lora_adapter_metadata"])
    assert (meta["unet.lora_alpha"], meta["unet.r"], meta["text_encoder.use_rslora"]) == (8, 4, True)


def load_file_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata() or {}
