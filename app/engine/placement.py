"""Placement plan, verification and repair: the only code that moves or casts model tensors.

Why this module exists: every crash in the seed reports came from a tensor that some code put
on a hard-coded device or dtype, after which nothing checked. Here a `PlacementPlan` states
where each component's tensors must be *at rest* (between uses) and *at compute* (while its
forward runs), and, with `--channels-last`, the memory format of convolution weights. `verify()`
walks every parameter and buffer of every component — never `module.device`, which only reads
the first parameter — and `sync()` repairs what it finds in place, keeping each `Parameter`
object (and so every hook and reference) alive.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from app.families import family_of

log = logging.getLogger(__name__)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Storage-only dtypes: weights rest and move in them and are widened to the compute dtype for
# their forward (a `quant.dequant` hook); a move never widens or narrows them.
STORAGE_DTYPES = {"fp8": torch.float8_e4m3fn}
DTYPE_NAMES = {v: k for k, v in {**DTYPES, **STORAGE_DTYPES}.items()}


class PlacementError(RuntimeError):
    """A component could not be brought to its planned device/dtype."""


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _format_name(memory_format: torch.memory_format) -> str:
    return str(memory_format).removeprefix("torch.")


def layout_of(tensor: torch.Tensor, want: Placement) -> torch.memory_format | None:
    """The memory format `want` asks of `tensor`, or None where it asks none. Only 4-D floating
    tensors (convolution weights; 8-bit stored ones too, so their widened copies inherit it) have a
    layout in the plan: cuDNN and oneDNN convolutions run channels_last natively, and a weight left
    contiguous is converted on every call (22.6% of CUDA time on an H100, `nchwToNhwcKernel`)."""
    if want.memory_format is None or tensor.dim() != 4 or not tensor.is_floating_point():
        return None
    return want.memory_format


def _has_layout(tensor: torch.Tensor, want: Placement) -> bool:
    memory_format = layout_of(tensor, want)
    return memory_format is None or tensor.is_contiguous(memory_format=memory_format)


def resolve_device(requested: str) -> torch.device:
    """`auto` means the first CUDA device when one is usable, else the CPU."""
    if requested == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    """The dtype policy.

    `auto`: bf16 where the GPU supports it, else fp16 on CUDA, fp32 on the CPU. On the CPU an
    fp16 request becomes fp32, because Half kernels (LayerNorm among them) are missing or
    slow there — the OneTrainer `expected scalar type Float but found Half` class. bf16 is
    honoured on the CPU when asked for explicitly: torch ships bf16 CPU kernels for every op
    these models use.
    """
    if requested == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    dtype = DTYPES[requested]
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32
    return dtype


@dataclass(frozen=True)
class Placement:
    """A device and dtype, and the memory format the plan asks of 4-D floating tensors (convolution
    weights; see `layout_of`). `memory_format` None states no layout: moves keep each tensor's own."""

    device: torch.device
    dtype: torch.dtype
    memory_format: torch.memory_format | None = None

    def __str__(self) -> str:
        layout = "" if self.memory_format is None else f"/{_format_name(self.memory_format)}"
        return f"{self.device}/{dtype_name(self.dtype)}{layout}"


Pinned = Mapping[tuple[str, str], torch.dtype]  # (module path, tensor name) -> the dtype it keeps


@dataclass(frozen=True)
class ComponentPlan:
    """Where one component's tensors live at rest and while its forward runs. `stored` names the
    layers whose weight rests in a storage dtype (fp8) instead, whatever the placement's dtype;
    `pinned` the tensors that keep their family's pinned dtype at rest and at compute
    (`Precision.pinned_dtypes`: RoPE `inv_freq` in fp32)."""

    rest: Placement
    compute: Placement
    stored: Mapping[str, torch.dtype] = dataclasses.field(default_factory=dict)
    pinned: Pinned = dataclasses.field(default_factory=dict)

    @property
    def offloaded(self) -> bool:
        return self.rest != self.compute

    def pinned_in(self, module: str) -> dict[str, torch.dtype]:
        """The pinned tensors of one module (path in the component), by tensor name."""
        return {tensor: dtype for (path, tensor), dtype in self.pinned.items() if path == module}


@dataclass(frozen=True)
class PlacementPlan:
    """Where every component must be between commands.

    `resident` names the offloadable components that an offload strategy currently keeps on
    the compute device (balanced mode); for them "at rest" means the compute placement.
    """

    device: torch.device
    dtype: torch.dtype
    offload: str
    components: Mapping[str, ComponentPlan]
    resident: frozenset[str] = frozenset()

    def expected(self, component: str) -> Placement:
        """Placement every tensor of `component` must have at rest (8-bit weights aside)."""
        plan = self.components[component]
        return plan.compute if component in self.resident else plan.rest

    def expected_for(self, component: str, module: str, tensor: str) -> Placement:
        """Placement one tensor must have at rest: a stored-in-8-bit weight keeps its storage dtype,
        a pinned tensor its pinned dtype."""
        want, plan = self.expected(component), self.components[component]
        stored = plan.stored.get(module) if tensor == "weight" else None
        kept = plan.pinned.get((module, tensor), stored)
        return want if kept is None else dataclasses.replace(want, dtype=kept)

    def with_resident(self, names: frozenset[str]) -> PlacementPlan:
        return dataclasses.replace(self, resident=frozenset(names))


@dataclass(frozen=True)
class Violation:
    component: str
    module: str
    tensor: str
    expected: str
    actual: str

    def __str__(self) -> str:
        where = f"{self.component}.{self.module}.{self.tensor}" if self.module else f"{self.component}.{self.tensor}"
        return f"{where}: expected {self.expected}, found {self.actual}"


def torch_components(pipe) -> dict[str, torch.nn.Module]:
    """The pipeline's `nn.Module` components (unet, vae, text encoders), in a stable order."""
    return {name: c for name, c in sorted(pipe.components.items()) if isinstance(c, torch.nn.Module)}


def iter_tensors(pipe) -> Iterator[tuple[str, str, torch.nn.Module, str, torch.Tensor, bool]]:
    """Yield (component, module path, module, tensor name, tensor, is_parameter) for every
    parameter and buffer owned directly by every module of every component."""
    for comp_name, component in torch_components(pipe).items():
        for path, module in component.named_modules():
            yield from _module_tensors(comp_name, path, module)


def _module_tensors(comp: str, path: str, module: torch.nn.Module):
    """`iter_tensors`' rows for the tensors `module` owns directly."""
    for name, param in module._parameters.items():
        if param is not None:
            yield comp, path, module, name, param, True
    for name, buf in module._buffers.items():
        if buf is not None:
            yield comp, path, module, name, buf, False


def _target_dtype(tensor: torch.Tensor, want: Placement) -> torch.dtype:
    """The dtype a move gives `tensor`: integer buffers (position ids, step counters) and weights
    stored in 8 bits keep theirs by design; other floating tensors take the placement's."""
    if not tensor.is_floating_point() or tensor.dtype in STORAGE_DTYPES.values():
        return tensor.dtype
    return want.dtype


def _matches(tensor: torch.Tensor, want: Placement) -> bool:
    """Whether a move to `want` would leave `tensor` as it is."""
    return tensor.device == want.device and tensor.dtype == _target_dtype(tensor, want) and _has_layout(tensor, want)


def _conforms(tensor: torch.Tensor, want: Placement) -> bool:
    """Whether `tensor` is exactly where one tensor's plan (`expected_for`) puts it."""
    return (tensor.device == want.device and (not tensor.is_floating_point() or tensor.dtype == want.dtype)
            and _has_layout(tensor, want))


def _describe(tensor: torch.Tensor, want: Placement | None = None) -> str:
    """Device and dtype, and the layout where `want` asks one of this tensor."""
    text = f"{tensor.device}/{dtype_name(tensor.dtype)}"
    if want is None or layout_of(tensor, want) is None:
        return text
    layouts = (want.memory_format, torch.contiguous_format, torch.channels_last)
    found = next((_format_name(f) for f in layouts if tensor.is_contiguous(memory_format=f)), "strided")
    return f"{text}/{found}"


def _expected(tensor: torch.Tensor, want: Placement) -> str:
    """`want` as it applies to `tensor`: its layout only where it asks one of this tensor."""
    return str(dataclasses.replace(want, memory_format=layout_of(tensor, want)))


def plan_placement(pipe, dtype: torch.dtype, device: torch.device, offload: str, *, moves_weights: bool,
                   rest_dtype: torch.dtype | None = None,
                   stored: Mapping[str, Mapping[str, torch.dtype]] | None = None,
                   conv_format: torch.memory_format | None = None,
                   kept: Mapping[str, Pinned] | None = None) -> PlacementPlan:
    """Build the plan for `pipe` at `dtype` on `device` under offload mode `offload` (named for
    diagnostics; `offload.plan_for` fills in what the mode does).

    A mode that `moves_weights` rests components on the CPU between forwards, in `rest_dtype`
    (default: the compute dtype). A rest dtype wider than the compute dtype makes every move a
    real cast even on a CPU-only machine: that is how CI runs the moving code (fp32 rest, bf16
    compute) without a GPU. `stored` names, per component, the layers whose weight rests in a
    storage dtype (fp8) and is widened per forward; `kept`, per component, tensors that keep their own
    dtype at rest and at compute beside the family's pinned ones (an fp8-matmul layer's weight and its
    float32 scales, app/engine/fp8_matmul.py). `conv_format` (channels_last, or None: no layout
    planned) is the memory format of the 4-D weights of the family's convolutional components
    (`Family.conv_components`: UNet, VAE), at rest and at compute; text encoders and a DiT's
    transformer have no convolutions and get none. Policy beyond the plain request, as diffusers'
    own pipelines do it: in fp16 the VAE of a family that upcasts (`Precision.vae_upcast_in_fp16`:
    SDXL) is kept in fp32 when its config asks (`force_upcast`), because its fp16 decode overflows
    to NaN; on the CPU nothing runs in fp16 (see `resolve_dtype`).
    """
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32
    cpu = torch.device("cpu")
    fam = family_of(pipe)
    plans = {}
    for name, component in torch_components(pipe).items():
        comp_dtype = dtype
        upcast = fam.precision.vae_upcast_in_fp16 and dtype == torch.float16
        if name == "vae" and upcast and component.config.force_upcast:
            comp_dtype = torch.float32
        layout = conv_format if name in fam.conv_components else None
        compute = Placement(device, comp_dtype, layout)
        rest = Placement(cpu, rest_dtype or comp_dtype, layout) if moves_weights else compute
        pinned = {(path, tensor): own for path, module in component.named_modules()
                  for tensor, value in (*module._parameters.items(), *module._buffers.items())
                  if value is not None and (own := fam.pinned_dtype(name, path, tensor)) is not None}
        pinned.update((kept or {}).get(name, {}))
        plans[name] = ComponentPlan(rest=rest, compute=compute, stored=dict((stored or {}).get(name, {})),
                                    pinned=pinned)
    return PlacementPlan(device=device, dtype=dtype, offload=offload, components=plans)


def verify(pipe, plan: PlacementPlan) -> list[Violation]:
    """Every tensor whose device, dtype or (where the plan states one) layout differs from the plan's
    at-rest placement."""
    return _violations(plan, iter_tensors(pipe))


def verify_modules(plan: PlacementPlan, modules: Iterable[tuple[str, str, torch.nn.Module]]) -> list[Violation]:
    """`verify` over the tensors of `modules` ((component, module path, module)) only: after a change
    that wrote nothing but those modules' tensors in place (a fused LoRA change, `copy_` into the
    existing storage), the only tensors whose placement it could have changed; every other one is as
    the full `verify` before the change found (or repaired) it. No walk over the whole pipeline, and
    the modules come resolved (a `get_submodule` per layer cost as much as the whole walk)."""
    return _violations(plan, iter_module_tensors(modules))


def iter_module_tensors(modules: Iterable[tuple[str, str, torch.nn.Module]]):
    """`iter_tensors`' rows for the tensors of `modules` ((component, module path, module)) only."""
    for comp, path, module in modules:
        yield from _module_tensors(comp, path, module)


def _violations(plan: PlacementPlan, tensors) -> list[Violation]:
    found = []
    for comp, path, _module, name, tensor, _is_param in tensors:
        if comp not in plan.components:
            found.append(Violation(comp, path, name, "component absent from plan", _describe(tensor)))
            continue
        want = plan.expected_for(comp, path, name)
        if not _conforms(tensor, want):
            found.append(Violation(comp, path, name, _expected(tensor, want), _describe(tensor, want)))
    return found


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _moved(tensor: torch.Tensor, want: Placement, exact: bool = False) -> torch.Tensor:
    """A copy of `tensor` at `want` (see `_target_dtype`; `exact` takes `want.dtype` as is, for a
    repair), in the layout `want` asks of it, else in its own (`preserve_format`). Never an
    inference-mode tensor, so later in-place LoRA writes outside inference mode stay legal."""
    dtype = want.dtype if exact and tensor.is_floating_point() else _target_dtype(tensor, want)
    memory_format = layout_of(tensor, want) or torch.preserve_format
    with torch.inference_mode(False), torch.no_grad():
        return tensor.to(device=want.device, dtype=dtype, memory_format=memory_format)


def _move_tensor(module: torch.nn.Module, name: str, is_param: bool, want: Placement, exact: bool = False) -> None:
    """Move one tensor in place of itself: a parameter keeps its identity (only `.data` changes),
    a buffer is re-registered under the same name."""
    if is_param:
        param = module._parameters[name]
        param.data = _moved(param.data, want, exact)
    else:
        module._buffers[name] = _moved(module._buffers[name], want, exact)


def component_bytes(component: torch.nn.Module) -> int:
    return _bytes(list(component.parameters()) + list(component.buffers()))


def _pinned_at(want: Placement, pinned: Mapping[str, torch.dtype], tensor: str) -> Placement:
    """`want` for one tensor of a module whose pinned tensors are `pinned` (by tensor name)."""
    return want if tensor not in pinned else dataclasses.replace(want, dtype=pinned[tensor])


def move_component(component: torch.nn.Module, name: str, want: Placement, *, reason: str,
                   pinned: Pinned | None = None) -> None:
    """Move a whole component (every parameter and buffer) to `want`, `pinned` tensors (by module path
    and name) to their own dtype; logs the move for move-debug."""
    started = time.perf_counter()
    pinned = pinned or {}
    tensors = [(m, n, p is not None and n in m._parameters, pinned.get((path, n)))
               for path, m in component.named_modules()
               for n, p in (*m._parameters.items(), *m._buffers.items()) if p is not None]
    moved, sources = 0, set()
    for module, tensor_name, is_param, kept in tensors:
        tensor = module._parameters[tensor_name] if is_param else module._buffers[tensor_name]
        target = want if kept is None else dataclasses.replace(want, dtype=kept)
        if not _matches(tensor, target):
            moved += tensor.numel() * tensor.element_size()
            sources.add(_describe(tensor))
            _move_tensor(module, tensor_name, is_param, target)
    if moved:
        log.debug("move %s: %s -> %s, %.1f MiB in %.1f ms (%s)", name, "+".join(sorted(sources)), want,
                  moved / 2**20, (time.perf_counter() - started) * 1e3, reason)


def stream_in(module: torch.nn.Module, want: Placement,
              pinned: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """Point a module's own tensors at copies on the compute device (`pinned` ones, by tensor name,
    in their own dtype); returns the at-rest tensors so `stream_out` can point back to them without
    copying anything back."""
    stash, pinned = {}, pinned or {}
    for store in (module._parameters, module._buffers):
        for name, tensor in store.items():
            target = _pinned_at(want, pinned, name)
            if tensor is not None and not _matches(tensor, target):
                stash[name] = tensor.data
                if store is module._parameters:
                    tensor.data = _moved(tensor.data, target)
                else:
                    store[name] = _moved(tensor, target)
    return stash


def stream_out(module: torch.nn.Module, stash: dict[str, torch.Tensor]) -> None:
    """Undo `stream_in`: the compute copies are dropped, the at-rest tensors are current again."""
    for name, tensor in stash.items():
        if name in module._parameters:
            module._parameters[name].data = tensor
        else:
            module._buffers[name] = tensor


def sync(pipe, plan: PlacementPlan, *, reason: str = "sync") -> int:
    """Repair every violation in place; returns how many tensors were moved or cast."""
    components = torch_components(pipe)
    repaired = 0
    for v in verify(pipe, plan):
        if v.component not in plan.components:
            raise PlacementError(f"{v.component} has no placement plan; cannot repair {v}")
        module = components[v.component].get_submodule(v.module) if v.module else components[v.component]
        is_param = v.tensor in module._parameters
        want = plan.expected_for(v.component, v.module, v.tensor)
        started = time.perf_counter()
        size = _bytes([module._parameters[v.tensor] if is_param else module._buffers[v.tensor]])
        _move_tensor(module, v.tensor, is_param, want, exact=True)
        repaired += 1
        log.debug("move %s: %s -> %s, %d bytes in %.2f ms (%s)", f"{v.component}.{v.module}.{v.tensor}",
                  v.actual, want, size, (time.perf_counter() - started) * 1e3, reason)
    return repaired


def apply_plan(pipe, plan: PlacementPlan, *, reason: str) -> None:
    """Bring every component to its at-rest placement; a final verify proves nothing was left behind."""
    for name, component in torch_components(pipe).items():
        move_component(component, name, plan.expected(name), reason=reason, pinned=plan.components[name].pinned)
    leftovers = verify(pipe, plan)
    if leftovers:
        raise PlacementError(f"{len(leftovers)} tensors not at their planned placement, e.g. {leftovers[0]}")
