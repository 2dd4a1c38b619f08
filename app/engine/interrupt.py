"""Interrupt inside a step: a check before every block of the model, through the hook registry.

Between-step interrupt cannot land when one step takes minutes (tiny SD1.5 at 1024² x 4 on a CPU,
a Flux step under sequential offload). So while a pass runs, every block of every component (the
denoiser's down/mid/up blocks and their resnets and attentions, the VAE's, the text encoders'
layers) carries a `control.interrupt` hook whose `pre` raises `StepInterrupted` once a stop is
asked: the stop lands within one block. It runs before every other hook, so an offloaded block is
not streamed in just to be abandoned; the registry's `after` hooks still run for the blocks that
were entered, so streamed weights go back and the placement stays as planned. Nothing is written
to a weight, so the model is as it was.

One attention call can outlast a whole budget by itself: at 2048² the tiny SD1.5's self-attention
over 65,536 tokens is one `scaled_dot_product_attention` of ~5 minutes on two CPU cores (a step runs
five of them), and no block boundary lies inside it. So while the checks are on, a large CPU attention
call is run in slices of query rows (`SLICE_MACS` of work each, well under a second) with the stop
checked between slices. Each query row's softmax reads only its own scores, and the CPU kernel gives
bit-identical rows sliced or whole (tests/test_interrupt.py checks it), so nothing changes but when a
stop can land. Accelerators run such a call in well under a second: they are left whole. The function
mode that slices is entered around each attention module's forward only (a `control.sliced_attention`
hook): around the whole pass it costs Python time on every op, 16% more CPU per step of the tiny SD1.5.

The hooks are installed for one pass and removed after it (`stop_checks`), never on a compiled model
(a hook there would be traced into its graphs; its steps are fast anyway). Where the stop is
caught decides what is kept: `generate.denoise` returns the latents of the last complete step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention
from torch.overrides import TorchFunctionMode

from app.engine import placement, timeline
from app.hooks import HookRegistry, ModelHook

HOOK = "control.interrupt"
SLICED = "control.sliced_attention"
# The modules that call `scaled_dot_product_attention`: diffusers' classic `Attention` and the attention
# classes of its newer transformers (`AttentionModuleMixin`).
ATTENTION_TYPES = (Attention, AttentionModuleMixin)
# Multiply-adds of one slice of a sliced attention call (query rows x keys x head width x batch·heads):
# 2^27 is ~0.15 s on one loaded CPU core at the tiny models' narrow heads, so a stop lands well within
# the 5 s Interrupt promise; calls of less work than this run whole, as before.
SLICE_MACS = 2**27


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


class _SlicedAttention(TorchFunctionMode):
    """While entered (on this thread only: torch keeps function modes per thread), a large CPU
    `scaled_dot_product_attention` runs in slices of query rows, `check()` before each."""

    def __init__(self, check: Callable[[], None]) -> None:
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return sliced_attention(func, self.check, *args, **kwargs)
        return func(*args, **kwargs)


def sliced_attention(sdpa, check: Callable[[], None], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False, **rest):
    """`sdpa(query, key, value, …)` in slices of query rows of at most `SLICE_MACS` work, `check()` before
    each; whole where slicing could change the result (a causal mask, dropout) or gains nothing."""
    rows, work = query.shape[-2], query.numel() * key.shape[-2]
    if query.device.type != "cpu" or is_causal or dropout_p or work <= SLICE_MACS or rows < 2:
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **rest)
    step = max(1, rows * SLICE_MACS // work)
    per_row_mask = attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] == rows
    out = None
    for start in range(0, rows, step):
        check()
        mask = attn_mask[..., start:start + step, :] if per_row_mask else attn_mask
        part = sdpa(query[..., start:start + step, :], key, value, attn_mask=mask, **rest)
        if out is None:
            out = part.new_empty((*part.shape[:-2], rows, part.shape[-1]))
        out[..., start:start + step, :] = part
    return out


@contextlib.contextmanager
def stop_checks(hooks: HookRegistry, pipe, should_stop: Callable[[], bool],
                slice_attention: bool = True) -> Iterator[None]:
    """Within the block: every block of `pipe`'s components, and (`slice_attention`: an engine on the CPU)
    every slice of a large attention call, raises `StepInterrupted` before it runs once `should_stop()` is true."""
    def check() -> None:
        if should_stop():
            raise StepInterrupted("stopped inside a step")

    installed: dict[tuple[int, str], torch.nn.Module] = {}

    def install(module: torch.nn.Module, hook: ModelHook) -> None:
        if (id(module), hook.name) not in installed:  # a module shared by two components is hooked once
            hooks.add(module, hook)
            installed[id(module), hook.name] = module

    block_hook = ModelHook(HOOK, pre=lambda _module, _args, _kwargs: check())
    sliced_hook = _sliced_attention_hook(_SlicedAttention(check))
    try:
        with timeline.phase("stop hooks"):
            for component in placement.torch_components(pipe).values():
                for block in blocks(component):
                    install(block, block_hook)
                if slice_attention:
                    for module in component.modules():
                        if isinstance(module, ATTENTION_TYPES):
                            install(module, sliced_hook)
        yield
    finally:
        with timeline.phase("stop hooks"):
            for (_id, name), module in installed.items():
                hooks.remove(module, name)


def _sliced_attention_hook(mode: TorchFunctionMode) -> ModelHook:
    """A hook that enters `mode` for an attention forward whose self-attention would be over `SLICE_MACS`
    of work (its hidden states' elements times their tokens: a cross-attention does less, a smaller one
    runs whole anyway), and leaves it after the forward, a raised one included. Attention modules do not
    nest, so one stack of "entered?" answers pairs each `after` with its `pre`."""
    entered: list[bool] = []

    def pre(_module, args, kwargs) -> None:
        states = kwargs.get("hidden_states", args[0] if args else None)
        large = isinstance(states, torch.Tensor) and states.device.type == "cpu" and states.dim() >= 3 and \
            states.numel() * math.prod(states.shape[2:] if states.dim() == 4 else states.shape[1:2]) > SLICE_MACS
        entered.append(large)
        if large:
            mode.__enter__()

    def after(_module) -> None:
        if entered.pop():
            mode.__exit__(None, None, None)

    return ModelHook(SLICED, pre=pre, after=after)
