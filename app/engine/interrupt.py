"""Interrupt inside a step: a check before every block of the model, through the hook registry.

Between-step interrupt cannot land when one step takes minutes (tiny SD1.5 at 1024² x 4 on a CPU,
a Flux step under sequential offload). So while a pass runs, every block of every component (the
denoiser's down/mid/up blocks and their resnets and attentions, the VAE's, the text encoders'
layers) carries a `control.interrupt` hook whose `pre` raises `StepInterrupted` once a stop is
asked: the stop lands within one block. It runs before every other hook, so an offloaded block is
not streamed in just to be abandoned; the registry's `after` hooks still run for the blocks that
were entered, so streamed weights go back and the placement stays as planned. Nothing is written
to a weight, so the model is as it was.

The hooks are installed for one pass and removed after it (`stop_checks`), never on a compiled model
(a hook there would be traced into its graphs; its steps are fast anyway). Where the stop is
caught decides what is kept: `generate.denoise` returns the latents of the last complete step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from app.engine import placement
from app.hooks import HookRegistry, ModelHook

HOOK = "control.interrupt"


class StepInterrupted(Exception):
    """A stop asked for inside a pass; raised by a block's hook, caught by the pass."""


def blocks(component: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The blocks a stop is checked before: the elements of the first `ModuleList`s on each path from
    the component (down_blocks, up_blocks, layers, transformer_blocks; mid_block's resnets), and the
    composite elements of those blocks' own `ModuleList`s (a down block's resnets and attentions).
    Leaf layers are left alone: a check per Linear would cost more than it saves."""
    for child in component.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                yield block
                for inner in block.children():
                    if isinstance(inner, torch.nn.ModuleList):
                        yield from (m for m in inner if next(m.children(), None) is not None)
        else:
            yield from blocks(child)


@contextlib.contextmanager
def stop_checks(hooks: HookRegistry, pipe, should_stop: Callable[[], bool]) -> Iterator[None]:
    """Within the block: every block of `pipe`'s components raises `StepInterrupted` before it runs
    once `should_stop()` is true."""
    def check(_module, _args, _kwargs) -> None:
        if should_stop():
            raise StepInterrupted("stopped inside a step")

    hook = ModelHook(HOOK, pre=check)
    hooked: dict[int, torch.nn.Module] = {}
    try:
        for component in placement.torch_components(pipe).values():
            for block in blocks(component):
                if id(block) not in hooked:  # a module shared by two components is checked once
                    hooks.add(block, hook)
                    hooked[id(block)] = block
        yield
    finally:
        for block in hooked.values():
            hooks.remove(block, HOOK)
