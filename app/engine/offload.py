"""Offload strategies: none, model, balanced, sequential, group. None of them splits a layer.

Each strategy installs forward hooks that ask `placement` (the only mover) to bring weights to
the compute device when a forward needs them, and `remove()` takes away every hook it added.
What each mode moves:

* **model**: whole components; one on the GPU at a time, the previous one goes back to the CPU (the
  denoiser and an attached ControlNet stack count as one: `step_partners`).
* **balanced**: whole components; they stay resident while the GPU stays under a watermark
  (fraction of VRAM, capped by `--vram-budget`); the least recently used is evicted when a
  newcomer would not fit. A component is never left half on each device.
* **sequential**: each leaf module's own tensors, copied to the GPU for its forward and
  dropped after; the CPU tensor stays the storage, so nothing is copied back.
* **group**: whole blocks (a down block, an encoder layer; `blocks`: what executes, a family may
  state its own) streamed like `sequential`, with the next block copied ahead on a side CUDA
  stream; tensors a component owns itself are streamed around the component's forward. Our own
  rather than diffusers' group offloading, which needs accelerate and keeps pinned copies of
  every weight.

Every hook goes through the pipeline's `HookRegistry` under a constant name (`offload.inputs`,
`offload.component`, `offload.stream`), so it runs in the registry's declared order beside LoRA
and quantisation hooks, and `remove()` is `remove_all("offload.")`. `MODES` is the one table of
modes: settings, placement, the compiled path, the LoRA stack and the UI all read it. Each class
says whether its mode `moves_weights` (components rest off the compute device) and whether it
`streams_weights` (weights arrive per forward, so LoRAs apply as bypass forwards, not fused).

`settle()` brings components back to their at-rest placement after a generation, so verify()
always sees the same picture between commands.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import ClassVar

import torch
from diffusers import DiffusionPipeline

from app.engine import placement
from app.engine.placement import PlacementPlan
from app.families import family_of
from app.hooks import HookRegistry, ModelHook
from app.settings import OFFLOAD_CHOICES

log = logging.getLogger(__name__)


class OffloadStrategy:
    """Mode `none`: nothing moves. Subclasses add named hooks through the registry."""

    mode: ClassVar[str] = "none"
    moves_weights: ClassVar[bool] = False  # components rest off the compute device between forwards
    streams_weights: ClassVar[bool] = False  # weights are copied in per forward (leaf or block)
    label: ClassVar[str] = "nothing: every component on the GPU"

    def __init__(self, pipe, plan: PlacementPlan, hooks: HookRegistry) -> None:
        self.pipe, self.plan, self.hooks = pipe, plan, hooks

    def install(self) -> None:
        """Add this mode's hooks (none for `none`)."""

    def _move_inputs_at_entry(self) -> None:
        """Tensor arguments of each component go to its compute device on entry. diffusers places
        some inputs by the device a component's weights rest on (SDXL's text encoders), which is
        the CPU under every offload mode. Where a component rests in another dtype than it
        computes in, diffusers also casts activations by the resting dtype (`text_encoder.dtype`
        reads the first parameter): those are cast to the compute dtype here too."""
        for name, component in placement.torch_components(self.pipe).items():
            plan = self.plan.components[name]
            cast = plan.rest.dtype != plan.compute.dtype
            self.hooks.add(component, ModelHook("offload.inputs", pre=_inputs_to(plan.compute, cast)))

    def remove(self) -> None:
        self.hooks.remove_all("offload.")

    def resident(self) -> frozenset[str]:
        """Components that stay on the compute device between commands."""
        return frozenset(self.plan.components) if not self.moves_weights else frozenset()

    def settle(self) -> None:
        """Bring components back to their at-rest placement after a generation (a failed forward
        included). Streaming modes need nothing: their `after` hooks restore each module after its
        forward, raising or not, and the verify that follows every command catches the rest."""


class ModelOffload(OffloadStrategy):
    """Whole components move to the GPU for their forward; the last active one is sent back."""

    mode = "model"
    moves_weights = True
    label = "whole components, one on the GPU at a time"

    def __init__(self, pipe, plan: PlacementPlan, hooks: HookRegistry) -> None:
        super().__init__(pipe, plan, hooks)
        self._on_device: collections.OrderedDict[str, None] = collections.OrderedDict()

    def install(self) -> None:
        self._move_inputs_at_entry()
        for name, component in placement.torch_components(self.pipe).items():
            # The VAE's decode() is not its forward(), so its direct children carry the hook too.
            for module in (component, *component.children()):
                self.hooks.add(module, ModelHook("offload.component", pre=self._hook_for(name)))

    def _hook_for(self, name: str):
        def pre_hook(_module, _args, _kwargs):
            if name in self._on_device:
                self._on_device.move_to_end(name)
                return
            self._make_room(name)
            component, plan = placement.torch_components(self.pipe)[name], self.plan.components[name]
            placement.move_component(component, name, plan.compute, reason=f"{self.mode}: onload", pinned=plan.pinned)
            self._on_device[name] = None
        return pre_hook

    def _make_room(self, incoming: str) -> None:
        kept = step_partners(self.pipe, incoming)
        for name in list(self._on_device):
            if name not in kept:
                self._evict(name)

    def remove(self) -> None:
        self._on_device.clear()
        super().remove()

    def _evict(self, name: str) -> None:
        component, plan = placement.torch_components(self.pipe)[name], self.plan.components[name]
        placement.move_component(component, name, plan.rest, reason=f"{self.mode}: evict", pinned=plan.pinned)
        del self._on_device[name]

    def settle(self) -> None:
        for name in [n for n in self._on_device if n not in self.resident()]:
            self._evict(name)


def step_partners(pipe, name: str) -> frozenset[str]:
    """The components that stay on the device with `name` under model offload: the denoiser and what the engine
    attached beside it (`EnginePipeline.attached`: a ControlNet stack) take turns at every step, and sending one
    back for the other would move both once per step (diffusers' model offload keeps its ControlNet beside the
    UNet too). Anything else, or a holder with nothing attached (the upscaler's), stands alone."""
    attached = getattr(pipe, "attached", None)
    if not attached:
        return frozenset({name})
    group = {family_of(pipe).denoiser, *attached}
    return frozenset(group) if name in group else frozenset({name})


class BalancedOffload(ModelOffload):
    """Model offload that keeps components resident while they fit under the VRAM budget."""

    mode = "balanced"
    label = "whole components, kept resident under a VRAM watermark"

    def __init__(self, pipe, plan: PlacementPlan, hooks: HookRegistry, budget_bytes: int) -> None:
        super().__init__(pipe, plan, hooks)
        self.budget_bytes = budget_bytes

    def resident(self) -> frozenset[str]:
        return frozenset(self._on_device)

    def _make_room(self, incoming: str) -> None:
        sizes = {n: placement.component_bytes(c) for n, c in placement.torch_components(self.pipe).items()}
        used = sum(sizes[n] for n in self._on_device)
        for name in list(self._on_device):  # least recently used first
            if used + sizes[incoming] <= self.budget_bytes:
                break
            self._evict(name)
            used -= sizes[name]


class SequentialOffload(OffloadStrategy):
    """Leaf modules' tensors are copied to the GPU for their forward only; lowest VRAM."""

    mode = "sequential"
    moves_weights = True
    streams_weights = True
    label = "each leaf module's tensors, copied in for its forward only"

    def __init__(self, pipe, plan: PlacementPlan, hooks: HookRegistry) -> None:
        super().__init__(pipe, plan, hooks)
        self._stashes: dict[int, dict[str, torch.Tensor]] = {}

    def install(self) -> None:
        self._move_inputs_at_entry()
        for name, component in placement.torch_components(self.pipe).items():
            plan = self.plan.components[name]
            # Resting in another dtype, a module's neighbours are still in it while it runs, and code
            # that casts activations to a neighbour's dtype (T5's `.to(self.wo.weight.dtype)`) hands
            # this module the resting dtype: its floating inputs are brought to the compute dtype.
            cast = _inputs_to(plan.compute, True) if plan.rest.dtype != plan.compute.dtype else None
            for path, module in component.named_modules():
                if module._parameters or module._buffers:
                    onload = self._onload(plan.compute, plan.pinned_in(path), cast)
                    self.hooks.add(module, ModelHook("offload.stream", pre=onload, after=self._offload))

    def _onload(self, compute: placement.Placement, pinned: dict[str, torch.dtype], cast):
        def pre_hook(module, args, kwargs):
            self._stashes[id(module)] = placement.stream_in(module, compute, pinned)
            return None if cast is None else cast(module, args, kwargs)
        return pre_hook

    def _offload(self, module) -> None:
        placement.stream_out(module, self._stashes.pop(id(module), {}))

    def settle(self) -> None:
        """A forward cut off by a BaseException (an interrupt: torch runs `after` hooks only for
        `Exception`) leaves its copies in place: point back to the CPU tensors."""
        for module in placement.torch_components(self.pipe).values():
            for sub in module.modules():
                stash = self._stashes.pop(id(sub), None)
                if stash:
                    placement.stream_out(sub, stash)
        self._stashes.clear()

    def remove(self) -> None:
        self.settle()
        super().remove()


def _inputs_to(compute: placement.Placement, cast: bool):
    """A pre-hook moving tensor arguments (nested in dicts, lists, tuples too) to the compute
    device and, with `cast`, floating activations (two or more dimensions) to the compute dtype.
    Timesteps (0-D or 1-D) keep their dtype, as they do when nothing is offloaded."""
    def to_compute(value):
        if isinstance(value, torch.Tensor):
            activation = cast and value.is_floating_point() and value.dim() >= 2
            return value.to(compute.device, compute.dtype if activation else value.dtype)
        if isinstance(value, dict):
            return {k: to_compute(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(to_compute(v) for v in value)
        return value

    def pre_hook(_module, args, kwargs):
        return to_compute(args), to_compute(kwargs)
    return pre_hook


# Containers whose own forward never runs: their elements are called (`blocks[i](x)`,
# `embedders[key](x)`), so a hook on the container itself would never fire.
_NO_FORWARD = (torch.nn.ModuleList, torch.nn.ModuleDict)
# Tensor containers: their tensors are read by the forward of the module holding them.
_TENSORS_ONLY = (torch.nn.ParameterList, torch.nn.ParameterDict)


def blocks(component: torch.nn.Module) -> list[torch.nn.Module]:
    """The generic groups of a component for `group` offload: what executes. Each child is a group
    whole, except a container whose own forward never runs (a ModuleList, a ModuleDict): its
    elements are, recursively. Tensor containers are no group (see `own_tensors`)."""
    groups = []
    for child in component.children():
        if isinstance(child, _NO_FORWARD):
            groups.extend(blocks(child))
        elif not isinstance(child, _TENSORS_ONLY):
            groups.append(child)
    return groups


def family_blocks(pipe) -> Callable[[str, torch.nn.Module], list[torch.nn.Module]] | None:
    """The family's own grouping (`Family.blocks`); None for the generic rule, which is also the rule for
    a holder that is no family's pipeline (the upscaler slot's one component)."""
    return family_of(pipe).blocks if isinstance(pipe, DiffusionPipeline) else None


def own_tensors(component: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose tensors a component's own forward reads outside its groups: the component
    itself (learned pad tokens) and its tensor containers; streamed around the component's forward."""
    owners = [component, *(c for c in component.children() if isinstance(c, _TENSORS_ONLY))]
    return [m for m in owners if any(t is not None for t in (*m._parameters.values(), *m._buffers.values()))]


class GroupOffload(OffloadStrategy):
    """Blocks (down/mid/up blocks, encoder layers, …) streamed whole. Once a component's execution
    order has been seen (its first forward), the block that ran next last time is copied ahead: on
    CUDA on a side stream while the current one computes; on the CPU in line, so the bookkeeping a
    GPU relies on runs in CPU tests too. Registration order is no guide: the UNet registers its up
    blocks before its mid block but runs them after."""

    mode = "group"
    moves_weights = True
    streams_weights = True
    label = "whole blocks, the next one copied ahead on a side CUDA stream"

    def __init__(self, pipe, plan: PlacementPlan, hooks: HookRegistry) -> None:
        super().__init__(pipe, plan, hooks)
        self._stashes: dict[int, list[tuple[torch.nn.Module, dict[str, torch.Tensor]]]] = {}
        self._members: dict[int, list[tuple[torch.nn.Module, dict[str, torch.dtype]]]] = {}  # group -> what it streams
        self._ready: dict[int, object] = {}
        self._next: dict[int, torch.nn.Module] = {}
        self._last: dict[str, torch.nn.Module] = {}
        self._stream = torch.cuda.Stream(plan.device) if plan.device.type == "cuda" else None

    def install(self) -> None:
        """One `offload.stream` hook per group (the family's `blocks`, else the generic `blocks`) and,
        where the component owns tensors outside its groups, one on the component for those."""
        self._move_inputs_at_entry()
        grouping = family_blocks(self.pipe)
        for name, component in placement.torch_components(self.pipe).items():
            plan, paths = self.plan.components[name], {id(m): p for p, m in component.named_modules()}
            chosen = grouping(name, component) if grouping else None  # None: the generic rule for this component
            groups = [(g, list(g.modules())) for g in (blocks(component) if chosen is None else chosen)]
            owners = own_tensors(component)
            for group, members in [*groups, *([(component, owners)] if owners else [])]:
                self._members[id(group)] = [(m, plan.pinned_in(paths[id(m)])) for m in members]
                self.hooks.add(group, ModelHook("offload.stream", pre=self._onload(name, plan.compute),
                                                after=self._offload))

    def _stream_group(self, group: torch.nn.Module, compute: placement.Placement) -> None:
        """Point a group's tensors at compute copies, adding to what was copied ahead: a tensor it
        shares with the block that was running then (tied weights: a language model's `lm_head`
        that is its `embed_tokens`) was on the device already, so it was not stashed, and it went
        back to rest with that block."""
        members = self._members[id(group)]
        stashes = self._stashes.setdefault(id(group), [(m, {}) for m, _pinned in members])
        for (module, stash), (_module, pinned) in zip(stashes, members, strict=True):
            stash.update(placement.stream_in(module, compute, pinned))

    def _onload(self, component: str, compute: placement.Placement):
        def pre_hook(group, _args, _kwargs):
            previous = self._last.get(component)
            if previous is not None and previous is not group:
                self._next.setdefault(id(previous), group)  # learn the execution order once
            self._last[component] = group
            event = self._ready.pop(id(group), None)
            if event is not None:
                current = torch.cuda.current_stream(compute.device)
                current.wait_event(event)
                for module, _pinned in self._members[id(group)]:  # copied on the side stream, read on this one
                    for tensor in (*module._parameters.values(), *module._buffers.values()):
                        if tensor is not None and tensor.device.type == "cuda":
                            tensor.record_stream(current)
            self._stream_group(group, compute)
            ahead = self._next.get(id(group))
            if ahead is None or id(ahead) in self._stashes:
                return
            if self._stream is None:
                self._stream_group(ahead, compute)
                return
            self._stream.wait_stream(torch.cuda.current_stream(compute.device))
            with torch.cuda.stream(self._stream):
                self._stream_group(ahead, compute)
                self._ready[id(ahead)] = self._stream.record_event()
        return pre_hook

    def _offload(self, group) -> None:
        for module, stash in self._stashes.pop(id(group), []):
            placement.stream_out(module, stash)

    def settle(self) -> None:
        """Drop blocks copied ahead that did not run (the last block prefetches the first of the next step)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.plan.device).wait_stream(self._stream)
        for stashes in self._stashes.values():
            for module, stash in stashes:
                placement.stream_out(module, stash)
        self._stashes.clear()
        self._ready.clear()
        self._last.clear()

    def remove(self) -> None:
        self.settle()
        self._next.clear()
        self._members.clear()
        super().remove()


# The one table of offload modes, in the order the UI lists them.
MODES: dict[str, type[OffloadStrategy]] = {
    cls.mode: cls for cls in (OffloadStrategy, ModelOffload, BalancedOffload, SequentialOffload, GroupOffload)
}
if tuple(MODES) != OFFLOAD_CHOICES:
    raise ImportError(f"offload strategies {tuple(MODES)} and settings.OFFLOAD_CHOICES {OFFLOAD_CHOICES} disagree")


def idle_note(mode: str, device: torch.device | str) -> str | None:
    """What to tell a user who picks `mode` where it has nothing to do: on a machine without a GPU the model
    computes where it rests, in RAM, so no mode moves anything (None: the mode does what it says)."""
    if torch.device(device).type != "cpu" or not MODES[mode].moves_weights:
        return None
    return (f"offload {mode!r} changes nothing on this machine: there is no GPU, so the model computes in RAM, "
            "where it already rests (offload saves GPU memory only)")


def make_strategy(pipe, plan: PlacementPlan, hooks: HookRegistry, vram_budget_gib: float | None,
                  watermark: float) -> OffloadStrategy:
    """The strategy object for `plan.offload` (on the CPU every mode is a no-op move, hooks included)."""
    cls = MODES[plan.offload]
    if cls is BalancedOffload:
        return cls(pipe, plan, hooks, balanced_budget_bytes(plan.device, vram_budget_gib, watermark))
    return cls(pipe, plan, hooks)


def plan_for(pipe, dtype: torch.dtype, device: torch.device, mode: str,
             rest_dtype: torch.dtype | None = None, stored=None,
             conv_format: torch.memory_format | None = None, kept=None) -> PlacementPlan:
    """The placement plan of `pipe` under offload `mode` (see `placement.plan_placement`)."""
    return placement.plan_placement(pipe, dtype, device, mode, moves_weights=MODES[mode].moves_weights,
                                    rest_dtype=rest_dtype, stored=stored, conv_format=conv_format, kept=kept)


def bypass_components(plan: PlacementPlan) -> frozenset[str]:
    """Components whose LoRAs are added as bypass forwards instead of fused into the weights: all
    of them when weights are streamed in per forward (re-fusing the resting copies would cost a
    round trip per layer per change), and any that rests in another dtype than it computes in or
    stores weights in 8 bits (fusing would round the delta into the storage dtype)."""
    streamed = MODES[plan.offload].streams_weights
    return frozenset(name for name, c in plan.components.items()
                     if streamed or c.rest.dtype != c.compute.dtype or c.stored)


def balanced_budget_bytes(device: torch.device, vram_budget_gib: float | None, watermark: float) -> int:
    """The smaller of watermark × total VRAM and the explicit budget (GiB)."""
    caps = []
    if device.type == "cuda":
        caps.append(int(torch.cuda.get_device_properties(device).total_memory * watermark))
    if vram_budget_gib is not None:
        caps.append(int(vram_budget_gib * 2**30))
    return min(caps) if caps else 2**62
