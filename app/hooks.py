"""One registry of named forward hooks, run in a declared order whatever order they were added in.

Why: offload strategies stream weights in and out around a forward, LoRA bypasses add to a
layer's output, and (next) quantized layers dequantise their weights. Each of these is a hook on
the same modules, and raw torch hooks run in registration order, so correctness used to rest on
who registered last. Here every hook has a constant name from `HOOK_ORDER`; the registry keeps
three torch hooks per module (pre, post, after) and runs the named hooks through them by that
order: `pre` ascending (offload brings a weight in before anything reads it), `post` and `after`
descending (a LoRA adds to the output while the weight is still streamed in; the stream-out runs
last). Installing, removing and listing go through the registry only, so Diagnostics and tests
see names, never torch's private hook dicts.

* `pre(module, args, kwargs)` may return new `(args, kwargs)`;
* `post(module, args, kwargs, output)` runs after a forward that returned and may return a new
  output;
* `after(module)` runs after every forward whose `pre` ran, a forward that raised included (the
  undo of `pre`: a streamed weight goes back even when the layer failed);
* `around(module, forward, args, kwargs)` runs the forward itself, between every `pre` and every
  `post`: it may call `forward(*args, **kwargs)` or answer without it (a step cache reusing the
  previous step's output). Torch's hooks cannot skip a forward, so while a module has such a hook
  the registry sets its instance `forward` to one that runs them (and restores what was there).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Lower runs first before the forward and last after it.
HOOK_ORDER: dict[str, int] = {
    # its post runs last on the probed block (LoRA added, weights streamed): it may end the denoiser's forward
    # there to reuse the previous step (app/engine/step_cache.py); its `around` wraps only the denoiser's forward
    "cache.step": -20,
    "control.interrupt": -10,  # a stop asked inside a step lands before the block (app/engine/interrupt.py)
    "control.sliced_attention": -9,  # a large CPU attention call runs in slices a stop can land between (same)
    "offload.inputs": 0,      # a component's tensor arguments go to its compute device
    "offload.component": 10,  # model/balanced: the whole component comes to the compute device
    "offload.stream": 20,     # sequential/group: a module's or block's weights are streamed in
    "quant.dequant": 30,      # stored-in-8-bit weights are widened to the compute dtype
    "debug.strict": 35,       # strict forwards: every tensor a module holds is at its compute placement
    "lora.bypass": 40,        # LoRA contributions added to the layer's output
}


@dataclass(frozen=True)
class ModelHook:
    """One named hook; any of the three callables may be absent."""

    name: str
    pre: Callable[[torch.nn.Module, tuple, dict], tuple[tuple, dict] | None] | None = None
    post: Callable[[torch.nn.Module, tuple, dict, Any], Any] | None = None
    after: Callable[[torch.nn.Module], None] | None = None
    around: Callable[[torch.nn.Module, Callable[..., Any], tuple, dict], Any] | None = None

    def __post_init__(self) -> None:
        if self.name not in HOOK_ORDER:
            raise ValueError(f"hook name {self.name!r} has no declared order; add it to HOOK_ORDER "
                             f"({', '.join(HOOK_ORDER)})")


class _ModuleHooks:
    """The named hooks of one module and the three torch hooks that run them."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.hooks: dict[str, ModelHook] = {}
        self.frames: list[list[ModelHook]] = []  # per forward in flight: hooks whose pre ran
        self.handles = (
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True),
            module.register_forward_hook(self._after, always_call=True),
        )
        self.own_forward: tuple[Any] | None = None  # while an `around` hook is on: (the instance forward it had,)

    def sync_forward(self) -> None:
        """Run the `around` hooks through the module's instance `forward` while it has any; restore the
        instance `forward` it had before (None: the class's) once it has none."""
        wanted = any(h.around is not None for h in self.hooks.values())
        if wanted and self.own_forward is None:
            self.own_forward = (self.module.__dict__.get("forward"),)
            self.module.forward = self._around_forward
        elif not wanted and self.own_forward is not None:
            (before,), self.own_forward = self.own_forward, None
            if before is None:
                del self.module.forward
            else:
                self.module.forward = before

    def _around_forward(self, *args, **kwargs):
        (before,) = self.own_forward
        forward = before or functools.partial(type(self.module).forward, self.module)
        for hook in reversed(self.ordered()):  # the lowest order outermost, as its `pre` runs first
            if hook.around is not None:
                forward = functools.partial(self._call_around, hook.around, forward)
        return forward(*args, **kwargs)

    def _call_around(self, around, forward, *args, **kwargs):
        return around(self.module, forward, args, kwargs)

    def ordered(self) -> list[ModelHook]:
        return sorted(self.hooks.values(), key=lambda h: HOOK_ORDER[h.name])

    def _pre(self, module, args, kwargs):
        frame: list[ModelHook] = []
        self.frames.append(frame)
        for hook in self.ordered():
            frame.append(hook)  # before the call: a pre that raises half-way still gets its `after`
            if hook.pre is not None:
                changed = hook.pre(module, args, kwargs)
                if changed is not None:
                    args, kwargs = changed
        return args, kwargs

    def _post(self, module, args, kwargs, output):
        for hook in reversed(self.frames[-1] if self.frames else []):
            if hook.post is not None:
                changed = hook.post(module, args, kwargs, output)
                if changed is not None:
                    output = changed
        return output

    def _after(self, module, _args, _output) -> None:
        frame = self.frames.pop() if self.frames else []
        for hook in reversed(frame):
            if hook.after is not None:
                hook.after(module)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()


class HookRegistry:
    """The named hooks of every module of one pipeline."""

    def __init__(self) -> None:
        self._modules: dict[int, _ModuleHooks] = {}

    def add(self, module: torch.nn.Module, hook: ModelHook) -> None:
        """Install `hook` on `module`; one hook per name and module (a second is a bug, refused)."""
        entry = self._modules.get(id(module))
        if entry is None:
            entry = self._modules[id(module)] = _ModuleHooks(module)
        if hook.name in entry.hooks:
            raise ValueError(f"{type(module).__name__} already has a {hook.name!r} hook; remove it first")
        entry.hooks[hook.name] = hook
        entry.sync_forward()

    def remove(self, module: torch.nn.Module, name: str) -> None:
        entry = self._modules.get(id(module))
        if entry is None or name not in entry.hooks:
            raise KeyError(f"{type(module).__name__} has no {name!r} hook")
        del entry.hooks[name]
        entry.sync_forward()
        if not entry.hooks:
            entry.detach()
            del self._modules[id(module)]

    def remove_all(self, prefix: str) -> int:
        """Remove every hook whose name starts with `prefix` (e.g. "offload."); returns how many."""
        removed = 0
        for entry in list(self._modules.values()):
            for name in [n for n in entry.hooks if n.startswith(prefix)]:
                self.remove(entry.module, name)
                removed += 1
        return removed

    def names(self, module: torch.nn.Module) -> tuple[str, ...]:
        """The module's hook names in the order their `pre` runs."""
        entry = self._modules.get(id(module))
        return () if entry is None else tuple(h.name for h in entry.ordered())

    def hooked(self) -> Iterator[tuple[torch.nn.Module, tuple[str, ...]]]:
        """Every module that carries a hook, with its names."""
        for entry in self._modules.values():
            yield entry.module, tuple(h.name for h in entry.ordered())

    def counts(self) -> collections.Counter[str]:
        """How many modules carry each hook name."""
        return collections.Counter(name for _module, names in self.hooked() for name in names)
