"""Synthetic adapter files for a given pipeline: every algorithm, key layout and dtype we load.

Tests need adapter files whose every tensor they know, in the spellings real trainers write
(kohya, LyCORIS, PEFT/diffusers), for the tiny pipelines of `app.demo`; the demo needs a few
LoRAs that visibly change its images. Both come from one table-driven generator: an *algorithm*
(app/adapters/synthetic_algos.py) builds one layer's tensors, a *layout* (`Layout`) spells layer
keys and suffixes the way one trainer does. Text-encoder keys are spelled as trainers write them, from the
transformers 4.x module tree (`text_model.encoder.…`), whatever the installed transformers calls
the module.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from app.adapters.synthetic_algos import ALGORITHMS, LAYER_KINDS, Layer, Tensors
from app.families import FAMILIES, family
from app.families.ldm_layout import unet_module_map

__all__ = [
    "ALGORITHMS",
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

# --------------------------------------------------------------------------------------- layouts
def _kohya_te(family_name: str, component: str) -> str:
    return family(family_name).kohya_prefix(component)


def _peft_te(_family_name: str, component: str) -> str:
    return f"{component}."


_PEFT_SUFFIXES = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight",
                  "dora_scale": "lora_magnitude_vector"}


@dataclass(frozen=True)
class Layout:
    """How one trainer spells an adapter's keys.

    `unet_names`: "diffusers" module paths, "ldm" block names, or "family" — LDM names on SDXL and
    diffusers names on SD1.5, which is what kohya's sd-scripts write. `peft`: dotted paths and
    PEFT suffixes (`lora_A`/`lora_B`, a 1-D `lora_magnitude_vector`); PEFT keeps alpha in its
    adapter_config.json, so its files hold none and ΔW is unscaled.
    """

    name: str
    unet_prefix: str
    te_prefix: Callable[[str, str], str]  # (family, text-encoder component) -> key prefix
    unet_names: str = "diffusers"
    peft: bool = False

    def uses_ldm(self, family_name: str) -> bool:
        """LDM block names: always for "ldm"; for "family", where kohya writes them (`Adapters.kohya_ldm_names`)."""
        return self.unet_names == "ldm" or (self.unet_names == "family"
                                            and family(family_name).adapters.kohya_ldm_names)

    def layer_key(self, component: str, name: str, family_name: str) -> str:
        denoiser = family(family_name).denoiser
        own = self.unet_prefix.format(denoiser=denoiser)
        prefix = own if component == denoiser else self.te_prefix(family_name, component)
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
        Layout("kohya", "lora_unet_", _kohya_te, unet_names="family"),
        Layout("kohya_ldm", "lora_unet_", _kohya_te, unet_names="ldm"),
        Layout("kohya_diffusers", "lora_unet_", _kohya_te),
        Layout("lycoris", "lycoris_", _kohya_te),
        Layout("peft", "{denoiser}.", _peft_te, peft=True),
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
    return next((kind for cls, kind in LAYER_KINDS if isinstance(module, cls)), None)


def _trainer_path(component: torch.nn.Module, path: str) -> str:
    """A text-encoder module path as trainers spell it (transformers 4.x kept a `text_model.` level)."""
    has_level = any(name == "text_model" for name, _ in component.named_children())
    return path if has_level else f"text_model.{path}"


def _targets(pipe, family_name: str, patterns: Sequence[str]):
    """(component, path, module, kind) of every adapter-able module matching a pattern, in model order."""
    for component in family(family_name).components:
        for path, module in getattr(pipe, component).named_modules():
            kind = _kind(module)
            if kind and any(fnmatch.fnmatchcase(f"{component}.{path}", p) for p in patterns):
                yield component, path, module, kind


def build_layers(pipe, family_name: str, algo: str, *, targets: Sequence[str] | None = None, rank: int = 4,
                 seed: int = 0, alpha: float | None = None, strength: float = 0.5) -> dict[Target, Tensors]:
    """Float32 tensors of `algo` for every matching layer it applies to, by (component, path).

    `targets` None: the family's spread (`TestKit.lora_targets`). `alpha` is stored for the
    algorithms that have one (None: no `alpha` key, i.e. scale 1).
    """
    targets = family(family_name).test_kit.lora_targets if targets is None else targets
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algo!r}; choose one of {sorted(ALGORITHMS)}")
    algorithm = ALGORITHMS[algo]
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator)

    layers = {}
    for component, path, module, kind in _targets(pipe, family_name, targets):
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


def adapter_metadata(family_name: str, algo: str, rank: int, alpha: float | None) -> dict[str, str]:
    """kohya/LyCORIS-style training metadata: base model (what tools read the architecture from:
    the family's first two `adapter_markers`), network module and arguments."""
    version, spec = family(family_name).adapters.markers[:2]
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


def write_adapter(path: Path, pipe, family_name: str, algo: str = "lora", layout: str = "kohya",
                  dtype: torch.dtype = torch.float32, *, targets: Sequence[str] | None = None, rank: int = 4,
                  seed: int = 0, alpha: float | None = None, strength: float = 0.5,
                  metadata: Mapping[str, str] | None = None) -> SyntheticAdapter:
    """Write a `.safetensors` adapter of `algo` in `layout` with floating tensors in `dtype`.

    See `build_layers` for the arguments shaping the tensors; `metadata` is merged over
    `adapter_metadata(...)`. Returns what was written, tensors exactly as stored.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {sorted(LAYOUTS)}")
    spelling, ldm_names = LAYOUTS[layout], None
    if spelling.uses_ldm(family_name):
        ldm_names = unet_module_map(pipe.unet)
    tensors, layers = {}, {}
    built = build_layers(pipe, family_name, algo, targets=targets, rank=rank, seed=seed, alpha=alpha, strength=strength)
    for (component, module_path), raw in built.items():
        stored = {k: v.to(dtype) if v.is_floating_point() else v for k, v in spelling.stored(raw).items()}
        if component == family(family_name).denoiser:
            name = ldm_names[module_path] if ldm_names is not None else module_path
        else:
            name = _trainer_path(getattr(pipe, component), module_path)
        layers[(component, module_path)] = stored
        tensors.update(spelling.file_keys(spelling.layer_key(component, name, family_name), stored))
    written = {**adapter_metadata(family_name, algo, rank, alpha), **(metadata or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=written)
    return SyntheticAdapter(path, tensors, layers, written)


# ------------------------------------------------------------------------------------- demo LoRAs
# (name suffix, trigger word, which of the family's `demo_lora_targets`, strength, seed)
_DEMO_LORAS = (
    ("demo-style", "steadystyle", 0, 1.0, 11),
    ("demo-detail", "steadydetail", 1, 0.6, 12),
)


def write_demo_loras(lora_dir: Path, pipe, family_name: str) -> list[Path]:
    """The demo's LoRAs for one architecture (the `lora_writer` hook of `app.demo.write_demo`).

    Plain kohya LoRAs in fp16 with training metadata and a trigger word each: `demo-style-<family>`
    on attention and text-encoder layers, `demo-detail-<family>` a LoCon on the UNet's resnet convs.
    """
    paths = []
    for stem, trigger, which, strength, seed in _DEMO_LORAS:
        path = Path(lora_dir) / f"{stem}-{family_name}.safetensors"
        targets = family(family_name).test_kit.demo_lora_targets[which]
        write_adapter(path, pipe, family_name, "lora", "kohya", torch.float16, targets=targets, rank=4, seed=seed,
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
