"""Synthetic adapter files for a given pipeline: every algorithm, key layout and dtype we load.

Tests need adapter files whose every tensor they know, in the spellings real trainers write
(kohya, LyCORIS, PEFT/diffusers), for the tiny pipelines of `app.demo`; the demo needs a few
LoRAs that visibly change its images. Both come from one table-driven generator:

* an *algorithm* is one small function that, given a target layer (its kind and float32 weight),
  a rank and a random source, returns that layer's tensors under their kohya/LyCORIS suffixes
  (`lora_down.weight`, `hada_w1_a`, `oft_blocks`, …), or None where it does not apply (a Tucker
  core on a linear layer, a norm adapter on a conv);
* a *layout* (`Layout`) spells layer keys and suffixes the way one trainer does.

Sizes are chosen so that at strength 1 every algorithm changes a layer by about `strength`
times the weight's RMS, which is enough for a bf16 model to see every delta (a delta far below
one bf16 ulp would fuse to the unchanged weight and prove nothing) and for the tiny model's
image to change visibly. Text-encoder keys are spelled as trainers write them, from the
transformers 4.x module tree (`text_model.encoder.…`), whatever the installed transformers calls
the module.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from app.families import FAMILIES
from app.families.ldm_layout import unet_module_map

__all__ = [
    "ALGORITHMS",
    "DEFAULT_TARGETS",
    "LAYOUTS",
    "Layer",
    "Layout",
    "SyntheticAdapter",
    "adapter_metadata",
    "adapter_state_digests",
    "build_layers",
    "tag_frequency",
    "write_adapter",
    "write_demo_loras",
]

Target = tuple[str, str]  # (component, module path), as `app.adapters.keys` resolves keys
Draw = Callable[..., Tensor]  # draw(*shape) -> standard-normal float32 tensor
Tensors = dict[str, Tensor]

# A spread of layer kinds: linear with and without bias, 1×1 and 3×3 convs with bias, the
# cross-attention key (its input width is what tells SD1.5 from SDXL), norms, and text encoders.
DEFAULT_TARGETS = (
    "unet.*attentions.0.proj_in",
    "unet.*attentions.0.transformer_blocks.0.attn1.to_q",
    "unet.*attentions.0.transformer_blocks.0.attn1.to_out.0",
    "unet.*attentions.0.transformer_blocks.0.attn2.to_k",
    "unet.*attentions.0.transformer_blocks.0.norm1",
    "unet.*resnets.0.norm1",
    "unet.*resnets.0.conv1",
    "unet.*resnets.0.conv_shortcut",
    "unet.*resnets.0.time_emb_proj",
    "text_encoder*.layers.0.self_attn.q_proj",
    "text_encoder*.layers.0.mlp.fc1",
    "text_encoder*.layers.0.layer_norm1",
)
# The same spread on Flux's transformer (diffusers names): attention q and output, the single
# blocks' MLP input and output projection, a modulation and an embedder, and CLIP-L.
FLUX_TARGETS = (
    "transformer.transformer_blocks.0.attn.to_q",
    "transformer.transformer_blocks.*.attn.to_out.0",
    "transformer.transformer_blocks.1.ff.net.2",
    "transformer.single_transformer_blocks.0.proj_mlp",
    "transformer.single_transformer_blocks.*.proj_out",
    "transformer.transformer_blocks.0.norm1.linear",
    "transformer.context_embedder",
    "text_encoder.*layers.0.self_attn.q_proj",
    "text_encoder.*layers.0.mlp.fc1",
    "text_encoder.*layers.0.layer_norm1",
)
_KINDS = ((torch.nn.Linear, "linear"), (torch.nn.Conv2d, "conv"), ((torch.nn.GroupNorm, torch.nn.LayerNorm), "norm"))
_COMPONENTS = {name: fam.components for name, fam in FAMILIES.items()}


@dataclass(frozen=True, eq=False)
class Layer:
    """What an algorithm function sees of its target: kind, float32 weight (and bias) copies."""

    kind: str  # "linear" | "conv" | "norm"
    weight: Tensor
    bias: Tensor | None

    @property
    def out_dim(self) -> int:
        return self.weight.shape[0]

    @property
    def in_dim(self) -> int:
        return self.weight.shape[1]

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(self.weight.shape[2:])

    @property
    def ones(self) -> tuple[int, ...]:
        """Trailing 1s that give a factor the weight's number of dimensions."""
        return (1,) * len(self.kernel)

    def amp(self, strength: float) -> float:
        """Target RMS of ΔW: `strength` times the weight's RMS."""
        return strength * float(self.weight.pow(2).mean().sqrt())


# ----------------------------------------------------------------------------- algorithm helpers
def _chain_scale(rank: int, factors: int) -> float:
    """Per-factor scale that makes a product of `factors` normal factors over rank r have RMS 1."""
    return rank ** (-(factors - 1) / (2 * factors))


def _split(n: int) -> tuple[int, int]:
    """n = a·b with a the largest divisor not above √n (LyCORIS puts the small factor first)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


def _weighty(layer: Layer) -> bool:
    return layer.kind in ("linear", "conv")


def _has_kernel(layer: Layer) -> bool:
    return layer.kind == "conv" and math.prod(layer.kernel) > 1


# ----------------------------------------------------------------------------------- algorithms
def _lora(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """LoRA / LoCon: down carries the conv kernel (3×3 down, 1×1 up)."""
    if not _weighty(layer):
        return None
    k = _chain_scale(rank, 2)
    return {
        "lora_down.weight": draw(rank, layer.in_dim, *layer.kernel) * k,
        "lora_up.weight": draw(layer.out_dim, rank, *layer.ones) * k * layer.amp(strength),
    }


def _lora_tucker(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if not _has_kernel(layer):
        return None
    k = _chain_scale(rank, 3)
    return {
        "lora_down.weight": draw(rank, layer.in_dim, 1, 1) * k,
        "lora_mid.weight": draw(rank, rank, *layer.kernel) * k,
        "lora_up.weight": draw(layer.out_dim, rank, 1, 1) * k * layer.amp(strength),
    }


def _loha(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """LoHa with conv factors flattened to (r, in·kh·kw), as LyCORIS stores them."""
    if not _weighty(layer):
        return None
    k, cols = _chain_scale(rank, 2), layer.in_dim * math.prod(layer.kernel)
    return {
        "hada_w1_a": draw(layer.out_dim, rank) * k * layer.amp(strength),
        "hada_w1_b": draw(rank, cols) * k,
        "hada_w2_a": draw(layer.out_dim, rank) * k,
        "hada_w2_b": draw(rank, cols) * k,
    }


def _loha_tucker(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if not _has_kernel(layer):
        return None
    k = _chain_scale(rank, 3)
    out = {}
    for i, amp in ((1, layer.amp(strength)), (2, 1.0)):
        out[f"hada_t{i}"] = draw(rank, rank, *layer.kernel) * k * amp
        out[f"hada_w{i}_a"] = draw(rank, layer.out_dim) * k
        out[f"hada_w{i}_b"] = draw(rank, layer.in_dim) * k
    return out


def _lokr(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """LoKr with both Kronecker factors stored whole."""
    if not _weighty(layer):
        return None
    (a, b), (c, d) = _split(layer.out_dim), _split(layer.in_dim)
    return {"lokr_w1": draw(a, c) * layer.amp(strength), "lokr_w2": draw(b, d, *layer.kernel)}


def _lokr_factorised(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if not _weighty(layer):
        return None
    (a, b), (c, d), k = _split(layer.out_dim), _split(layer.in_dim), _chain_scale(rank, 2)
    return {
        "lokr_w1_a": draw(a, rank) * k * layer.amp(strength),
        "lokr_w1_b": draw(rank, c) * k,
        "lokr_w2_a": draw(b, rank) * k,
        "lokr_w2_b": draw(rank, d, *layer.kernel) * k,
    }


def _lokr_tucker(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if not _has_kernel(layer):
        return None
    (a, b), (c, d), k = _split(layer.out_dim), _split(layer.in_dim), _chain_scale(rank, 3)
    return {
        "lokr_w1": draw(a, c) * layer.amp(strength),
        "lokr_t2": draw(rank, rank, *layer.kernel) * k,
        "lokr_w2_a": draw(rank, b) * k,
        "lokr_w2_b": draw(rank, d) * k,
    }


def _glora(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """GLoRA, LyCORIS 4.x layout; W·a1·a2 sums over the input channels, hence the 1/√in."""
    if not _weighty(layer):
        return None
    k, amp = _chain_scale(rank, 2), layer.amp(strength)
    a_scale = amp / (math.sqrt(layer.in_dim) * max(layer.amp(1.0), 1e-12))
    return {
        "a1.weight": draw(layer.in_dim, rank, *layer.ones) * k * a_scale,
        "a2.weight": draw(rank, layer.in_dim, *layer.ones) * k,
        "b1.weight": draw(layer.out_dim, rank, *layer.ones) * k * amp,
        "b2.weight": draw(rank, layer.in_dim, *layer.kernel) * k,
    }


def _glora_old(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """GLoRA as LyCORIS ≤ 2.x stored it (transposed factors, linear layers only)."""
    if layer.kind != "linear":
        return None
    new = _glora(layer, rank, draw, strength)
    return {
        "a1.weight": new["a2.weight"],
        "a2.weight": new["a1.weight"],
        "b1.weight": new["b2.weight"],
        "b2.weight": new["b1.weight"],
    }


def _dora(axis: str) -> Callable[[Layer, int, Draw, float], Tensors | None]:
    """LoRA plus a `dora_scale` per output row (`out`) or per input column (legacy `in`)."""

    def build(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
        tensors = _lora(layer, rank, draw, strength)
        if tensors is None:
            return None
        dims = tuple(d for d in range(layer.weight.dim()) if d != (0 if axis == "out" else 1))
        norm = torch.linalg.vector_norm(layer.weight, dim=dims, keepdim=True)
        tensors["dora_scale"] = norm * (1 + 0.5 * strength * torch.tanh(draw(*norm.shape)))
        return tensors

    return build


def _full(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    out = {"diff": draw(*layer.weight.shape) * layer.amp(strength)}
    if layer.bias is not None:
        out["diff_b"] = draw(*layer.bias.shape) * _bias_amp(layer, strength)
    return out


def _bias_amp(layer: Layer, strength: float) -> float:
    rms = float(layer.bias.pow(2).mean().sqrt())
    return strength * (rms if rms > 0 else float(layer.weight.pow(2).mean().sqrt()))


def _norm(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    if layer.kind != "norm":
        return None
    out = {"w_norm": draw(*layer.weight.shape) * layer.amp(strength)}
    if layer.bias is not None:
        out["b_norm"] = draw(*layer.bias.shape) * _bias_amp(layer, strength)
    return out


def _ia3(on_input: bool) -> Callable[[Layer, int, Draw, float], Tensors | None]:
    def build(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
        if not _weighty(layer):
            return None
        shape = (1, layer.in_dim) if on_input else (layer.out_dim, 1)
        return {"weight": draw(*shape, *layer.ones) * strength, "on_input": torch.tensor(int(on_input))}

    return build


def _oft(layer: Layer, rank: int, draw: Draw, strength: float) -> Tensors | None:
    """Diagonal OFT with blocks of up to 2·rank rows; R ≈ I + 2Q for small blocks."""
    if not _weighty(layer):
        return None
    size = max(d for d in range(1, 2 * rank + 1) if layer.out_dim % d == 0)
    if size == 1:
        return None  # a 1×1 skew block is zero: nothing to rotate
    sigma = strength / (2 * math.sqrt(2 * size))
    return {"oft_blocks": draw(layer.out_dim // size, size, size) * sigma}


@dataclass(frozen=True)
class Algorithm:
    """One entry of the table: its per-layer builder and whether files of it carry `alpha`."""

    build: Callable[[Layer, int, Draw, float], Tensors | None]
    alpha: bool = True


ALGORITHMS: dict[str, Algorithm] = {
    "lora": Algorithm(_lora),
    "lora_tucker": Algorithm(_lora_tucker),
    "loha": Algorithm(_loha),
    "loha_tucker": Algorithm(_loha_tucker),
    "lokr": Algorithm(_lokr),
    "lokr_factorised": Algorithm(_lokr_factorised),
    "lokr_tucker": Algorithm(_lokr_tucker),
    "glora": Algorithm(_glora),
    "glora_old": Algorithm(_glora_old),
    "dora": Algorithm(_dora("out")),
    "dora_in": Algorithm(_dora("in")),
    "full": Algorithm(_full, alpha=False),
    "norm": Algorithm(_norm, alpha=False),
    "ia3": Algorithm(_ia3(False), alpha=False),
    "ia3_in": Algorithm(_ia3(True), alpha=False),
    "oft": Algorithm(_oft, alpha=False),
}


# --------------------------------------------------------------------------------------- layouts
_KOHYA_TE = {name: {te.component: te.lora_prefix for te in fam.text_encoders} for name, fam in FAMILIES.items()}
_PEFT_TE = {arch: {c: f"{c}." for c in comps[1:]} for arch, comps in _COMPONENTS.items()}
_PEFT_SUFFIXES = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight",
                  "dora_scale": "lora_magnitude_vector"}


@dataclass(frozen=True)
class Layout:
    """How one trainer spells an adapter's keys.

    `unet_names`: "diffusers" module paths, "ldm" block names, or "arch" — LDM names on SDXL and
    diffusers names on SD1.5, which is what kohya's sd-scripts write. `peft`: dotted paths and
    PEFT suffixes (`lora_A`/`lora_B`, a 1-D `lora_magnitude_vector`); PEFT keeps alpha in its
    adapter_config.json, so its files hold none and ΔW is unscaled.
    """

    name: str
    unet_prefix: str
    te_prefixes: Mapping[str, Mapping[str, str]]
    unet_names: str = "diffusers"
    peft: bool = False

    def uses_ldm(self, arch: str) -> bool:
        return self.unet_names == "ldm" or (self.unet_names == "arch" and arch == "sdxl")

    def layer_key(self, component: str, name: str, arch: str) -> str:
        denoiser = FAMILIES[arch].denoiser
        own = self.unet_prefix.format(denoiser=denoiser)
        prefix = own if component == denoiser else self.te_prefixes[arch][component]
        return prefix + (name if self.peft else name.replace(".", "_"))

    def stored(self, tensors: Tensors) -> Tensors:
        """One layer's tensors as this layout stores them, still under kohya suffixes."""
        if not self.peft:
            return dict(tensors)
        unsupported = sorted(set(tensors) - set(_PEFT_SUFFIXES) - {"alpha"})
        if unsupported:
            raise ValueError(f"the PEFT layout holds LoRA and DoRA only; cannot store {unsupported}")
        out = {k: v for k, v in tensors.items() if k != "alpha"}
        if "dora_scale" in out:
            if out["dora_scale"].shape[0] == 1:
                raise ValueError("PEFT stores DoRA magnitudes per output row; use the 'dora' algorithm")
            out["dora_scale"] = out["dora_scale"].reshape(-1)
        return out

    def file_keys(self, layer_key: str, stored: Tensors) -> Tensors:
        if self.peft:
            return {f"{layer_key}.{_PEFT_SUFFIXES[s]}": t for s, t in stored.items()}
        return {f"{layer_key}.{s}": t for s, t in stored.items()}


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("kohya", "lora_unet_", _KOHYA_TE, unet_names="arch"),
        Layout("kohya_ldm", "lora_unet_", _KOHYA_TE, unet_names="ldm"),
        Layout("kohya_diffusers", "lora_unet_", _KOHYA_TE),
        Layout("lycoris", "lycoris_", _KOHYA_TE),
        Layout("peft", "{denoiser}.", _PEFT_TE, peft=True),
    )
}


# ---------------------------------------------------------------------------------------- writer
@dataclass(frozen=True, eq=False)
class SyntheticAdapter:
    """A written adapter: the file's tensors by key, and the same tensor objects by target module
    under kohya/LyCORIS suffixes (what a test needs to compute the expected weights)."""

    path: Path
    tensors: Tensors
    layers: dict[Target, Tensors]
    metadata: dict[str, str]


def _kind(module: torch.nn.Module) -> str | None:
    return next((kind for cls, kind in _KINDS if isinstance(module, cls)), None)


def _trainer_path(component: torch.nn.Module, path: str) -> str:
    """A text-encoder module path as trainers spell it (transformers 4.x kept a `text_model.` level)."""
    has_level = any(name == "text_model" for name, _ in component.named_children())
    return path if has_level else f"text_model.{path}"


def _targets(pipe, arch: str, patterns: Sequence[str]):
    """(component, path, module, kind) of every adapter-able module matching a pattern, in model order."""
    for component in _COMPONENTS[arch]:
        for path, module in getattr(pipe, component).named_modules():
            kind = _kind(module)
            if kind and any(fnmatch.fnmatchcase(f"{component}.{path}", p) for p in patterns):
                yield component, path, module, kind


def build_layers(pipe, arch: str, algo: str, *, targets: Sequence[str] = DEFAULT_TARGETS, rank: int = 4,
                 seed: int = 0, alpha: float | None = None, strength: float = 0.5) -> dict[Target, Tensors]:
    """Float32 tensors of `algo` for every matching layer it applies to, by (component, path).

    `alpha` is stored for the algorithms that have one (None: no `alpha` key, i.e. scale 1).
    """
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algo!r}; choose one of {sorted(ALGORITHMS)}")
    algorithm = ALGORITHMS[algo]
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator)

    layers = {}
    for component, path, module, kind in _targets(pipe, arch, targets):
        bias = getattr(module, "bias", None)
        layer = Layer(kind, module.weight.detach().float().cpu(), None if bias is None else bias.detach().float().cpu())
        tensors = algorithm.build(layer, rank, draw, strength)
        if tensors is None:
            continue
        if alpha is not None and algorithm.alpha:
            tensors["alpha"] = torch.tensor(float(alpha))
        layers[(component, path)] = tensors
    if not layers:
        raise ValueError(f"{algo}: none of the targets {list(targets)} is a layer it applies to")
    return layers


_BASE_MODELS = {"sd15": ("sd_v1", "stable-diffusion-v1"), "sdxl": ("sdxl_base_v1-0", "stable-diffusion-xl-v1-base"),
                "flux-dev": ("flux1", "flux-1-dev"), "flux-schnell": ("flux1", "flux-1-schnell")}


def adapter_metadata(arch: str, algo: str, rank: int, alpha: float | None) -> dict[str, str]:
    """kohya/LyCORIS-style training metadata: base model (what tools read the architecture from),
    network module and arguments."""
    version, spec = _BASE_MODELS[arch]
    plain = algo in ("lora", "dora")
    return {
        "ss_base_model_version": version,
        "modelspec.architecture": f"{spec}/{'lora' if plain else 'lycoris'}",
        "ss_network_module": "networks.lora" if plain else "lycoris.kohya",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(rank if alpha is None else alpha),
        "ss_network_args": json.dumps({"algo": algo}),
    }


def tag_frequency(trigger: str) -> str:
    """kohya's `ss_tag_frequency` (dataset folder -> caption tag counts), where UIs find trigger words."""
    return json.dumps({f"10_{trigger}": {trigger: 24, "scenery": 7}})


def write_adapter(path: Path, pipe, arch: str, algo: str = "lora", layout: str = "kohya",
                  dtype: torch.dtype = torch.float32, *, targets: Sequence[str] = DEFAULT_TARGETS, rank: int = 4,
                  seed: int = 0, alpha: float | None = None, strength: float = 0.5,
                  metadata: Mapping[str, str] | None = None) -> SyntheticAdapter:
    """Write a `.safetensors` adapter of `algo` in `layout` with floating tensors in `dtype`.

    See `build_layers` for the arguments shaping the tensors; `metadata` is merged over
    `adapter_metadata(...)`. Returns what was written, tensors exactly as stored.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {sorted(LAYOUTS)}")
    spelling, ldm_names = LAYOUTS[layout], None
    if spelling.uses_ldm(arch):
        ldm_names = unet_module_map(pipe.unet)
    tensors, layers = {}, {}
    built = build_layers(pipe, arch, algo, targets=targets, rank=rank, seed=seed, alpha=alpha, strength=strength)
    for (component, module_path), raw in built.items():
        stored = {k: v.to(dtype) if v.is_floating_point() else v for k, v in spelling.stored(raw).items()}
        if component == FAMILIES[arch].denoiser:
            name = ldm_names[module_path] if ldm_names is not None else module_path
        else:
            name = _trainer_path(getattr(pipe, component), module_path)
        layers[(component, module_path)] = stored
        tensors.update(spelling.file_keys(spelling.layer_key(component, name, arch), stored))
    written = {**adapter_metadata(arch, algo, rank, alpha), **(metadata or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=written)
    return SyntheticAdapter(path, tensors, layers, written)


# ------------------------------------------------------------------------------------- demo LoRAs
_STYLE_TARGETS = ("unet.*attn[12].to_[qkv]", "unet.*attn[12].to_out.0", "unet.*attentions.*.proj_[io]*",
                  "transformer.*attn.to_[qkv]", "transformer.*attn.to_out.0", "transformer.*attn.add_[qkv]_proj",
                  "text_encoder*.self_attn.*_proj", "text_encoder*.mlp.fc[12]")
_DETAIL_TARGETS = ("unet.*resnets.*.conv[12]", "unet.*resnets.*.time_emb_proj", "unet.*samplers.0.conv",
                   "transformer.*ff.net.*", "transformer.*ff_context.net.*", "transformer.*proj_mlp")
# (name suffix, trigger word, targets, strength, seed)
_DEMO_LORAS = (
    ("demo-style", "steadystyle", _STYLE_TARGETS, 1.0, 11),
    ("demo-detail", "steadydetail", _DETAIL_TARGETS, 0.6, 12),
)


def write_demo_loras(lora_dir: Path, pipe, arch: str) -> list[Path]:
    """The demo's LoRAs for one architecture (the `lora_writer` hook of `app.demo.write_demo`).

    Plain kohya LoRAs in fp16 with training metadata and a trigger word each: `demo-style-<arch>`
    on attention and text-encoder layers, `demo-detail-<arch>` a LoCon on the UNet's resnet convs.
    """
    paths = []
    for stem, trigger, targets, strength, seed in _DEMO_LORAS:
        path = Path(lora_dir) / f"{stem}-{arch}.safetensors"
        write_adapter(path, pipe, arch, "lora", "kohya", torch.float16, targets=targets, rank=4, seed=seed,
                      alpha=4.0, strength=strength,
                      metadata={"ss_tag_frequency": tag_frequency(trigger), "ss_output_name": path.stem})
        paths.append(path)
    return paths


def adapter_state_digests(pipe) -> dict[str, str]:
    """sha256 of every UNet and text-encoder tensor (all an adapter may change), by component.key.

    Tests compare these before and after a refused or undone adapter: equal digests mean
    bit-identical weights, whatever the dtype or device.
    """
    digests = {}
    for component in dict.fromkeys(c for fam in FAMILIES.values() for c in fam.components):
        module = getattr(pipe, component, None)
        for key, tensor in ({} if module is None else module.state_dict()).items():
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            digests[f"{component}.{key}"] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return digests
