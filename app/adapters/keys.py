"""Adapter key names -> the loaded model's modules, through a table built from the model itself.

Why a table: kohya names replace every `.` of a module path with `_`, and module names contain
`_` themselves (`to_q`, `proj_in`, `transformer_blocks`), so splitting a key on `_` guesses.
Instead we enumerate the model's own module paths, spell each one every way a tool writes it and
look keys up exactly. The spellings (each tagged, so a report can say which layout a file uses):

* kohya / sd-scripts: `lora_unet_` + the path with `_` (diffusers names, or the family's native
  names: LDM block names as sd-scripts writes them for SDXL, BFL names for Flux), `lora_te_`/
  `lora_te1_` for the first text encoder (diffusers' `convert_state_dict_to_kohya` writes
  `lora_te1_` even for SD1.5), then the family's prefix for each encoder (`lora_te2_`, Flux's
  T5 `lora_te3_` as sd-scripts writes it) and `lora_te<i>_` for the i-th encoder, as OneTrainer
  numbers them (Flux's T5 `lora_te2_`; ComfyUI and Forge read both); OneTrainer's
  `lora_transformer_` for a DiT's diffusers names;
* ComfyUI: a text-encoder layer by its name in the family's all-in-one single file, dotted
  (`text_encoders.clip_l.transformer.text_model.…`, `text_encoders.t5xxl.transformer.encoder.…`
  on Flux), where that file keeps transformers' names (not SDXL's OpenCLIP layout);
* LyCORIS: `lycoris_` + the UNet path with `_`;
* diffusers / PEFT: dotted paths behind `unet.`/`text_encoder.`/`text_encoder_2.`, or bare
  (PEFT's own `save_pretrained`, after `base_model.model.`); a bare text-encoder path is the same
  in both SDXL encoders and so resolves nowhere there;
* diffusers' legacy attention processors: `attn1.processor.to_q_lora.down.weight` in the UNet and
  `self_attn.to_q_lora.down.weight` (for `q_proj`) in the text encoders, `to_out_lora` for the
  output projection.

Text-encoder paths are spelled with and without transformers' `text_model.` level (transformers
>= 5.6 dropped it from `CLIPTextModel`; trainers and older files still write it).

Native names come from the family (`Adapters.native_modules`): each is a key with its *parts*, the
model modules it covers and, for a fused file module (Flux's `img_attn.qkv` = `to_q`, `to_k`,
`to_v`), the rows of the fused weight each one is. A key whose parts are several modules is split
by `app.adapters.matching` into one adapter per module, each holding exactly its rows.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from app.adapters.algos import SUFFIXES
from app.families import family
from app.families.file_layout import Rows
from app.families.ldm_layout import LYCORIS

log = logging.getLogger(__name__)

Target = tuple[str, str]  # (component, module path)
Parts = tuple[tuple[Target, Rows | None], ...]  # the modules one adapter layer covers, with their rows

# Spelling tags, as the per-file report names them.
KOHYA = "kohya"
DIFFUSERS = "diffusers/PEFT"
SINGLE_FILE = "ComfyUI (single-file names)"
PEFT_BARE = "PEFT (bare module names)"
LEGACY = "diffusers legacy attention processors"
DOTTED_SPELLINGS = frozenset({DIFFUSERS, PEFT_BARE, LEGACY})

# Key prefixes that name a component, for every family we know of (also those we do not load:
# a file addressing a component the model lacks is made for another model).
COMPONENT_PREFIXES: dict[str, tuple[str, ...]] = {
    "unet": ("lora_unet_", "lycoris_", "unet."),
    "text_encoder": ("lora_te_", "lora_te1_", "text_encoder."),
    "text_encoder_2": ("lora_te2_", "text_encoder_2."),
    "text_encoder_3": ("lora_te3_", "text_encoder_3."),
    "transformer": ("lora_transformer_", "transformer.", "diffusion_model.", "lora_unet_double_blocks_",
                    "lora_unet_single_blocks_"),
}
_FIRST_TE_PREFIXES = ("lora_te_", "lora_te1_")  # every trainer's spelling of the first text encoder

_PEFT_MAGNITUDE = "lora_magnitude_vector"
# File suffixes other tools write -> the kohya/LyCORIS suffix the algorithms read, with the style
# tag the report shows. Matched longest first against the end of a key.
_SUFFIX_SPELLINGS: dict[str, tuple[str, str]] = {
    ".lora_A.weight": ("lora_down.weight", "lora_A/lora_B"),
    ".lora_B.weight": ("lora_up.weight", "lora_A/lora_B"),
    ".lora_B.bias": ("lora_up.bias", "lora_A/lora_B"),
    # PEFT's own parameter names (`lora_A.default.weight`), as trainers that save `named_parameters()` write them
    ".lora_A.default.weight": ("lora_down.weight", "lora_A/lora_B (PEFT adapter 'default')"),
    ".lora_B.default.weight": ("lora_up.weight", "lora_A/lora_B (PEFT adapter 'default')"),
    ".lora.down.weight": ("lora_down.weight", "lora.down/lora.up"),
    ".lora.up.weight": ("lora_up.weight", "lora.down/lora.up"),
    ".lora_linear_layer.down.weight": ("lora_down.weight", "lora_linear_layer"),
    ".lora_linear_layer.up.weight": ("lora_up.weight", "lora_linear_layer"),
    "_lora.down.weight": ("lora_down.weight", "to_q_lora.down"),
    "_lora.up.weight": ("lora_up.weight", "to_q_lora.down"),
    ".lora_magnitude_vector": ("dora_scale", _PEFT_MAGNITUDE),
    ".lora_magnitude_vector.weight": ("dora_scale", _PEFT_MAGNITUDE),
    # xlabs' Flux LoRAs: `double_blocks.0.processor.qkv_lora1.down.weight`
    ".down.weight": ("lora_down.weight", "down/up"),
    ".up.weight": ("lora_up.weight", "down/up"),
    # IA3's bare `weight` is left out: after a dotted module path it is a full weight.
    **{f".{s}": (s, "") for s in SUFFIXES - {"weight"}},
}
_SUFFIXES_LONGEST_FIRST = sorted(_SUFFIX_SPELLINGS, key=len, reverse=True)
_PEFT_ROOT = "base_model.model."
_ATTENTION_PROJ = re.compile(r"(.*\.attn\d)\.(to_q|to_k|to_v|to_out\.0)$")
_TEXT_ATTENTION_PROJ = re.compile(r"(.*\.self_attn)\.(q|k|v|out)_proj$")


@dataclass(frozen=True)
class SplitKey:
    """One tensor key cut into its layer key and the normalised suffix, with the suffix style."""

    layer: str
    suffix: str
    style: str


def split_key(key: str) -> SplitKey:
    """The layer a tensor belongs to and its suffix under the name the algorithms use."""
    for tail in _SUFFIXES_LONGEST_FIRST:
        if key.endswith(tail) and len(key) > len(tail):
            suffix, style = _SUFFIX_SPELLINGS[tail]
            return SplitKey(key[: -len(tail)].removeprefix(_PEFT_ROOT), suffix, style)
    layer, _, suffix = key.partition(".")
    return SplitKey(layer, suffix, "")


def component_named(layer: str) -> str | None:
    """The component a layer key's prefix names (None for bare paths)."""
    for component, prefixes in COMPONENT_PREFIXES.items():
        if layer.startswith(prefixes):
            return component
    return None


@dataclass(frozen=True)
class LayerGroup:
    """Tensors of one adapter layer, matched to a model module (or not), with how it was spelled.

    `file_keys` are the tensor keys as the file wrote them (what an unmatched report lists)."""

    key: str
    target: Target | None
    tensors: dict[str, torch.Tensor] = field(repr=False)
    file_keys: tuple[str, ...] = ()
    spelling: str = ""
    style: str = ""
    parts: Parts = ()  # the modules it covers (one, with rows None, unless the layer is fused)


def _legacy_spellings(path: str) -> list[str]:
    """diffusers' attention-processor names of a module path (empty for other modules)."""
    if match := _ATTENTION_PROJ.match(path):
        parent, proj = match.groups()
        proj = proj.removesuffix(".0")
        names = [f"{parent}.processor.{proj}"]
        return names + [f"{parent}.{proj}"] if proj == "to_out" else names
    if match := _TEXT_ATTENTION_PROJ.match(path):
        return [f"{match[1]}.to_{match[2]}"]
    return []


class KeyTable:
    """Every spelling of every weight-bearing module of a pipeline's denoiser and text encoders."""

    def __init__(self, pipe, family_name: str) -> None:
        fam = family(family_name)
        self.arch = fam.lora_arch
        self.foreign_layers = fam.adapters.foreign_layers
        self.components = frozenset(c for c in fam.components if getattr(pipe, c, None) is not None)
        self._table: dict[str, tuple[Parts, str]] = {}
        ambiguous: set[str] = set()
        for alias, parts, spelling in self._aliases(pipe, fam):
            if alias in self._table and self._table[alias][0] != parts:
                ambiguous.add(alias)
            self._table.setdefault(alias, (parts, spelling))
        for alias in ambiguous:  # two modules spelled alike: refuse to guess between them
            del self._table[alias]
            log.debug("key alias %s is ambiguous; dropped", alias)

    def _aliases(self, pipe, fam):
        denoiser = getattr(pipe, fam.denoiser)
        for path, module in denoiser.named_modules():
            if not path or getattr(module, "weight", None) is None:
                continue
            parts = (((fam.denoiser, path), None),)
            flat = path.replace(".", "_")
            yield f"lora_unet_{flat}", parts, KOHYA
            yield f"lora_{fam.denoiser}_{flat}", parts, KOHYA
            yield f"lycoris_{flat}", parts, LYCORIS
            yield f"{fam.denoiser}.{path}", parts, DIFFUSERS
            yield path, parts, PEFT_BARE
            for legacy in _legacy_spellings(path):
                yield from ((f"{p}{legacy}", parts, LEGACY) for p in (f"{fam.denoiser}.", ""))
        yield from fam.adapters.native_modules(denoiser)
        for number, te in enumerate(fam.text_encoders, start=1):
            if te.component in self.components:
                first = _FIRST_TE_PREFIXES if number == 1 else ()
                kohya = tuple(dict.fromkeys((*first, f"lora_te{number}_", fam.kohya_prefix(te.component))))
                in_files = te.single_file_prefix is not None and not te.open_clip
                dotted = (f"{te.component}.",) + ((te.single_file_prefix,) if in_files else ())
                yield from self._text_encoder_aliases(te.component, getattr(pipe, te.component), kohya, dotted)

    @staticmethod
    def _text_encoder_aliases(comp: str, encoder: torch.nn.Module, kohya_prefixes: tuple[str, ...],
                              dotted_prefixes: tuple[str, ...]):
        for path, module in encoder.named_modules():
            if not path or getattr(module, "weight", None) is None:
                continue
            parts = (((comp, path), None),)
            for spelled in {path, path if path.startswith("text_model.") else f"text_model.{path}"}:
                for prefix in kohya_prefixes:
                    yield f"{prefix}{spelled.replace('.', '_')}", parts, KOHYA
                yield f"lycoris_{spelled.replace('.', '_')}", parts, LYCORIS  # LyCORIS's own wrapper
                for prefix in dotted_prefixes:
                    yield f"{prefix}{spelled}", parts, DIFFUSERS if prefix == f"{comp}." else SINGLE_FILE
                yield spelled, parts, PEFT_BARE
                for legacy in _legacy_spellings(spelled):
                    yield from ((f"{p}{legacy}", parts, LEGACY) for p in (f"{comp}.", ""))

    def group(self, tensors: dict[str, torch.Tensor]) -> list[LayerGroup]:
        """Group an adapter file's tensors by layer and resolve each layer to a module."""
        layers: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        keys: dict[str, list[str]] = defaultdict(list)
        styles: dict[str, str] = {}
        for key, tensor in tensors.items():
            split = split_key(key)
            # PEFT's magnitude is per output row whatever its shape ((1, out, 1, 1) on a conv):
            # flat, it cannot be read as LyCORIS's legacy per-input-column (1, in, …) layout.
            flat = split.style == _PEFT_MAGNITUDE and tensor.dim() > 1
            layers[split.layer][split.suffix] = tensor.reshape(-1) if flat else tensor
            keys[split.layer].append(key)
            styles[split.layer] = styles.get(split.layer) or split.style
        groups = []
        for layer, tensors_of_layer in layers.items():
            parts, spelling = self._table.get(layer, ((), ""))
            target = parts[0][0] if parts else None
            groups.append(LayerGroup(layer, target, tensors_of_layer, tuple(keys[layer]), spelling, styles[layer],
                                     parts))
        return groups
