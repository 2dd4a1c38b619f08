"""Fuse adapters into weights in place, from exact backups; re-weight and restore bit-exactly.

The rules that make the seed crashes unreachable:

* A layer's original weight (and bias, if an adapter changes it) is backed up once, bit-exact,
  in its own dtype, the first time any adapter touches it. The fused value is always
  recomputed from that backup: W = W0 + Σ mᵢ·ΔWᵢ(W0) in float32, cast once — never by
  subtracting an old delta, which drifts in bf16 and was SD.Next's "previous networks" bug.
* The result is written with `copy_` into the existing tensor, so device, dtype, the
  `Parameter` object and any hooks are untouched: no code here chooses a device.
* Stacked adapters are all computed against W0. For algorithms whose delta depends on W
  (GLoRA, DoRA, IA3, OFT) that means each sees the original weight, not the others' output:
  order-independent and exactly undoable, at the cost of not composing them as a chain.
* Backup policy: beside the weight when it lives on the CPU. A GPU weight's backup stays on the GPU
  by default (`gpu_backups`) while `GPU_BACKUP_HEADROOM` stays free, else it goes to pinned CPU
  memory. Why beside the weight: a re-weight reads W0 of every layer the LoRA touches, and from the
  host that is the layer's whole weight over PCIe each time — 1.46 GB for the bench's three rank-64
  LoRAs on SD1.5 (a LoCon covers the convs), over 30 ms at 50 GB/s before any math, so a slider move
  cannot reach 20 ms. That was issue 41's regression: pinned host backups became the default
  (b02cf8f) and a re-weight went from 48 to 503 ms on an H100 (476 ms of it patching: `.to(cuda,
  float32)` from a host tensor widens on the CPU and copies twice the bytes, pageable, per layer).
  The price is VRAM (1.58 GiB for those LoRAs); `gpu_backups=False` (`--lora-backups cpu`) buys it
  back at that transfer per re-weight. On the pinned path nothing blocks per layer: restores and
  reads are non-blocking copies, and the copies into new backups are waited for once per change.
  `traffic` counts what a change moved across (the bench's row and the tests read it).
* The float32 math runs on the engine's compute device wherever the weight rests (a CPU weight
  under an offload mode included): the same float32 products give the same bits in every
  offload mode — on an H100, CPU-side fusion moved bf16 weights by an ulp and images by 0.9
  grey levels, nearly what a 0.1 strength step changes — and the GPU does the matmuls faster.
* Bypass instead of fused for the components the engine names (weights streamed in per forward,
  or resting in another dtype than they compute in): there each patched layer gets a
  `lora.bypass` hook that adds Σ mᵢ·Δᵢ(x) to its output (app/adapters/bypass.py); the stored
  weights stay the checkpoint's, no backup is held, and a re-weight only replaces the hook's list.
* `reconcile` is all or nothing: every adapter is parsed and shape-checked before the first
  write, and a failure mid-way recomputes each touched layer from the previous applied list.
* A LoRA applied with tensors that match nothing is never quiet: one WARNING per LoRA file on this
  model, naming the count and the first keys. One that matches less than half of its tensors
  applies only where `allows_partial(name)` says the user allowed it (app/adapters/matching.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import psutil
import torch

from app.adapters.bypass import BypassLayer, Contributions
from app.adapters.bypass import install as install_bypass
from app.adapters.errors import LoraApplyError
from app.adapters.files import AdapterFile
from app.adapters.keys import KeyTable, Target
from app.adapters.matching import MatchReport, PreparedAdapter, match_adapter
from app.adapters.specs import LoraSpec
from app.adapters.stepping import SteppedLayer, StepStrengths
from app.hooks import HookRegistry

log = logging.getLogger(__name__)
GPU_BACKUP_HEADROOM = 2 * 2**30


def _never(_name: str) -> bool:
    return False


@dataclass
class _Backup:
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class PatchTraffic:
    """What one `reconcile` moved: the costs a slider move pays on an accelerator that a CPU hides.
    `backup_bytes_read`: originals (W0, and biases) read to recompute or restore layers;
    `bytes_across`: bytes copied between the compute device and backups held elsewhere (over PCIe on
    a GPU with host backups; 0 when backups sit beside the weights); `waits`: times the host waited
    for the device (one per change that wrote pinned backups, never one per layer); `written`: the
    layers rewritten (in place: the only tensors whose placement the change could touch)."""

    written: tuple[Target, ...] = ()
    backup_bytes_read: int = 0
    bytes_across: int = 0
    waits: int = 0

    @property
    def layers_written(self) -> int:
        return len(self.written)

    def read(self, backup: torch.Tensor | None, device: torch.device) -> None:
        """Count one backup tensor read towards `device`."""
        if backup is not None:
            self.backup_bytes_read += backup.nbytes
            self.bytes_across += backup.nbytes if backup.device != device else 0


def _combine(target: Target, contributions: Contributions, weight: torch.Tensor, bias: torch.Tensor | None,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W0 + Σ mᵢ·ΔWᵢ(W0) in float32 on `device`, and likewise the bias when an adapter changes it
    (None when none does); under `torch.no_grad()`. Both are contiguous whatever the weight's layout: a channels_last
    accumulator would send `LoRA.accumulate` down its slow generic path and change the float32 sum's
    bits; `copy_` writes the result back in the weight's own layout."""
    contiguous = torch.contiguous_format
    # Across the bus in the stored dtype first, asynchronously where the source is pinned (a GPU
    # weight's backup): one blocking transfer per layer made a 3-LoRA re-weight on SD1.5 take 476 ms
    # on an H100. The widening to float32 then runs on `device`; the bits are the same either way.
    # No `.detach()` here: the caller runs under `no_grad` (each was one more dispatched op per tensor
    # per contribution, 5 per layer of 17 in all on the bench's LoRAs).
    weight = weight.to(device, non_blocking=True)
    new_w = weight.to(torch.float32, copy=True, memory_format=contiguous)
    # A separate pristine W0 only when some adapter reads its values; the others read its shape.
    reads_base = any(a.reads_base for _, _, a in contributions)
    w0 = weight.to(torch.float32, memory_format=contiguous) if reads_base else new_w
    b0 = None if bias is None else bias.to(device, non_blocking=True).to(torch.float32)
    new_b = None
    for name, strength, adapter in contributions:
        try:
            bias_delta = adapter.accumulate(new_w, w0, b0, strength)
        except torch.OutOfMemoryError:
            raise  # memory, not this LoRA: reported as such, never counted against it
        except Exception as exc:
            raise LoraApplyError(name, f"failed while patching {target[0]}.{target[1]}: {exc}") from exc
        if bias_delta is not None:
            if b0 is None:
                raise LoraApplyError(name, f"{target[0]}.{target[1]} has no bias but the adapter changes one")
            new_b = b0.clone() if new_b is None else new_b
            new_b.add_(bias_delta, alpha=strength)
    return new_w, new_b


def _cast_where_computed(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A float32 result bound for a weight on another device (a CPU-resting weight under model or
    balanced offload) is cast before it crosses the bus: half the bytes for fp16/bf16 weights."""
    return value if value.device == target.device else value.to(target.dtype)


def backup_beside(device_type: str, gpu_backups: bool, nbytes: int, room: int) -> bool:
    """Whether a weight's backup stays beside it (same device) rather than in pinned host memory: always
    off CUDA (a host weight, or a device with no pinned memory); for a CUDA weight, by the policy while
    `room` (free bytes above the headroom, `_device_room`) holds it."""
    return device_type != "cuda" or (gpu_backups and nbytes <= room)


def _device_room(device: torch.device) -> int:
    """Free CUDA memory above `GPU_BACKUP_HEADROOM`, asked of the driver once per change, not per layer."""
    free, _total = torch.cuda.mem_get_info(device)
    return max(0, free - GPU_BACKUP_HEADROOM)


def _memory_name(tensor: torch.Tensor) -> str:
    if tensor.device.type != "cpu":
        return f"{tensor.device.type.upper()} memory"
    return "pinned CPU memory" if tensor.is_pinned() else "CPU memory"


class LoraStack:
    """The adapters applied to one pipeline (fused, or as bypass forwards), with what is needed to
    change or undo them. `bypass` names the components whose layers take bypass hooks."""

    def __init__(self, pipe, family_name: str, compute_device: torch.device | None = None, *,
                 hooks: HookRegistry | None = None, bypass: frozenset[str] = frozenset(),
                 gpu_backups: bool = True, allows_partial: Callable[[str], bool] = _never) -> None:
        self._gpu_backups = gpu_backups
        self._room: dict[torch.device, int] = {}  # accelerator bytes backups may still take, this change
        self._queued: set[torch.device] = set()  # devices with copies into pinned backups not waited for
        self.traffic = PatchTraffic()  # what the last `reconcile` moved
        self._allows_partial = allows_partial
        self._warned: set[tuple[str, str]] = set()  # (LoRA, file hash) whose unmatched tensors were logged
        self._pipe = pipe
        self._hooks = hooks if hooks is not None else HookRegistry()
        self._bypass_components = frozenset(bypass)
        self._bypassed: dict[Target, BypassLayer] = {}
        self._family_name = family_name
        self._compute_device = compute_device
        self._table: KeyTable | None = None
        self._modules: dict[Target, torch.nn.Module] = {}
        self._backups: dict[Target, _Backup] = {}
        self._applied: tuple[LoraSpec, ...] = ()
        self._prepared: dict[str, PreparedAdapter] = {}

    @property
    def applied(self) -> tuple[LoraSpec, ...]:
        return self._applied

    def patched_modules(self) -> dict[Target, tuple[str, ...]]:
        out: dict[Target, list[str]] = {}
        for spec in self._applied:
            for target in self._prepared[spec.name].layers:
                out.setdefault(target, []).append(spec.name)
        return {k: tuple(v) for k, v in out.items()}

    def culprits(self, exc: BaseException) -> tuple[str, ...]:
        """LoRAs patched into the innermost patched module on `exc`'s traceback (none if no such frame)."""
        by_module = {id(self._modules[t]): names for t, names in self.patched_modules().items() if t in self._modules}
        found: tuple[str, ...] = ()
        tb = exc.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if id(owner) in by_module:
                found = by_module[id(owner)]
            tb = tb.tb_next
        return found

    def backup_summary(self) -> str:
        """How many layers' originals are held, their size and where: the answer to "where did my
        VRAM go with LoRAs on" in Diagnostics and bug reports."""
        tensors = [t for b in self._backups.values() for t in (b.weight, b.bias) if t is not None]
        if not tensors:
            return "none"
        size = sum(t.numel() * t.element_size() for t in tensors)
        places = " and ".join(sorted({_memory_name(t) for t in tensors}))
        return f"{len(self._backups)} layers, {size / 2**20:.2f} MiB ({size:,} bytes) in {places}"

    @property
    def bypass_components(self) -> frozenset[str]:
        return self._bypass_components

    def bypassed(self) -> dict[Target, Contributions]:
        """The layers applied as bypass forwards, with the (name, strength, adapter) each adds."""
        return {target: layer.contributions for target, layer in self._bypassed.items()}

    def release(self) -> None:
        """Forget backups, hooks and adapters (the pipeline is being dropped)."""
        for target in list(self._bypassed):
            self._hooks.remove(self._module(target), "lora.bypass")
        self._bypassed.clear()
        self._backups.clear()
        self._prepared.clear()
        self._modules.clear()
        self._applied = ()

    def still_fitting(self) -> frozenset[str]:
        """Applied LoRAs whose fit check still stands: all but those applied in part under an
        allowance the user has since withdrawn (they must be checked, and refused, again)."""
        return frozenset(spec.name for spec in self._applied if self._reusable(spec.name) is not None)

    def _reusable(self, name: str, file: AdapterFile | None = None) -> PreparedAdapter | None:
        """The prepared adapter of an applied LoRA, while its file (when given) and its allowance hold."""
        old = self._prepared.get(name)
        if old is None or (file is not None and not old.file.same_as(file)):
            return None
        return None if old.report.partial and not self._allows_partial(name) else old

    def modules_of(self, targets: Sequence[Target]) -> tuple[tuple[str, str, torch.nn.Module], ...]:
        """(component, path, module) of each target, from the stack's own lookups (what the placement
        verify after a LoRA change reads without resolving a path per layer)."""
        return tuple((*target, self._module(target)) for target in targets)

    # ---------------------------------------------------------------- preparation (no writes)
    def _module(self, target: Target) -> torch.nn.Module:
        if target not in self._modules:
            component, path = target
            self._modules[target] = getattr(self._pipe, component).get_submodule(path)
        return self._modules[target]

    def prepare(self, name: str, file: AdapterFile, *, upload: bool = True) -> PreparedAdapter:
        """Parse and shape-check every layer of a file against this model; raise before any write.

        With `upload`, each layer's tensors then go to the compute device once: every later re-weight
        computes without a host-to-device copy. Layers of fused components go in float32, the dtype the
        fused math reads them in (`_f32`): a cast of each factor per layer per re-weight was 40% of a
        re-weight's ops, each a kernel launch on a GPU (issue 41); the values are the file's exactly
        (fp16 and bf16 are subsets of float32), for twice the factors' memory (~150 MB more for three
        rank-64 LoRAs on SD1.5). Bypass layers keep the file's dtype (their forwards cast once per
        re-weight anyway). An inspection uploads nothing."""
        if self._table is None:
            self._table = KeyTable(self._pipe, self._family_name)
        prepared = match_adapter(name, file, self._table, self._module, allow_partial=self._allows_partial(name))
        if not upload or self._compute_device is None:
            return prepared
        fused = frozenset(component for component, _ in prepared.layers) - self._bypass_components
        return prepared.to(self._compute_device, float32_components=fused)

    # ---------------------------------------------------------------- writes
    def reconcile(self, specs: Sequence[LoraSpec], files: Mapping[str, AdapterFile],
                  progress: Callable[[int, int], None] | None = None) -> dict[str, MatchReport]:
        """Make the fused weights equal W0 + Σ strengths·ΔW for exactly `specs`; all or nothing.
        `progress(done, total)` is called after each layer written (the UI's "patching" bar)."""
        specs = tuple(specs)
        prepared = {}
        for spec in specs:
            prepared[spec.name] = (self._reusable(spec.name, files[spec.name])
                                   or self.prepare(spec.name, files[spec.name]))
        touched = self._touched_layers(specs, prepared)
        previous = (self._applied, dict(self._prepared))
        written: list[Target] = []
        self.traffic, self._room = PatchTraffic(), {}
        try:
            for target in touched:
                written.append(target)
                self._write_layer(target, specs, prepared)
                if progress is not None:
                    progress(len(written), len(touched))
        except Exception:
            self._rollback(written, *previous)
            raise
        finally:
            self._settle_backups()
        self.traffic.written = tuple(touched)
        self._applied = specs
        self._prepared = {spec.name: prepared[spec.name] for spec in specs}
        log.debug("LoRA stack now %s; %d layers rewritten, %d backups held",
                  [(s.name, s.unet_strength, s.te_strength) for s in specs], len(touched), len(self._backups))
        for spec in specs:
            self._warn_unmatched(spec.name, prepared[spec.name])
        return {spec.name: prepared[spec.name].report for spec in specs}

    def _warn_unmatched(self, name: str, prepared: PreparedAdapter) -> None:
        """The log line a console user sees when a LoRA applies without part of its tensors: once per
        LoRA file on this model (a re-weight or a re-add says nothing new)."""
        report, key = prepared.report, (name, prepared.file.short_hash)
        if not report.unmatched_keys or key in self._warned:
            return
        self._warned.add(key)
        allowed = " (partial application allowed for this LoRA)" if report.partial else ""
        log.warning("LoRA %s applied in part%s: %d of its %d tensors matched nothing in this %s model, e.g. %s",
                    name, allowed, report.unmatched_keys, report.total_keys, report.fits,
                    ", ".join(report.unmatched_examples))

    def _touched_layers(self, specs, prepared) -> list[Target]:
        """Layers whose fused value changes: those of LoRAs added, removed, re-weighted or replaced."""
        old = {s.name: s for s in self._applied}
        new = {s.name: s for s in specs}
        touched: dict[Target, None] = {}
        for name in old.keys() | new.keys():
            if old.get(name) == new.get(name) and self._prepared.get(name) is prepared.get(name):
                continue
            for source in (self._prepared.get(name), prepared.get(name)):
                if source is not None:
                    touched.update(dict.fromkeys(source.layers))
        return list(touched)

    @staticmethod
    def _contributions(target: Target, specs, prepared) -> Contributions:
        """(name, strength, adapter) of every spec touching `target`. A fixed order (by name) makes the float32
        sum, and so the bits, independent of list order."""
        return tuple((s.name, s.strength_for(target[0]), prepared[s.name].layers[target])
                     for s in sorted(specs, key=lambda s: s.name) if target in prepared[s.name].layers)

    def _write_layer(self, target: Target, specs, prepared) -> None:
        module = self._module(target)
        contributions = self._contributions(target, specs, prepared)
        if target[0] in self._bypass_components:
            self._set_bypass(module, target, contributions)
            return
        with torch.no_grad():  # one grad-mode switch per layer instead of a `.detach()` per tensor read
            self._fuse_layer(target, module, contributions)

    def _fuse_layer(self, target: Target, module: torch.nn.Module, contributions: Contributions) -> None:
        """Write W0 + Σ contributions into the layer (W0 back when there are none), from its backup."""
        backup = self._backups.get(target)
        if not contributions:
            if backup is not None:
                self.traffic.read(backup.weight, module.weight.device)
                self.traffic.read(backup.bias, module.weight.device)
                self._restore(module, backup)
                del self._backups[target]
            return
        base = backup.weight if backup is not None else module.weight
        base_bias = backup.bias if backup is not None and backup.bias is not None else module.bias
        device = self._compute_device or module.weight.device
        if backup is not None:
            self.traffic.read(backup.weight, device)
            self.traffic.read(backup.bias, device)
        new_w, new_b = _combine(target, contributions, base, base_bias, device)
        if backup is None:
            backup = self._backups[target] = _Backup(self._backup_copy(module.weight), None)
        if new_b is not None and backup.bias is None:
            backup.bias = self._backup_copy(module.bias)
        module.weight.copy_(_cast_where_computed(new_w, module.weight))
        if new_b is not None:
            module.bias.copy_(_cast_where_computed(new_b, module.bias))
        elif backup.bias is not None:  # the adapter that changed the bias is gone
            self.traffic.read(backup.bias, module.bias.device)
            module.bias.copy_(backup.bias, non_blocking=True)
            backup.bias = None

    def _backup_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A bit-exact copy of `tensor` in its dtype and memory layout, placed by the backup policy
        (`backup_beside`). A copy to pinned memory is queued, not waited for: `_settle_backups` waits
        once for all of a change's, so no layer costs the host a round trip."""
        device = tensor.device
        if device.type == "cuda" and device not in self._room:
            self._room[device] = _device_room(device) if self._gpu_backups else 0
        if backup_beside(device.type, self._gpu_backups, tensor.nbytes, self._room.get(device, 0)):
            if device in self._room:
                self._room[device] -= tensor.nbytes
            return tensor.clone()
        pinned = torch.empty_like(tensor, device="cpu", pin_memory=True)  # keeps the strides (channels_last)
        self.traffic.bytes_across += tensor.nbytes
        self._queued.add(device)  # `_settle_backups` waits for the copies queued on it
        return pinned.copy_(tensor, non_blocking=True)

    def _settle_backups(self) -> None:
        """Wait once for the copies into pinned backups this change queued: from here on a backup may be
        read on the host (a restore after the weight moved to the CPU) and must hold its values."""
        for device in self._queued:
            torch.cuda.synchronize(device)
        self.traffic.waits += len(self._queued)
        self._queued.clear()

    # ---------------------------------------------------------------- scheduled strengths
    def stepping(self, total: int) -> StepStrengths | None:
        """The step-by-step strengths of the applied LoRAs that carry a schedule, for one pass of `total`
        steps (app/adapters/stepping.py); None when none does. Only the denoiser's layers step: a text
        encoder keeps the step-0 strength."""
        schedules = {s.name: s.schedule for s in self._applied if s.schedule is not None}
        if not schedules:
            return None
        targets = [t for t, names in self.patched_modules().items()
                   if not t[0].startswith("text_encoder") and schedules.keys() & set(names)]
        return StepStrengths(total, schedules, [t for t in targets if t[0] not in self._bypass_components],
                             [t for t in targets if t[0] in self._bypass_components], build=self._stepped_layer,
                             rewrite=self._rewrite_at, room=self._step_cache_room)

    def _stepped_layer(self, target: Target, scheduled: frozenset[str]) -> SteppedLayer:
        """One fused layer's parts for a scheduled pass, from its exact backup: B = W0 + Σ constant
        contributions (as `_combine` fuses them) and each scheduled LoRA's ΔW at strength 1 (as it adds it)."""
        module, backup = self._module(target), self._backups[target]
        device = self._compute_device or module.weight.device
        contributions = self._contributions(target, self._applied, self._prepared)
        bias = backup.bias if backup.bias is not None else module.bias
        with torch.no_grad():
            base, base_bias = _combine(target, tuple(c for c in contributions if c[0] not in scheduled),
                                       backup.weight, bias, device)
            w0 = backup.weight.to(device).to(torch.float32, memory_format=torch.contiguous_format)
            b0 = None if bias is None else bias.to(device).to(torch.float32)
            deltas = []
            for name, _strength, adapter in (c for c in contributions if c[0] in scheduled):
                delta = torch.zeros_like(w0)
                deltas.append((name, delta, adapter.accumulate(delta, w0, b0, 1.0)))
        if base_bias is None and any(db is not None for _, _, db in deltas):
            base_bias = b0
        return SteppedLayer(module, base, base_bias, tuple(deltas))

    def _rewrite_at(self, targets: Sequence[Target], strengths: Mapping[str, float]) -> None:
        """Recompute `targets` from their backups (fused) or hook lists (bypass) with the named LoRAs' denoiser
        at `strengths` and the others as applied; {}: everything as applied (at rest)."""
        specs = tuple(s.with_denoiser_strength(strengths[s.name]) if s.name in strengths else s
                      for s in self._applied)
        for target in targets:
            self._write_layer(target, specs, self._prepared)

    def _step_cache_room(self) -> int:
        """Bytes a scheduled pass's float32 parts may take on the compute device: free CUDA memory above the
        headroom; on the host, the memory available above the same headroom."""
        device = self._compute_device
        if device is not None and device.type == "cuda":
            return _device_room(device)
        return max(0, psutil.virtual_memory().available - GPU_BACKUP_HEADROOM)

    # ---------------------------------------------------------------- the bypass path
    def set_bypass(self, components: frozenset[str]) -> None:
        """Change which components take LoRAs as bypass forwards instead of fused weights. Every
        patched layer is first taken back to W0 under the old policy, then re-applied under the new
        one; on failure the old policy is re-applied (fused bits recomputed from W0, so exact)."""
        components = frozenset(components)
        if components == self._bypass_components:
            return
        specs, prepared = self._applied, dict(self._prepared)
        targets = list(self.patched_modules())
        previous = self._bypass_components
        for target in targets:
            self._write_layer(target, (), {})
        self._bypass_components = components
        try:
            for target in targets:
                self._write_layer(target, specs, prepared)
        except Exception:
            for target in targets:
                self._write_layer(target, (), {})
            self._bypass_components = previous
            for target in targets:
                self._write_layer(target, specs, prepared)
            raise

    def _set_bypass(self, module: torch.nn.Module, target: Target, contributions: Contributions) -> None:
        """Install, update or remove one layer's bypass hook; the stored weights are never written."""
        layer = self._bypassed.get(target)
        if layer is not None and contributions:
            layer.replace(contributions)
        elif layer is not None:
            self._hooks.remove(module, "lora.bypass")
            del self._bypassed[target]
        elif contributions:
            self._bypassed[target] = install_bypass(self._hooks, module, f"{target[0]}.{target[1]}", contributions)

    @staticmethod
    def _restore(module: torch.nn.Module, backup: _Backup) -> None:
        """W0 back, bit for bit (under `no_grad`). Non-blocking: from device memory it is a plain device
        copy, and from a pinned backup the host allocator keeps that memory until the copy is done, so
        dropping the backup right after is safe and no layer makes the host wait."""
        module.weight.copy_(backup.weight, non_blocking=True)
        if backup.bias is not None:
            module.bias.copy_(backup.bias, non_blocking=True)

    def _rollback(self, written: list[Target], old_specs, old_prepared) -> None:
        """Recompute each layer written so far from the previous list: bit-identical to before."""
        for target in written:
            self._write_layer(target, old_specs, old_prepared)
