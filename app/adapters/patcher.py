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
* Backup policy: beside the weight when it lives on the CPU, or on a GPU with room to spare
  (re-weighting then needs no host transfer); otherwise in pinned CPU memory.
* The float32 math runs on the engine's compute device wherever the weight rests (a CPU weight
  under an offload mode included): the same float32 products give the same bits in every
  offload mode — on an H100, CPU-side fusion moved bf16 weights by an ulp and images by 0.9
  grey levels, nearly what a 0.1 strength step changes — and the GPU does the matmuls faster.
* `reconcile` is all or nothing: every adapter is parsed and shape-checked before the first
  write, and a failure mid-way recomputes each touched layer from the previous applied list.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from app.adapters.algos import parse_layer
from app.adapters.errors import AdapterError, IncompatibleAdapterError
from app.adapters.files import AdapterFile
from app.adapters.keys import KeyTable, Target, architecture_hint
from app.adapters.specs import LoraSpec

log = logging.getLogger(__name__)
GPU_BACKUP_HEADROOM = 2 * 2**30


class LoraApplyError(AdapterError):
    """Applying one named LoRA failed; nothing of the new list was kept."""

    def __init__(self, lora_name: str, message: str) -> None:
        named = message.startswith(f"LoRA {lora_name!r}")  # e.g. the library's "LoRA 'x' not found"
        super().__init__(message if named else f"LoRA {lora_name!r}: {message}")
        self.lora_name = lora_name


@dataclass(frozen=True)
class MatchReport:
    matched_layers: int
    unmatched_keys: int
    message: str = ""


@dataclass(frozen=True)
class _Prepared:
    """One adapter file parsed against this model: per target module, its algorithm object."""

    file: AdapterFile
    layers: Mapping[Target, object]
    report: MatchReport


@dataclass
class _Backup:
    weight: torch.Tensor
    bias: torch.Tensor | None


def _backup_copy(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(tensor.device)
        if free - tensor.numel() * tensor.element_size() < GPU_BACKUP_HEADROOM:
            return tensor.detach().to("cpu", copy=True).pin_memory()
    return tensor.detach().clone()


class LoraStack:
    """The adapters fused into one pipeline, with the backups needed to change or undo them."""

    def __init__(self, pipe, arch: str, compute_device: torch.device | None = None) -> None:
        self._pipe = pipe
        self._arch = arch
        self._compute_device = compute_device
        self._table: KeyTable | None = None
        self._modules: dict[Target, torch.nn.Module] = {}
        self._backups: dict[Target, _Backup] = {}
        self._applied: tuple[LoraSpec, ...] = ()
        self._prepared: dict[str, _Prepared] = {}

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

    def release(self) -> None:
        """Forget backups and adapters (the pipeline is being dropped)."""
        self._backups.clear()
        self._prepared.clear()
        self._modules.clear()
        self._applied = ()

    # ---------------------------------------------------------------- preparation (no writes)
    def _module(self, target: Target) -> torch.nn.Module:
        if target not in self._modules:
            component, path = target
            self._modules[target] = getattr(self._pipe, component).get_submodule(path)
        return self._modules[target]

    def prepare(self, name: str, file: AdapterFile) -> _Prepared:
        """Parse and shape-check every layer of a file against this model; raise before any write."""
        if self._table is None:
            self._table = KeyTable(self._pipe, self._arch)
        layers: dict[Target, object] = {}
        unmatched: list[str] = []
        mismatched: list[str] = []
        for group in self._table.group(file.tensors):
            if group.target is None:
                unmatched.append(group.key)
                continue
            try:
                adapter = parse_layer(group.key, self._on_compute_device(group.tensors))
                module = self._module(group.target)
                adapter.validate_against(tuple(module.weight.shape))
            except IncompatibleAdapterError as exc:
                mismatched.append(str(exc))
                continue
            except AdapterError as exc:
                raise LoraApplyError(name, str(exc)) from exc
            layers[group.target] = adapter
        self._check_fit(name, file, layers, unmatched, mismatched)
        if unmatched:
            log.debug("LoRA %s: %d unmatched layer keys: %s", name, len(unmatched), ", ".join(sorted(unmatched)))
        message = f"{len(unmatched)} layer keys matched nothing in the model" if unmatched else ""
        return _Prepared(file, layers, MatchReport(len(layers), len(unmatched), message))

    def _on_compute_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Adapter tensors are uploaded once, in the file's dtype, when a LoRA is prepared: every later
        re-weight then computes without a host-to-device copy per layer."""
        if self._compute_device is None:
            return tensors
        return {k: v.to(self._compute_device) for k, v in tensors.items()}

    def _check_fit(self, name: str, file: AdapterFile, layers, unmatched, mismatched) -> None:
        hint = architecture_hint(file.tensors, file.metadata)
        made_for = f" (it looks made for {hint.upper()})" if hint and hint != self._arch else ""
        if made_for:  # refused even where some shapes happen to fit: half a foreign LoRA is no LoRA
            raise LoraApplyError(name, f"does not fit this {self._arch.upper()} model{made_for}, even though "
                                       f"{len(layers)} of its layers fit by shape; nothing applied")
        if mismatched:
            raise LoraApplyError(name, f"does not fit this {self._arch.upper()} model{made_for}: "
                                       f"{len(mismatched)} layers have the wrong shape, e.g. {mismatched[0]}")
        if not layers:
            raise LoraApplyError(name, f"matched zero of its {len(unmatched)} layers in this {self._arch.upper()} "
                                       f"model{made_for}; nothing applied")

    # ---------------------------------------------------------------- writes
    def reconcile(self, specs: Sequence[LoraSpec], files: Mapping[str, AdapterFile]) -> dict[str, MatchReport]:
        """Make the fused weights equal W0 + Σ strengths·ΔW for exactly `specs`; all or nothing."""
        specs = tuple(specs)
        prepared = {}
        for spec in specs:
            old = self._prepared.get(spec.name)
            same_file = old is not None and old.file.short_hash == files[spec.name].short_hash
            prepared[spec.name] = old if same_file else self.prepare(spec.name, files[spec.name])
        touched = self._touched_layers(specs, prepared)
        previous = (self._applied, dict(self._prepared))
        written: list[Target] = []
        try:
            for target in touched:
                written.append(target)
                self._write_layer(target, specs, prepared)
        except Exception:
            self._rollback(written, *previous)
            raise
        self._applied = specs
        self._prepared = {spec.name: prepared[spec.name] for spec in specs}
        log.debug("LoRA stack now %s; %d layers rewritten, %d backups held",
                  [(s.name, s.unet_strength, s.te_strength) for s in specs], len(touched), len(self._backups))
        return {spec.name: prepared[spec.name].report for spec in specs}

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

    def _write_layer(self, target: Target, specs, prepared) -> None:
        module = self._module(target)
        # A fixed order (by name) makes the float32 sum, and so the bits, independent of list order.
        contributions = [(s.name, s.strength_for(target[0]), prepared[s.name].layers[target])
                         for s in sorted(specs, key=lambda s: s.name) if target in prepared[s.name].layers]
        backup = self._backups.get(target)
        if not contributions:
            if backup is not None:
                self._restore(module, backup)
                del self._backups[target]
            return
        base = backup.weight if backup is not None else module.weight.detach()
        base_bias = backup.bias if backup is not None else None
        device = self._compute_device or module.weight.device
        w0 = base.to(device, torch.float32)
        b0 = None
        if module.bias is not None:
            b0 = (base_bias if base_bias is not None else module.bias.detach()).to(device, torch.float32)
        new_w, new_b = w0.clone(), None if b0 is None else b0.clone()
        for name, strength, adapter in contributions:
            try:
                delta = adapter.delta(w0, b0)
            except Exception as exc:
                raise LoraApplyError(name, f"failed while patching {target[0]}.{target[1]}: {exc}") from exc
            if delta.weight is not None:
                new_w.add_(delta.weight, alpha=strength)
            if delta.bias is not None:
                if new_b is None:
                    raise LoraApplyError(name, f"{target[0]}.{target[1]} has no bias but the adapter changes one")
                new_b.add_(delta.bias, alpha=strength)
        if backup is None:
            backup = self._backups[target] = _Backup(_backup_copy(module.weight), None)
        if new_b is not None and backup.bias is None and not torch.equal(new_b, b0):
            backup.bias = _backup_copy(module.bias)
        with torch.no_grad():
            module.weight.copy_(new_w)
            if backup.bias is not None:
                module.bias.copy_(new_b)

    @staticmethod
    def _restore(module: torch.nn.Module, backup: _Backup) -> None:
        with torch.no_grad():
            module.weight.copy_(backup.weight)
            if backup.bias is not None:
                module.bias.copy_(backup.bias)

    def _rollback(self, written: list[Target], old_specs, old_prepared) -> None:
        """Recompute each layer written so far from the previous list: bit-identical to before."""
        for target in written:
            self._write_layer(target, old_specs, old_prepared)
