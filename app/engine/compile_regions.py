"""Regional compilation: a denoiser's repeated blocks compiled once per block class, not once per block.

Why: compiling a DiT whole traces and lowers each of its blocks on its own (dozens of them: 57 in the
largest here), so the first compile takes minutes. Dynamo traces a module's parameters as graph inputs
(torch's inlined nn modules, its default), so one graph of a block class's `forward` serves every
instance whose inputs pass its guards: a block class compiles once per input layout (shape, stride, a
flag such as a block built without modulation) instead of once per instance, and the code around the
blocks (embedders, RoPE, the final layer) runs eager. Which classes repeat is the family's word
(`Family.compile_regions`; diffusers declares `_repeated_blocks` on its DiTs).

How: one `torch.compile` of each block class's `forward` is shared by all its instances; each block
gets a `BlockForward` as its instance attribute `forward` (as the whole-denoiser path sets `forward`
on the denoiser), so the module object, its parameters and its hooks stay what placement, verify,
sync and the LoRA patcher know. Torch runs a block's own hooks around `forward`, outside the compiled
region. The compiled forward runs only while `Regions.run` is active on the calling thread: a
background compile traces on a helper thread while the worker keeps generating eagerly through the
same blocks. LoRAs fuse with `copy_` into the same parameters, so their metadata (what the guards
read) never changes and a LoRA change recompiles nothing.

Shapes: `dynamic=None` (torch's automatic dynamic shapes): a second image size or prompt length
recompiles each block graph once with symbolic sizes, later sizes reuse it, so the per-code-object
recompile limit is not used up by sizes times block variants.

No CUDA graphs here: a CUDA graph replays fixed addresses and each block instance's weights are
separate inputs at their own addresses, so one graph shared by N blocks would be recorded N times.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch


class BlockForward:
    """A block's `forward`: its class's shared compiled forward inside `Regions.run`, the plain one outside."""

    def __init__(self, block: torch.nn.Module, compiled: Callable, regions: Regions) -> None:
        self._block = block
        self._compiled = compiled
        self._plain = type(block).forward
        self._regions = regions

    def __call__(self, *args, **kwargs):
        forward = self._compiled if self._regions.active else self._plain
        return forward(self._block, *args, **kwargs)


class Regions:
    """The compiled blocks of one denoiser: installed on construction, removed by `close()`."""

    def __init__(self, denoiser: torch.nn.Module, class_names: Iterable[str], backend) -> None:
        names = frozenset(class_names)
        blocks = [m for m in denoiser.modules() if type(m).__name__ in names]
        if not blocks:
            raise ValueError(f"{type(denoiser).__name__} has no block of the classes {sorted(names)}")
        self._local = threading.local()
        compiled: dict[type, Callable] = {}
        for block in blocks:
            cls = type(block)
            if cls not in compiled:  # one compiled function per class: its instances share the graph
                compiled[cls] = torch.compile(cls.forward, backend=backend, dynamic=None)
            block.forward = BlockForward(block, compiled[cls], self)
        self.blocks = tuple(blocks)
        self.classes = tuple(cls.__name__ for cls in compiled)

    @property
    def active(self) -> bool:
        """Whether the compiled block forwards run on this thread now."""
        return getattr(self._local, "on", False)

    def run(self, forward: Callable, args: tuple, kwargs: dict):
        """`forward(*args, **kwargs)` (the denoiser's plain forward) with the compiled blocks, on this thread."""
        self._local.on = True
        try:
            return forward(*args, **kwargs)
        finally:
            self._local.on = False

    def close(self) -> None:
        """Give every block its plain forward back."""
        for block in self.blocks:
            if isinstance(vars(block).get("forward"), BlockForward):
                del block.forward
