"""One layer's output on a fixed input of its width: what a bypass forward, an fp8 layer or a fused
copy must reproduce, compared layer by layer without running a whole pipeline."""

from __future__ import annotations

import torch


def layer_output(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`module` applied (no grad) to a seeded random input in `dtype` (default: the weight's) on the
    weight's device; returned as float32 on the CPU so outputs of any dtype and device compare."""
    weight = module.weight
    if isinstance(module, torch.nn.Conv2d):
        shape = (1, module.in_channels, 8, 8)
    elif isinstance(module, torch.nn.GroupNorm):
        shape = (1, module.num_channels, 4, 4)
    elif isinstance(module, torch.nn.LayerNorm):
        shape = (2, *module.normalized_shape)
    else:
        shape = (2, weight.shape[1])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        return module(x.to(weight.device, dtype or weight.dtype)).float().cpu()
