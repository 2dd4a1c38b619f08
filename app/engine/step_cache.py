"""Step caching: a first-block cache that skips the denoiser's later blocks on steps that change little.

Why: on a base (undistilled) model of 20-50 steps, neighbouring steps often compute nearly the same
thing. Every denoiser call runs its first block (the family's `first_block`); the output is compared
with that block's output at the last step that ran whole (relative L1: Σ|new − old| / Σ|old| over
every tensor the block returns). Under the threshold, the rest of the forward is not run and the
denoiser answers with the output of that last whole step; at or over it, the forward runs on and its
output and first-block output become the new reference. Comparing against the last *whole* step (not
the previous call) lets small changes add up: a slow drift ends a run of skipped steps.

How it runs, through the hook registry (`app/hooks.py`, name `cache.step`): the first block's `post`
decides and, to skip, raises `_Reuse`, which ends the forward the way a stop does (`control.interrupt`):
every `after` hook of the blocks entered still runs, so streamed weights go back and a skipped block
is never streamed in. The denoiser's `around` hook catches it and answers the cached output (a copy:
the pipeline may modify what it gets). Nothing is written to any module; the state lives in the
`StepCache` of one pass and goes with its hooks (`step_cached`), so no state outlasts a pass.

Calls of one step (a pipeline that runs the conditional and unconditional passes as two calls, as some
undistilled DiTs' pipelines do) each keep their own reference and output, by their order within the
step: a call is of the same step as the one before when it denoises the very same latents object
(diffusers' pipelines hand one latents tensor to every call of a step). A batched CFG call holds both
halves in one tensor, each cached at its own position.

Not offered on step-distilled checkpoints (`Sampling.step_distilled`: each of their few steps differs),
refused with a message; not on a compiled denoiser (the engine refuses it: a hook there would be traced
into its graphs). Thresholds are this comparison's own: they are not diffusers' residual thresholds.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from app.families import family_of
from app.hooks import HookRegistry, ModelHook

log = logging.getLogger(__name__)

HOOK = "cache.step"
MAX_THRESHOLD = 1.0  # a relative change of 100%: past it every step would be skipped after the first


class _Reuse(Exception):
    """Raised by the first block's hook to end the denoiser's forward; caught by its `around` hook."""


@dataclass(frozen=True)
class StepCacheConfig:
    """What one pass caches with: the threshold (relative L1 change of the first block's output under
    which a step reuses the last whole one) and the denoiser's first block (a module path in it)."""

    threshold: float
    first_block: str


@dataclass
class _Slot:
    """One call position within a step: the first block's output and the denoiser's output at the last
    step that ran whole, and the first block's output of the call now running."""

    reference: tuple[torch.Tensor, ...] | None = None
    output: Any = None
    pending: tuple[torch.Tensor, ...] | None = None


class StepCache:
    """The cache of one denoising pass: its slots and how many denoiser calls ran whole or were reused."""

    def __init__(self, config: StepCacheConfig, input_name: str) -> None:
        self.config = config
        self.computed = 0
        self.skipped = 0
        self._input_name = input_name  # the denoiser forward's first parameter: what it denoises
        self._slots: list[_Slot] = []
        self._step_input: object = None  # held, so no later object can take its id
        self._slot_index = 0
        self._active: _Slot | None = None  # the slot of the denoiser call running now

    def _slot_for(self, args: tuple, kwargs: dict) -> _Slot:
        latents = args[0] if args else kwargs.get(self._input_name)
        if latents is not None and latents is self._step_input:
            self._slot_index += 1
        else:
            self._step_input, self._slot_index = latents, 0
        while len(self._slots) <= self._slot_index:
            self._slots.append(_Slot())
        return self._slots[self._slot_index]

    def around(self, _module, forward, args: tuple, kwargs: dict):
        """The denoiser's forward, or the cached output of its slot when the first block says so."""
        slot = self._active = self._slot_for(args, kwargs)
        slot.pending = None
        try:
            output = forward(*args, **kwargs)
        except _Reuse:
            self.skipped += 1
            return _copy(slot.output)
        finally:
            self._active = None
        if slot.pending is not None:  # None: the first block did not run (nothing to compare next time)
            slot.reference, slot.output = slot.pending, _copy(output)
        self.computed += 1
        return output

    def first_block_done(self, _module, _args, _kwargs, output) -> None:
        """After the first block: skip the rest (raise `_Reuse`) when its output changed less than the
        threshold since the slot's last whole step, else keep it to become the slot's reference."""
        slot = self._active
        if slot is None:  # the block ran outside a denoiser call: nothing to decide
            return
        signal = tuple(t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())
        if slot.output is not None and relative_change(signal, slot.reference) < self.config.threshold:
            raise _Reuse
        slot.pending = tuple(t.detach().clone() for t in signal)


def relative_change(new: tuple[torch.Tensor, ...], old: tuple[torch.Tensor, ...] | None) -> float:
    """Σ|new − old| / Σ|old| over all tensors, accumulated in fp32 and read in one host sync; infinite when
    the shapes differ (a batch that changed size, as a pipeline that stops CFG for the last steps halves it)
    or there is no reference; NaN (never under a threshold) when the reference is all zeros."""
    if old is None or len(new) != len(old) or any(a.shape != b.shape for a, b in zip(new, old, strict=True)):
        return float("inf")
    change = sum((a - b).abs().sum(dtype=torch.float32) for a, b in zip(new, old, strict=True))
    size = sum(b.abs().sum(dtype=torch.float32) for b in old)
    return float(change / size)


def _copy(output):
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, output)


def check_threshold(threshold: float) -> float:
    """The threshold as a float in 0…`MAX_THRESHOLD` (0: off); ValueError otherwise."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= MAX_THRESHOLD:
        raise ValueError(f"the step cache threshold must be a number in 0…{MAX_THRESHOLD:g} (0 = off), got "
                         f"{threshold!r}")
    return float(threshold)


def apply_step_cache(hooks: HookRegistry, pipe, threshold: float) -> StepCache | None:
    """Put a step cache of `threshold` on `pipe`'s denoiser through `hooks`; None (nothing installed) at
    threshold 0. Refuses a step-distilled checkpoint and a denoiser without the family's first block."""
    threshold = check_threshold(threshold)
    if threshold == 0:
        return None
    fam = family_of(pipe)
    if fam.sampling.step_distilled(pipe):
        raise ValueError(f"{fam.label} is step-distilled: each of its few steps differs, so a step cache has "
                         "nothing to reuse; set the step cache to 0")
    denoiser = getattr(pipe, fam.denoiser)
    try:
        first = denoiser.get_submodule(fam.first_block)
    except AttributeError:
        raise ValueError(f"{fam.label}'s denoiser has no first block {fam.first_block!r} "
                         "(Family.first_block)") from None
    cache = StepCache(StepCacheConfig(threshold, fam.first_block), _first_parameter(denoiser))
    hooks.add(denoiser, ModelHook(HOOK, around=cache.around))
    hooks.add(first, ModelHook(HOOK, post=cache.first_block_done))
    return cache


def remove_step_cache(hooks: HookRegistry, pipe) -> None:
    """Take the step cache's hooks off `pipe`'s denoiser (the undo of `apply_step_cache`)."""
    fam = family_of(pipe)
    denoiser = getattr(pipe, fam.denoiser)
    for module in (denoiser, denoiser.get_submodule(fam.first_block)):
        hooks.remove(module, HOOK)


@contextlib.contextmanager
def step_cached(hooks: HookRegistry, pipe, threshold: float) -> Iterator[StepCache | None]:
    """A step cache on `pipe` within the block (None at threshold 0), its hooks and state gone after it."""
    cache = apply_step_cache(hooks, pipe, threshold)
    try:
        yield cache
    finally:
        if cache is not None:
            remove_step_cache(hooks, pipe)
            log.info("step cache %g: %d of %d denoiser calls reused the last whole step", threshold, cache.skipped,
                     cache.skipped + cache.computed)


def _first_parameter(denoiser: torch.nn.Module) -> str:
    """The name of the denoiser forward's first parameter (`sample`, `hidden_states`, `x`): what it denoises."""
    return list(inspect.signature(type(denoiser).forward).parameters)[1]
