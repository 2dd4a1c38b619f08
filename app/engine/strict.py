"""Strict forwards: in every forward of every module that owns tensors, each parameter and buffer
it holds must be on the compute device in its planned compute dtype. A debug switch (Settings
`strict_forwards`, `--strict-forwards`, the Diagnostics tab), off by default, on in the family
conformance suite and the fuzz.

Why: `verify()` checks where tensors rest *between* commands; a fault in the offload hooks shows
only *during* a forward, and on the CPU not at all where rest and compute coincide. The fault
this catches for any family is a hook on a module whose forward never runs: group offload hooked
a transformer's `ModuleDict`, whose Linear children are called by key, so they ran with their weights
at rest (on a GPU: CUDA input, CPU weight). Tested with weights resting in fp32 and computing in
bf16, every such miss is a dtype mismatch the check names, on a CPU-only machine.

The check runs as the `debug.strict` hook of the hook registry (`app/hooks.py`): after the offload
hooks have streamed a module's weights in and `quant.dequant` has widened 8-bit ones, before LoRA
bypasses add to its output. A tensor pinned to its own dtype (`Precision.pinned_dtypes`) must be in
that dtype; integer buffers (position ids) are checked for their device only.
"""

from __future__ import annotations

import torch

from app.engine.placement import ComponentPlan, PlacementError, PlacementPlan, dtype_name, torch_components
from app.hooks import HookRegistry, ModelHook

HOOK = "debug.strict"


class StrictForwardError(PlacementError):
    """A module's forward met one of its own tensors off its compute placement."""


def apply(on: bool, hooks: HookRegistry, pipe, plan: PlacementPlan) -> int:
    """With `on`, put the check on every module that owns tensors (replacing any earlier one);
    without, take every check away. Returns how many modules carry it."""
    hooks.remove_all(HOOK)
    count = 0
    for name, component in torch_components(pipe).items() if on else ():
        for path, module in component.named_modules():
            if module._parameters or module._buffers:
                hooks.add(module, ModelHook(HOOK, pre=_check(name, path, plan.components[name])))
                count += 1
    return count


def _check(component: str, path: str, plan: ComponentPlan):
    want, pinned = plan.compute, plan.pinned_in(path)

    def pre_hook(module: torch.nn.Module, _args, _kwargs) -> None:
        for name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is None:
                continue
            dtype = pinned.get(name, want.dtype)
            if tensor.device != want.device or (tensor.is_floating_point() and tensor.dtype != dtype):
                where = ".".join(p for p in (component, path, name) if p)
                raise StrictForwardError(
                    f"strict forwards: {where} is {tensor.device}/{dtype_name(tensor.dtype)} in its module's "
                    f"forward; the plan computes it on {want.device}/{dtype_name(dtype)}")
    return pre_hook
