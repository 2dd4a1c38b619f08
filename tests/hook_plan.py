"""What named hooks each offload mode must leave on which module, derived here from the modes'
documented behaviour (not from the strategies' code), for the offload tests and the fuzz."""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline

from app.engine.placement import torch_components
from app.families import family_of

Where = tuple[str, str]  # (component, module path)


def _blocks(component: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Module]]:
    """A component's groups for `group` offload, what executes: each child whole, except containers
    whose own forward never runs (ModuleList, ModuleDict: their elements, recursively) and tensor
    containers (ParameterList/Dict: streamed with the component's own tensors); plus the component
    itself ("") where it or a tensor container child owns tensors."""
    out = []
    for name, child in component.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out.extend(_blocks(child, f"{prefix}{name}."))
        elif not isinstance(child, (torch.nn.ParameterList, torch.nn.ParameterDict)):
            out.append((f"{prefix}{name}", child))
    owners = [component, *(c for c in component.children()
                           if isinstance(c, (torch.nn.ParameterList, torch.nn.ParameterDict)))]
    if not prefix and any(dict(m.named_parameters(recurse=False)) or dict(m.named_buffers(recurse=False))
                          for m in owners):
        out.append(("", component))
    return out


def _group_paths(pipe, name: str, component: torch.nn.Module) -> list[str]:
    """The module paths `group` offload hooks: the family's own `blocks` where it states them (plus
    the component itself where it owns tensors outside them), else the generic rule above (also on
    a holder that is no family's pipeline: the upscaler's)."""
    grouping = family_of(pipe).blocks if isinstance(pipe, DiffusionPipeline) else None
    chosen = grouping(name, component) if grouping else None  # None: the generic rule for this component
    if chosen is None:
        return [path for path, _block in _blocks(component)]
    paths = {id(m): p for p, m in component.named_modules()}
    own = [p for p, _block in _blocks(component) if p == ""]
    return [paths[id(block)] for block in chosen] + own


def expected_hooks(pipe, mode: str, bypassed: set[Where] = frozenset(), stored: set[Where] = frozenset(),
                   strict: bool = False) -> dict[Where, tuple[str, ...]]:
    """{(component, module): hook names in run order} for `mode`, with LoRA bypasses on `bypassed`,
    8-bit weights widened (`quant.dequant`) on `stored` and, with `strict`, the strict-forward check
    (`debug.strict`) on every module that owns tensors."""
    want: dict[Where, list[str]] = {}
    for comp, component in torch_components(pipe).items():
        if mode != "none":
            want.setdefault((comp, ""), []).append("offload.inputs")
        if mode in ("model", "balanced"):
            want[(comp, "")].append("offload.component")
            for name, _child in component.named_children():
                want.setdefault((comp, name), []).append("offload.component")
        elif mode == "sequential":
            for path, module in component.named_modules():
                if module._parameters or module._buffers:
                    want.setdefault((comp, path), []).append("offload.stream")
        elif mode == "group":
            for path in _group_paths(pipe, comp, component):
                want.setdefault((comp, path), []).append("offload.stream")
    for where in stored:
        want.setdefault(where, []).append("quant.dequant")
    if strict:
        for comp, component in torch_components(pipe).items():
            for path, module in component.named_modules():
                if module._parameters or module._buffers:
                    want.setdefault((comp, path), []).append("debug.strict")
    for where in bypassed:
        want.setdefault(where, []).append("lora.bypass")
    return {where: tuple(names) for where, names in want.items()}


def actual_hooks(snapshot) -> dict[Where, tuple[str, ...]]:
    """The hook names the engine's snapshot reports per module (rows without hooks left out)."""
    return {(row.component, row.module): row.hooks for row in snapshot.placement if row.hooks}
