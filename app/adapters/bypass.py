"""LoRAs as bypass forwards: y = base(x) + Σ mᵢ·Δᵢ(x), added by a `lora.bypass` hook.

Where weights are not fused — streamed in per forward, or stored in another dtype than they
compute in — the layer keeps computing with its own, untouched weight and each adapter adds its
contribution to the output. Nothing swaps a `Parameter`, nothing rounds a delta into the storage
dtype, and removing a LoRA is removing a hook: the stored bytes never changed.

Per algorithm (`Adapter.bypass_forward`):

* LoRA/LoCon (plain and Tucker) on linear and conv layers run their factors on x directly,
  up(mid(down(x))) with the layer's stride and padding: two or three small matmuls/convs, no
  weight-sized tensor per forward.
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

from app.adapters.algos.base import BypassForward
from app.adapters.errors import LoraApplyError
from app.adapters.layer_ops import LayerOp, op_for
from app.hooks import HookRegistry, ModelHook

Contributions = tuple[tuple[str, float, object], ...]  # (LoRA name, strength, adapter), sorted by name


@dataclass
class BypassLayer:
    """One layer's bypass: its operation and the adapters it adds (replaced on a re-weight).

    Each adapter's forward is prepared (`Adapter.bypass_forward`) on the first call in a compute
    dtype and device and kept until the contributions change: a streamed layer computes on the same
    device every step, so per-call work is the adapter's matmuls, not the casts of its factors."""

    where: str
    op: LayerOp
    contributions: Contributions
    # (compute dtype, device) -> LoRA name -> its prepared forward
    _prepared: dict[tuple[torch.dtype, torch.device], dict[str, BypassForward]] = field(default_factory=dict,
                                                                                       repr=False)

    def replace(self, contributions: Contributions) -> None:
        """New strengths or adapters for this layer (a re-weight): the prepared forwards go with the old ones."""
        self.contributions = contributions
        self._prepared.clear()

    def output(self, module: torch.nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """`output` plus every contribution, each in the output's dtype."""
        prepared = self._prepared.setdefault((output.dtype, x.device), {})
        total = None
        for name, strength, adapter in self.contributions:
            try:
                if name not in prepared:
                    prepared[name] = adapter.bypass_forward(strength, output.dtype, x.device)
                part = prepared[name](module, x, self.op, output)
            except torch.OutOfMemoryError:
                raise  # the run's size, not this LoRA's fault: the engine reports it as memory
            except Exception as exc:
                raise LoraApplyError(name, f"failed in the bypass forward of {self.where}: {exc}") from exc
            if part is not None:
                total = part if total is None else total + part
        return output if total is None else output + total


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
