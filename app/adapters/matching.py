"""Match one adapter file against a loaded model: which layer each key targets, whether every
layer fits, and what is left over, before anything is written.

Why apart from the patcher: deciding *what* a file means for a model (layout, scale, fit) is
read-only work the UI also asks for (`inspect_lora`), while the patcher only writes. A file is
refused whole when any layer has the wrong shape or when it is plainly made for another
architecture: half a foreign LoRA is no LoRA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from app.adapters.algos import Adapter, parse_layer
from app.adapters.errors import AdapterError, IncompatibleAdapterError, LoraApplyError
from app.adapters.files import AdapterFile
from app.adapters.keys import KeyTable, Target, architecture_hint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MatchReport:
    matched_layers: int
    unmatched_keys: int
    message: str = ""


@dataclass(frozen=True)
class PreparedAdapter:
    """One adapter file parsed against one model: per target module, its algorithm object."""

    file: AdapterFile
    layers: Mapping[Target, Adapter]
    report: MatchReport

    def to(self, device: torch.device) -> PreparedAdapter:
        """The same adapter with every layer's tensors on `device` (uploaded once per LoRA)."""
        layers = {target: adapter.to(device) for target, adapter in self.layers.items()}
        return PreparedAdapter(self.file, layers, self.report)


def match_adapter(name: str, file: AdapterFile, table: KeyTable,
                  module_for: Callable[[Target], torch.nn.Module]) -> PreparedAdapter:
    """Parse and shape-check every layer of `file` against the model `table` was built from;
    raise `LoraApplyError` (naming the LoRA) when it does not fit, before any write."""
    layers: dict[Target, Adapter] = {}
    unmatched: list[str] = []
    mismatched: list[str] = []
    for group in table.group(file.tensors):
        if group.target is None:
            unmatched.append(group.key)
            continue
        try:
            adapter = parse_layer(group.key, group.tensors)
            adapter.validate_against(tuple(module_for(group.target).weight.shape))
        except IncompatibleAdapterError as exc:
            mismatched.append(str(exc))
            continue
        except AdapterError as exc:
            raise LoraApplyError(name, str(exc)) from exc
        layers[group.target] = adapter
    _check_fit(name, file, table.arch, layers, unmatched, mismatched)
    if unmatched:
        log.debug("LoRA %s: %d unmatched layer keys: %s", name, len(unmatched), ", ".join(sorted(unmatched)))
    message = f"{len(unmatched)} layer keys matched nothing in the model" if unmatched else ""
    return PreparedAdapter(file, layers, MatchReport(len(layers), len(unmatched), message))


def _check_fit(name: str, file: AdapterFile, arch: str, layers, unmatched, mismatched) -> None:
    hint = architecture_hint(file.tensors, file.metadata)
    made_for = f" (it looks made for {hint.upper()})" if hint and hint != arch else ""
    if made_for:  # refused even where some shapes happen to fit: half a foreign LoRA is no LoRA
        raise LoraApplyError(name, f"does not fit this {arch.upper()} model{made_for}, even though "
                                   f"{len(layers)} of its layers fit by shape; nothing applied")
    if mismatched:
        verb = "has" if len(mismatched) == 1 else "have"
        raise LoraApplyError(name, f"does not fit this {arch.upper()} model{made_for}: "
                                   f"{len(mismatched)} of its layers {verb} the wrong shape, e.g. {mismatched[0]}")
    if not layers:
        raise LoraApplyError(name, f"matched zero of its {len(unmatched)} layers in this {arch.upper()} "
                                   f"model{made_for}; nothing applied")
