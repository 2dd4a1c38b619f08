"""The scale a PEFT-trained LoRA was trained with, read from its config, as a per-layer `alpha`.

PEFT keeps alpha out of the tensors: ΔW = (lora_alpha / r)·B·A (rsLoRA: lora_alpha / √r), with
per-module overrides in `rank_pattern`/`alpha_pattern`. The config travels as JSON, either

* in the safetensors metadata under `lora_adapter_metadata`: diffusers' pipeline
  `save_lora_weights(..., unet_lora_adapter_metadata=...)` prefixes each field with the component
  (`unet.lora_alpha`, `text_encoder.r`), a model's `save_lora_adapter` writes it unprefixed; or
* in `adapter_config.json` beside the file (PEFT's own `save_pretrained`), see `files.py`.

A file read without it lands at r/lora_alpha of its strength (lora_alpha=8, r=4: exactly half),
silently. The algorithms are not told about PEFT: the scale becomes an `alpha` scalar injected
into the layer's tensors, alpha_eff = scale·rank, since they compute s = alpha / rank.

Options that change what the adapter computes beyond W + s·B·A (another PEFT method, full
replacement weights, initialisations that subtract the initial adapter from the base weights,
routing, token-conditional activation) are refused by name: fusing them as a plain LoRA would be
wrong without any visible error.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from app.adapters.errors import AdapterFormatError
from app.adapters.files import AdapterFile
from app.adapters.keys import COMPONENT_PREFIXES, LayerGroup

METADATA_KEY = "lora_adapter_metadata"
# PEFT's LoraConfig defaults, for configs that leave a field out.
_DEFAULT_R = 8
_DEFAULT_ALPHA = 8
# Fields whose presence (truthy) means the adapter is not W + s·B·A on the listed modules.
_VARIANT_FIELDS = ("modules_to_save", "trainable_token_indices", "fan_in_fan_out", "layer_replication",
                   "alora_invocation_tokens", "use_qalora", "use_bdlora", "arrow_config", "kasa_config",
                   "velora_config", "monteclora_config", "lora_ga_config", "target_parameters")
# Initialisations that move part of W into the adapter: the file is relative to a residual base.
_RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq")


def _pattern_value(patterns: Mapping[str, object], names: Iterable[str], default):
    """PEFT's per-module override: the first pattern that matches a whole dotted suffix of a name."""
    names = tuple(names)
    for pattern, value in patterns.items():
        if any(re.fullmatch(rf"(?:.*\.)?(?:{pattern})", name) for name in names):
            return value
    return default


@dataclass(frozen=True)
class PeftLoraConfig:
    """The fields of one LoraConfig that decide the scale, and where they were read."""

    r: int
    lora_alpha: float
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool | None = None
    source: str = "metadata"

    @classmethod
    def from_dict(cls, config: Mapping, source: str, where: str) -> PeftLoraConfig:
        """Validate one config dict; refuse (naming the option) anything beyond plain LoRA/DoRA."""
        if not isinstance(config, Mapping):
            raise AdapterFormatError(f"{where}: PEFT config must be a JSON object, got {type(config).__name__}")
        peft_type = str(config.get("peft_type") or "LORA").upper()
        if peft_type != "LORA":
            raise AdapterFormatError(f"{where}: PEFT adapter type {peft_type} is not supported (only LORA); "
                                     "nothing applied")
        for name in _VARIANT_FIELDS:
            if config.get(name):
                raise AdapterFormatError(f"{where}: PEFT option {name}={config[name]!r} makes it more than "
                                         "W + scale·B·A; not supported, nothing applied")
        if str(config.get("bias") or "none") != "none":
            raise AdapterFormatError(f"{where}: PEFT bias={config['bias']!r} trains the base biases, which the "
                                     "file stores whole; not supported, nothing applied")
        init = config.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(_RESIDUAL_INITS):
            raise AdapterFormatError(f"{where}: PEFT init_lora_weights={init!r} trains against a residual base "
                                     "model, so the file does not apply to the original weights; convert it "
                                     "with PEFT's path_initial_model_for_weight_conversion first")
        try:
            return cls(int(config.get("r", _DEFAULT_R)), float(config.get("lora_alpha", _DEFAULT_ALPHA)),
                       {str(k): int(v) for k, v in (config.get("rank_pattern") or {}).items()},
                       {str(k): float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
                       bool(config.get("use_rslora", False)), config.get("use_dora"), source)
        except (TypeError, ValueError, AttributeError) as exc:
            raise AdapterFormatError(f"{where}: malformed PEFT config ({exc})") from None

    def alpha_for(self, layer: str, names: Iterable[str], rank: int) -> float:
        """alpha_eff = scale·rank for one module, after checking the file's rank against the config."""
        names = tuple(names)
        r = int(_pattern_value(self.rank_pattern, names, self.r))
        if r != rank:
            raise AdapterFormatError(f"{layer}: the PEFT config ({self.source}) gives rank {r} but the file's "
                                     f"lora_A has rank {rank}; file and config disagree, nothing applied")
        alpha = float(_pattern_value(self.alpha_pattern, names, self.lora_alpha))
        scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        return scale * rank


def _split_by_component(config: Mapping, source: str, where: str) -> dict[str, PeftLoraConfig]:
    """diffusers' pipeline metadata prefixes each field with its component; other writers do not."""
    components = {key.partition(".")[0] for key in config if "." in key} & COMPONENT_PREFIXES.keys()
    if not components:
        return {"": PeftLoraConfig.from_dict(config, source, where)}
    return {comp: PeftLoraConfig.from_dict({k.partition(".")[2]: v for k, v in config.items()
                                            if k.startswith(f"{comp}.")}, source, f"{where} ({comp})")
            for comp in sorted(components)}


@dataclass(frozen=True)
class PeftScales:
    """PEFT configs of one file by component ("" when one config covers the whole file)."""

    configs: Mapping[str, PeftLoraConfig]

    @classmethod
    def read(cls, file: AdapterFile) -> PeftScales:
        """The file's embedded config, else the `adapter_config.json` beside it, else none."""
        candidates = ((file.metadata.get(METADATA_KEY), "metadata"), (file.sidecar_config, "adapter_config.json"))
        for text, source in candidates:
            if text:
                where = f"{file.path.name}: {source}"
                try:
                    config = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise AdapterFormatError(f"{where} is not valid JSON ({exc})") from None
                return cls(_split_by_component(config, source, where))
        return cls({})

    def with_alpha(self, group: LayerGroup) -> tuple[dict[str, torch.Tensor], str]:
        """The group's tensors with PEFT's scale as `alpha` where the file holds none, and the
        scale's source: "alpha tensor", "metadata", "adapter_config.json" or "absent"."""
        tensors = group.tensors
        if "alpha" in tensors:
            return tensors, "alpha tensor"
        assert group.target is not None
        config = self.configs.get(group.target[0], self.configs.get(""))
        down = tensors.get("lora_down.weight")
        if config is None or down is None:
            return tensors, "absent"
        if config.use_dora is not None and config.use_dora != ("dora_scale" in tensors):
            state = "has no" if config.use_dora else "has a"
            raise AdapterFormatError(f"{group.key}: the PEFT config ({config.source}) says use_dora="
                                     f"{config.use_dora} but the layer {state} magnitude vector; nothing applied")
        alpha = config.alpha_for(group.key, _module_names(group), down.shape[0])
        return {**tensors, "alpha": torch.tensor(alpha, dtype=torch.float32)}, config.source


def _module_names(group: LayerGroup) -> tuple[str, ...]:
    """The names PEFT may have matched its patterns against: the model's path, the trainer's
    (`text_model.` level) spelling, and the file's own dotted name without its component."""
    component, path = group.target
    names = [path, group.key.removeprefix(f"{component}.")]
    if component.startswith("text_encoder") and not path.startswith("text_model."):
        names.append(f"text_model.{path}")
    return tuple(dict.fromkeys(names))
