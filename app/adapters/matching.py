"""Match one adapter file against a loaded model: which layer each key targets, at what scale,
whether every layer fits, and what is left over, before anything is written.

Why apart from the patcher: deciding *what* a file means for a model (layout, scale, fit) is
read-only work the UI also asks for (`inspect_lora`), while the patcher only writes.

The architecture is decided from what fits, not from a key prefix (`lora_te1_` is what diffusers
writes for SD1.5 too). A file is refused whole, never half-applied, when

* any layer that resolves has the wrong shape for its module;
* it has layers for a component this model lacks (a second text encoder on SD1.5, a transformer);
* its metadata names another architecture and part of it matches nothing here;
* it matches nothing at all;
* less than half of its tensors match, unless the user allows this LoRA to apply in part: such a
  file is usually another model's or a layout we do not read, and applying the rest quietly
  changes the picture in a way nobody trained.

Tensors that match nothing beside layers that fit are not fatal (trainers add layers other
checkpoints lack): they are counted, and the report names the first few (the patcher logs a
warning when such a LoRA is applied).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from app.adapters.algos import Adapter, parse_layer
from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError, LoraApplyError
from app.adapters.files import AdapterFile
from app.adapters.keys import DOTTED_SPELLINGS, KeyTable, LayerGroup, Parts, Target, component_named
from app.adapters.layer_ops import weight_shape
from app.adapters.peft_scale import PeftScales
from app.families import lora_arch_of
from app.families.file_layout import row_index

log = logging.getLogger(__name__)
UNMATCHED_EXAMPLES = 3
_SCALE_SOURCES = {"alpha tensor": "alpha tensors", "metadata": "PEFT metadata (lora_adapter_metadata)",
                  "adapter_config.json": "PEFT adapter_config.json", "absent": "absent (scale 1)"}
# A component only other families have, and the model such a file is made for.
_FOREIGN_COMPONENTS = {"transformer": "a DiT model (Flux, SD3, …)", "text_encoder_3": "SD3", "text_encoder_2": "SDXL"}
# LyCORIS algorithms that cannot be read unambiguously from their tensors, by their `algo` name.
_UNSUPPORTED_ALGOS = {
    "tlora": "a LyCORIS T-LoRA: it was trained with a rank mask that depends on the timestep and that the "
             "sampler must apply at every step; fused as a plain LoRA every rank fires at every step",
    "boft": "a LyCORIS BOFT (butterfly OFT, 4-D oft_blocks): LyCORIS changed how BOFT rotates a weight "
            "between releases (2024-06, 2025-05, 3.3.0), so the file alone does not say which transform "
            "it was trained with",
    "glokr": "a LyCORIS GLoKr: LyCORIS never released it in a stable format (its unfinished version was removed)",
}


@dataclass(frozen=True)
class MatchReport:
    """What one file means for one model: the LoRA card, `inspect_lora` and the counters show it.

    `unmatched_keys` counts the file's tensors (safetensors keys) that reached no module — a
    count in layers hid how much was dropped, since a layer holds two to five tensors — of its
    `total_keys`. `scale_source` says where the layers' scale came from (alpha tensors, PEFT
    metadata or `adapter_config.json`, absent), `fits` the architecture the file fits, `declared`
    the one its metadata names (None when it names none). `partial`: less than half of its tensors
    match, and it was accepted only because the user allows this LoRA to apply in part."""

    matched_layers: int
    unmatched_keys: int
    message: str = ""
    layout: str = ""
    scale_source: str = ""
    unmatched_examples: tuple[str, ...] = ()
    fits: str = ""
    declared: str | None = None
    total_keys: int = 0
    partial: bool = False


@dataclass(frozen=True)
class PreparedAdapter:
    """One adapter file parsed against one model: per target module, its algorithm object."""

    file: AdapterFile
    layers: Mapping[Target, Adapter]
    report: MatchReport

    def to(self, device: torch.device, float32_components: frozenset[str] = frozenset()) -> PreparedAdapter:
        """The same adapter with every layer's tensors on `device` (uploaded once per LoRA), in float32
        for the layers of `float32_components` (see `LoraStack.prepare`)."""
        layers = {target: adapter.to(device, torch.float32 if target[0] in float32_components else None)
                  for target, adapter in self.layers.items()}
        return PreparedAdapter(self.file, layers, self.report)


@dataclass
class _Parsed:
    """What parsing the matched layers found: the adapters, and per layer how it was written."""

    layers: dict[Target, Adapter]
    mismatched: list[str]
    spellings: Counter
    scale_sources: Counter
    redundant: list[str] = field(default_factory=list)  # fused layers whose split layers are in the file too


def match_adapter(name: str, file: AdapterFile, table: KeyTable, module_for: Callable[[Target], torch.nn.Module],
                  *, allow_partial: bool = False) -> PreparedAdapter:
    """Parse and shape-check every layer of `file` against the model `table` was built from;
    raise `LoraApplyError` (naming the LoRA) when it does not fit, before any write. A file of
    which less than half the tensors match fits only with `allow_partial`."""
    groups = table.group(file.tensors)
    try:
        _refuse_unsupported(file)
        parsed = _parse(groups, PeftScales.read(file), module_for)
    except AdapterFormatError as exc:
        raise LoraApplyError(name, str(exc)) from exc
    unmatched = [g for g in groups if g.target is None]
    declared = declared_architecture(file.metadata)
    _check_fit(name, table, parsed, unmatched, declared)
    keys = sorted(k for g in unmatched for k in g.file_keys)
    partial = 2 * len(keys) > len(file.tensors)
    if partial and not allow_partial:
        raise LoraApplyError(name, _partial_refusal(table.arch, keys, len(file.tensors), len(parsed.layers)))
    if keys:
        log.debug("LoRA %s: %d unmatched tensors: %s", name, len(keys), ", ".join(keys))
    report = MatchReport(len(parsed.layers), len(keys),
                         _message(table.arch, keys, len(file.tensors), len(unmatched), declared, parsed.redundant),
                         _layout(parsed.spellings), _scale_source(parsed.scale_sources),
                         tuple(keys[:UNMATCHED_EXAMPLES]), table.arch.upper(), declared, len(file.tensors), partial)
    return PreparedAdapter(file, parsed.layers, report)


def _partial_refusal(arch: str, keys: list[str], total: int, layers: int) -> str:
    return (f"only {total - len(keys)} of its {total} tensors match this {arch.upper()} model ({len(keys)} match "
            f"nothing, e.g. {', '.join(keys[:UNMATCHED_EXAMPLES])}): less than half, so it is likely made for "
            f"another model or written in a layout not read here; nothing applied. Allow partial application "
            f"for this LoRA to apply the {_count(layers, 'layer')} that match")


def _parse(groups: list[LayerGroup], scales: PeftScales,
           module_for: Callable[[Target], torch.nn.Module]) -> _Parsed:
    """Parse every layer that resolved; a malformed layer raises, a misfit is collected. A fused layer
    (a fused `qkv`) whose every part the file also holds as a layer of its own is the same LoRA
    written twice (some trainers do): the split layers are read, as diffusers reads them, and the
    report says so; one module named twice otherwise is ambiguous and refused."""
    parsed = _Parsed({}, [], Counter(), Counter())
    owners: dict[Target, str] = {}
    split = {g.parts[0][0] for g in groups if g.target is not None and len(g.parts) == 1}
    for group in groups:
        if group.target is None:
            continue
        if len(group.parts) > 1 and all(target in split for target, _rows in group.parts):
            parsed.redundant.append(group.key)
            continue
        for target, _rows in group.parts:
            if target in owners:
                raise AdapterFormatError(f"layers {owners[target]} and {group.key} both target "
                                         f"{target[0]}.{target[1]}; the file is ambiguous")
            owners[target] = group.key
        if group.spelling in DOTTED_SPELLINGS and "weight" in group.tensors:
            raise AdapterFormatError(f"{group.key}: a whole module weight (PEFT modules_to_save?) is not an "
                                     "adapter; not supported, nothing applied")
        tensors, source = scales.with_alpha(group)
        try:
            adapter = parse_layer(group.key, tensors)
            layers = _split(adapter, group.parts, module_for)
        except IncompatibleAdapterError as exc:
            parsed.mismatched.append(str(exc))
            continue
        parsed.layers.update(layers)
        parsed.spellings[(group.spelling, group.style)] += 1
        if source != "absent" or adapter.rank is not None:
            parsed.scale_sources[source] += 1
    return parsed


def _split(adapter: Adapter, parts: Parts, module_for: Callable[[Target], torch.nn.Module]) -> dict[Target, Adapter]:
    """One adapter per target module. A layer spelled with a fused file module (Flux's `img_attn.qkv`)
    is checked against the fused weight, (Σ part rows, in…), then cut into each part's rows."""
    weights = [weight_shape(module_for(target)) for target, _rows in parts]
    if len(parts) == 1 and parts[0][1] is None:
        adapter.validate_against(tuple(weights[0]))
        return {parts[0][0]: adapter}
    fused_rows = max(stop for _target, rows in parts for _start, stop in rows)
    adapter.validate_against((fused_rows, *weights[0][1:]))
    split = {}
    for (target, rows), shape in zip(parts, weights, strict=True):
        part = adapter.rows(row_index(rows))
        part.validate_against(tuple(shape))
        split[target] = part
    return split


def _refuse_unsupported(file: AdapterFile) -> None:
    """Refuse by name the LyCORIS algorithms whose files cannot be fused correctly."""
    algos = _trainer_algos(file.metadata)
    if any(k.endswith(".oft_blocks") and t.dim() == 4 for k, t in file.tensors.items()):
        algos.add("boft")
    unsupported = sorted(algos & _UNSUPPORTED_ALGOS.keys())
    if unsupported:
        raise AdapterFormatError(f"is {_UNSUPPORTED_ALGOS[unsupported[0]]}; not supported, nothing applied")


def _trainer_algos(metadata: Mapping[str, str]) -> set[str]:
    """The `algo`s a kohya (`ss_network_args`) or SimpleTuner (`lycoris_config`) run recorded."""
    algos = set()
    for key in ("ss_network_args", "lycoris_config"):
        try:
            args = json.loads(metadata.get(key) or "{}")
        except json.JSONDecodeError:
            continue
        if isinstance(args, dict) and args.get("algo"):
            algos.add(str(args["algo"]).lower().replace("-", "").replace("_", ""))
    return algos


def declared_architecture(metadata: Mapping[str, str]) -> str | None:
    """The LoRA architecture a file's training metadata names (modelspec / kohya), or None: the
    families' `adapter_markers` and the foreign ones (`app.families.FOREIGN_ADAPTERS`)."""
    text = f"{metadata.get('modelspec.architecture', '')} {metadata.get('ss_base_model_version', '')}"
    found = lora_arch_of(text)
    return None if found is None else found[0]


def _check_fit(name: str, table: KeyTable, parsed: _Parsed, unmatched: list[LayerGroup],
               declared: str | None) -> None:
    arch, fit = table.arch.upper(), len(parsed.layers)
    for other, names in table.foreign_layers:  # module names only another architecture has
        found = next((g.key for g in unmatched for part in names if part in g.key), None)
        if found is not None:
            raise LoraApplyError(name, f"is made for {other}, not this {arch} model: its layer {found} names a "
                                       f"module only {other} has; nothing applied")
    foreign = [c for c in _FOREIGN_COMPONENTS if c not in table.components
               and any(component_named(g.key) == c for g in unmatched)]
    hint = declared.upper() if declared and declared != table.arch else _FOREIGN_COMPONENTS.get(next(iter(foreign), ""))
    made_for = f" (it looks made for {hint})" if hint else ""
    if parsed.mismatched:
        verb = "has" if len(parsed.mismatched) == 1 else "have"
        raise LoraApplyError(name, f"does not fit this {arch} model{made_for}: {len(parsed.mismatched)} of its "
                                   f"layers {verb} the wrong shape, e.g. {parsed.mismatched[0]}")
    also = f", even though {fit} of its layers fit by shape" if fit else ""
    if foreign:
        raise LoraApplyError(name, f"does not fit this {arch} model{made_for}: it has layers for "
                                   f"{', '.join(foreign)}, which this model lacks{also}; nothing applied")
    if declared and declared != table.arch and unmatched:
        raise LoraApplyError(name, f"does not fit this {arch} model{made_for}: its metadata names "
                                   f"{declared.upper()} and {len(unmatched)} of its layers match nothing "
                                   f"here{also}; nothing applied")
    if not fit:
        raise LoraApplyError(name, f"matched zero of its {len(unmatched)} layers in this {arch} "
                                   f"model{made_for}; nothing applied")


def _message(arch: str, keys: list[str], total: int, layers: int, declared: str | None, redundant: list[str]) -> str:
    parts = []
    if redundant:
        parts.append(f"{_count(len(redundant), 'fused layer')} (e.g. {redundant[0]}) also written split into its "
                     "parts: the split layers were read, as diffusers reads them")
    if keys:
        parts.append(f"{len(keys)} of its {_count(total, 'tensor')} ({_count(layers, 'layer')}) matched nothing in "
                     "the model, e.g. " + ", ".join(keys[:UNMATCHED_EXAMPLES]))
    if declared and declared != arch:
        parts.append(f"its metadata names {declared.upper()}, but every layer fits this {arch.upper()} model")
    return "; ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _layout(spellings: Counter) -> str:
    """The key spellings of the matched layers, most used first ("kohya", "diffusers/PEFT, lora_A/lora_B")."""
    return " + ".join(", ".join(p for p in spelling if p) for spelling, _ in spellings.most_common())


def _scale_source(sources: Counter) -> str:
    if not sources:
        return "not used by these algorithms"
    if len(sources) == 1:
        return _SCALE_SOURCES[next(iter(sources))]
    return ", ".join(f"{_SCALE_SOURCES[s]} ({n} layers)" for s, n in sources.most_common())
