"""LoRAs as bypass forwards: y = base(x) + Σ mᵢ·Δᵢ(x), added by a `lora.bypass` hook.

Where weights are not fused — streamed in per forward, or stored in another dtype than they
compute in — the layer keeps computing with its own, untouched weight and each adapter adds its
contribution to the output. Nothing swaps a `Parameter`, nothing rounds a delta into the storage
dtype, and removing a LoRA is removing a hook: the stored bytes never changed.

Per algorithm (`Adapter.bypass_forward`):

* LoRA/LoCon (plain and Tucker) on linear and conv layers run their factors on x directly,
  up(mid(down(x))) with the layer's stride and padding: two or three small matmuls/convs, no
  weight-sized tensor per forward. A layer's plain LoRAs (no Tucker core) run as ONE such pair:
  Σ mᵢ·sᵢ·upᵢ(downᵢ(x)) = [m₁s₁·up₁ … mₙsₙ·upₙ]([down₁; …; downₙ](x)), factors concatenated along
  the rank once per re-weight (`LoRA.joined`), so three LoRAs cost the ops of one; the
  other algorithms keep their own forward beside the joined one.
* Everything else materialises ΔW at calculation time, in float32 on the compute device from
  the weight the forward has in hand, rounds it once to the compute dtype and applies it with
  the layer's own operation: LoHa, LoKr, full and norm diffs (ΔW independent of W), and the
  algorithms whose ΔW depends on W — GLoRA, DoRA, IA3, OFT. That is exact because every layer
  type here is affine in its weight (see `layer_ops`).

The contribution is computed in the output's dtype (the layer's compute dtype): a float32 file on
a bf16 model leaks no float32 into the forward or into autograd (the Unsloth `expected BFloat16 but
found Float` and GLoRA `expected m1 and m2 to have the same dtype` reports).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.adapters.algos import LoRA
from app.adapters.algos.base import BypassForward
from app.adapters.errors import LoraApplyError
from app.adapters.layer_ops import LayerOp, op_for
from app.hooks import HookRegistry, ModelHook

Contributions = tuple[tuple[str, float, object], ...]  # (LoRA name, strength, adapter), sorted by name


@dataclass(frozen=True)
class _Part:
    """One forward of a layer's bypass and the contributions it adds: one adapter's, or every plain
    LoRA's joined into one pair of matmuls."""

    members: Contributions
    forward: BypassForward


@dataclass
class BypassLayer:
    """One layer's bypass: its operation and the adapters it adds (replaced on a re-weight).

    Its forwards are prepared on the first call in a compute dtype and device and kept until the
    contributions change: a streamed layer computes on the same device every step, so per-call work
    is the adapters' matmuls, not the casts of their factors. Two or more plain LoRAs join into one
    forward (`LoRA.joined`: factors concatenated, ranks summed, strengths folded in), so three cost
    the ops of one; the other algorithms keep their own forward beside it."""

    where: str
    op: LayerOp
    contributions: Contributions
    # (compute dtype, device) -> the forwards that add every contribution
    _prepared: dict[tuple[torch.dtype, torch.device], tuple[_Part, ...]] = field(default_factory=dict, repr=False)

    def replace(self, contributions: Contributions) -> None:
        """New strengths or adapters for this layer (a re-weight): the prepared forwards go with the old ones."""
        self.contributions = contributions
        self._prepared.clear()

    def output(self, module: torch.nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """`output` plus every contribution, each in the output's dtype."""
        key = (output.dtype, x.device)
        parts = self._prepared.get(key)
        if parts is None:
            parts = self._prepared[key] = self._prepare(module, x, output)
        total = None
        for part in parts:
            try:
                share = part.forward(module, x, self.op, output)
            except torch.OutOfMemoryError:
                raise  # the run's size, not a LoRA's fault: the engine reports it as memory
            except Exception as exc:
                raise self._blame(part.members, module, x, output, exc) from exc
            if share is not None:
                total = share if total is None else total + share
        return output if total is None else output + total

    def _prepare(self, module: torch.nn.Module, x: torch.Tensor, output: torch.Tensor) -> tuple[_Part, ...]:
        """The joined forward of the plain LoRAs (when two or more), then each other adapter's own."""
        joining = tuple(c for c in self.contributions if c[2].joins_bypass)
        joining = joining if len(joining) > 1 else ()
        alone = tuple((c,) for c in self.contributions if c not in joining)
        return tuple(self._part(members, module, x, output) for members in ((joining,) if joining else ()) + alone)

    def _part(self, members: Contributions, module: torch.nn.Module, x: torch.Tensor, output: torch.Tensor) -> _Part:
        """One adapter's forward at its strength, or the joined LoRA's at strength 1 (theirs are folded in)."""
        dtype, device = output.dtype, x.device
        try:
            if len(members) == 1:
                forward = members[0][2].bypass_forward(members[0][1], dtype, device)
            else:
                joined = LoRA.joined([(strength, lora) for _name, strength, lora in members], dtype, device, self.where)
                forward = joined.bypass_forward(1.0, dtype, device)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            raise self._blame(members, module, x, output, exc) from exc
        return _Part(members, forward)

    def _blame(self, members: Contributions, module: torch.nn.Module, x: torch.Tensor, output: torch.Tensor,
               exc: Exception) -> LoraApplyError:
        """The error for a failed forward, naming the LoRA at fault (the engine counts and forgets a
        refused LoRA by name). A joined forward's members are re-run alone, on this failure path only,
        to find it: naming all of them would blame the innocent ones. Should each run alone, the
        joining itself failed, and the error names every joined LoRA."""
        if len(members) > 1:
            for name, strength, adapter in members:
                try:
                    adapter.bypass_forward(strength, output.dtype, x.device)(module, x, self.op, output)
                except torch.OutOfMemoryError:
                    raise
                except Exception as own:
                    return LoraApplyError(name, f"failed in the bypass forward of {self.where}: {own}")
        names = " + ".join(name for name, _strength, _adapter in members)
        joined = " (joined; each runs alone)" if len(members) > 1 else ""
        return LoraApplyError(names, f"failed in the bypass forward of {self.where}{joined}: {exc}")


def install(hooks: HookRegistry, module: torch.nn.Module, where: str, contributions: Contributions) -> BypassLayer:
    """Add the `lora.bypass` hook to `module`; refuse (naming a LoRA) a layer type with no bypass op."""
    op = op_for(module)
    if op is None:
        raise LoraApplyError(contributions[0][0], f"{where} is a {type(module).__name__}, which cannot take an "
                                                  "adapter as a bypass forward; use offload none or model")
    layer = BypassLayer(where, op, contributions)
    hooks.add(module, ModelHook("lora.bypass", post=_post(layer)))
    return layer


def _post(layer: BypassLayer) -> Callable:
    def post(module, args, kwargs, output):
        x = args[0] if args else next(iter(kwargs.values()))
        return layer.output(module, x, output)
    return post
