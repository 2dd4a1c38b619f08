"""Adapter key names -> the loaded model's modules, through a table built from the model itself.

Why a table: kohya names replace every `.` of a module path with `_`, and module names contain
`_` themselves (`to_q`, `proj_in`, `transformer_blocks`), so splitting a key on `_` guesses.
Instead we enumerate the model's own module paths, spell each one every way a trainer may
(kohya `lora_unet_`/`lora_te_`/`lora_te1_`/`lora_te2_`, LyCORIS `lycoris_`, LDM block names for
the UNet, diffusers/PEFT dotted names) and look keys up exactly.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from app.families import family
from app.families.ldm_layout import unet_module_map

log = logging.getLogger(__name__)

# Dotted (diffusers / PEFT) suffixes, normalised to the kohya spelling the algorithms expect.
_DOTTED_SUFFIXES = {
    ".lora_A.weight": "lora_down.weight",
    ".lora_B.weight": "lora_up.weight",
    ".lora.down.weight": "lora_down.weight",
    ".lora.up.weight": "lora_up.weight",
    ".lora_linear_layer.down.weight": "lora_down.weight",
    ".lora_linear_layer.up.weight": "lora_up.weight",
    ".lora_magnitude_vector": "dora_scale",
    ".lora_magnitude_vector.weight": "dora_scale",
    ".alpha": "alpha",
}
_PEFT_ROOT = "base_model.model."

Target = tuple[str, str]  # (component, module path)


def _te_prefixes(arch: str) -> dict[str, str]:
    return {te.component: te.lora_prefix for te in family(arch).text_encoders}


def split_key(key: str) -> tuple[str, str]:
    """(layer key, normalised suffix) of one tensor key."""
    for dotted, suffix in _DOTTED_SUFFIXES.items():
        if key.endswith(dotted) and "." in key[: -len(dotted)]:
            return key[: -len(dotted)].removeprefix(_PEFT_ROOT), suffix
    layer, _, suffix = key.partition(".")
    return layer, suffix


@dataclass(frozen=True)
class LayerGroup:
    """Tensors of one adapter layer, already matched to a model module (or not)."""

    key: str
    target: Target | None
    tensors: dict[str, torch.Tensor] = field(repr=False)


class KeyTable:
    """Every spelling of every weight-bearing module of a pipeline's UNet and text encoders."""

    def __init__(self, pipe, arch: str) -> None:
        self.arch = arch
        self._table: dict[str, Target] = {}
        ambiguous: set[str] = set()
        for alias, target in self._aliases(pipe, arch):
            if alias in self._table and self._table[alias] != target:
                ambiguous.add(alias)
            self._table[alias] = target
        for alias in ambiguous:  # two modules spelled alike: refuse to guess between them
            del self._table[alias]
            log.debug("key alias %s is ambiguous; dropped", alias)

    @staticmethod
    def _aliases(pipe, arch: str):
        unet = pipe.unet
        ldm_names = unet_module_map(unet)
        for path, module in unet.named_modules():
            if not path or getattr(module, "weight", None) is None:
                continue
            yield from ((f"{p}{path.replace('.', '_')}", ("unet", path)) for p in ("lora_unet_", "lycoris_"))
            yield f"unet.{path}", ("unet", path)
            yield path, ("unet", path)
            ldm = ldm_names.get(path)
            if ldm is not None:
                yield from ((f"{p}{ldm.replace('.', '_')}", ("unet", path)) for p in ("lora_unet_", "lycoris_"))
        for comp, prefix in _te_prefixes(arch).items():
            for path, module in getattr(pipe, comp).named_modules():
                if not path or getattr(module, "weight", None) is None:
                    continue
                # transformers >= 5.6 dropped CLIPTextModel's `text_model.` level; trainers still write it.
                for spelled in {path, path if path.startswith("text_model.") else f"text_model.{path}"}:
                    yield f"{prefix}{spelled.replace('.', '_')}", (comp, path)
                    yield f"{comp}.{spelled}", (comp, path)

    def group(self, tensors: dict[str, torch.Tensor]) -> list[LayerGroup]:
        """Group an adapter file's tensors by layer and resolve each layer to a module."""
        layers: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        for key, tensor in tensors.items():
            layer, suffix = split_key(key)
            layers[layer][suffix] = tensor
        return [LayerGroup(layer, self._table.get(layer), parts) for layer, parts in layers.items()]


def architecture_hint(keys, metadata: dict[str, str]) -> str | None:
    """What an adapter was trained for, from its metadata or tell-tale keys (for error messages)."""
    text = (metadata.get("modelspec.architecture", "") + " " + metadata.get("ss_base_model_version", "")).lower()
    if "xl" in text:
        return "sdxl"
    if "v1" in text or "sd_v1" in text or "stable-diffusion-v1" in text:
        return "sd15"
    keys = list(keys)
    if any(k.startswith(("lora_te2_", "lora_te1_", "text_encoder_2.")) or "input_blocks_7_1_transformer_blocks_9" in k
           for k in keys):
        return "sdxl"
    if any(k.startswith("lora_te_") for k in keys):
        return "sd15"
    return None
