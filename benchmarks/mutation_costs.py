"""What one LoRA change (add, re-weight, remove) costs besides its math, counted around `Engine.set_loras`
on any device: the costs an accelerator pays that a CPU run hides (issue 41, slider latency).

On a GPU a slider move is bound by what makes the host wait or crosses the bus, not by FLOPs (three
rank-64 LoRAs on SD1.5 are ~0.3 TFLOP, a few ms): host syncs (`Tensor.item`, `.cpu`, `.tolist`,
`.numpy`, `torch.cuda.synchronize`, and the waits the LoRA stack itself counts), bytes copied between
the device and backups held on the host (`LoraStack.traffic`), aten ops dispatched by the patching
(about one kernel launch each), and walks over every tensor of the pipeline (placement verify,
Diagnostics rows: Python time per tensor). The CPU proxy row and the tests read the same counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app import diagnostics
from app.adapters.patcher import LoraStack
from app.engine import placement

WORKER_THREAD = "engine-worker"  # the name `Engine` gives its worker thread
SYNCING = (("item", torch.Tensor), ("cpu", torch.Tensor), ("tolist", torch.Tensor), ("numpy", torch.Tensor),
           ("synchronize", torch.cuda))


@dataclasses.dataclass
class MutationCosts:
    """Counts over the LoRA changes run inside `counting`."""

    host_syncs: int = 0  # SYNCING calls on the worker, and the stack's own waits
    tensor_walks: int = 0  # `iter_tensors` walks (placement verify, Diagnostics rows)
    aten_ops: int = 0  # dispatched inside `LoraStack.reconcile`
    layers_written: int = 0  # `PatchTraffic`'s figures, summed over the changes
    backup_bytes_read: int = 0
    bytes_across: int = 0


class _OpCount(TorchDispatchMode):
    def __init__(self, costs: MutationCosts) -> None:
        super().__init__()
        self._costs = costs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._costs.aten_ops += 1
        return func(*args, **(kwargs or {}))


def _counted(costs: MutationCosts, field: str, fn):
    def call(*args, **kwargs):
        if threading.current_thread().name == WORKER_THREAD:
            setattr(costs, field, getattr(costs, field) + 1)
        return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def counting() -> Iterator[MutationCosts]:
    """Count host syncs and tensor walks on the engine's worker thread (the one writer: a background
    read of a file elsewhere is not the change's cost), and the aten ops and traffic of every
    `LoraStack.reconcile`, while inside (dispatch modes are per thread: the mode is entered in the
    reconcile itself, on the worker). Patches torch and engine functions: never time under it."""
    costs = MutationCosts()
    reconcile = LoraStack.reconcile

    def counted_reconcile(stack, *args, **kwargs):
        with _OpCount(costs):
            try:
                return reconcile(stack, *args, **kwargs)
            finally:
                traffic = stack.traffic
                costs.host_syncs += traffic.waits
                costs.layers_written += traffic.layers_written
                costs.backup_bytes_read += traffic.backup_bytes_read
                costs.bytes_across += traffic.bytes_across

    patched = [(owner, name, getattr(owner, name)) for name, owner in SYNCING]
    patched += [(placement, "iter_tensors", placement.iter_tensors),
                (diagnostics, "iter_tensors", diagnostics.iter_tensors), (LoraStack, "reconcile", reconcile)]
    try:
        for owner, name, original in patched[:-3]:
            setattr(owner, name, _counted(costs, "host_syncs", original))
        for owner, name, original in patched[-3:-1]:
            setattr(owner, name, _counted(costs, "tensor_walks", original))
        LoraStack.reconcile = counted_reconcile
        yield costs
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
