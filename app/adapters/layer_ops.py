"""How each layer type applies a weight and bias to its input, for bypass forwards.

A bypass adds an adapter's contribution to a layer's output instead of changing its weight:
y = base(x) + Σ mᵢ·op(x, ΔWᵢ, Δbᵢ). That is exact for every layer type here because each is
affine in (W, b) for a fixed input: linear and convolution outright, embeddings as a lookup,
and the norms once x is normalised (y = x̂·w + b). So `op(x, ΔW, Δb)` is the layer's own
operation with the delta in place of its weight — with the layer's stride, padding, groups and
eps — plus Δb broadcast along the layer's bias axis (added straight onto the output shape, so a
bias-only adapter costs no extra operation).

A table by layer class (no if/elif ladder over types); `op_for` walks the class's MRO so
subclasses (diffusers' and transformers' own Linear/Conv subclasses) resolve to their base.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def weight_shape(module: torch.nn.Module) -> tuple[int, ...]:
    """The shape a layer's weight stands for, from the layer's own configuration (a GGUF layer's packed
    weight has another shape: app/engine/codecs.py): Linear (out, in), ConvNd (out, in/groups, *kernel)."""
    if isinstance(module, torch.nn.Linear):
        return (module.out_features, module.in_features)
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return (module.out_channels, module.in_channels // module.groups, *module.kernel_size)
    return tuple(module.weight.shape)


def _channel_view(t: Tensor, x: Tensor, channel_dim: int) -> Tensor:
    """A per-channel vector shaped to broadcast along `channel_dim` of `x`."""
    shape = [1] * x.dim()
    shape[channel_dim] = -1
    return t.reshape(shape)


def _linear(module: torch.nn.Linear, x: Tensor, dw: Tensor) -> Tensor:
    return F.linear(x, dw)


def _conv(module: torch.nn.Conv2d, x: Tensor, dw: Tensor) -> Tensor:
    # `_conv_forward` honours the layer's padding mode (zeros, reflect, circular) as its forward does.
    return module._conv_forward(x, dw, None)


def _group_norm(module: torch.nn.GroupNorm, x: Tensor, dw: Tensor) -> Tensor:
    return F.group_norm(x, module.num_groups, None, None, module.eps) * _channel_view(dw, x, 1)


def _layer_norm(module: torch.nn.LayerNorm, x: Tensor, dw: Tensor) -> Tensor:
    return F.layer_norm(x, module.normalized_shape, None, None, module.eps) * dw


def _embedding(module: torch.nn.Embedding, ids: Tensor, dw: Tensor) -> Tensor:
    return F.embedding(ids, dw)


def _linear_low_rank(module: torch.nn.Linear, x: Tensor, down: Tensor, mid: Tensor | None, up: Tensor) -> Tensor | None:
    if mid is not None:
        return None
    return F.linear(F.linear(x, down.flatten(1)), up.flatten(1))


def _conv_low_rank(module: torch.nn.Conv2d, x: Tensor, down: Tensor, mid: Tensor | None, up: Tensor) -> Tensor | None:
    """down carries the layer's kernel (or a Tucker `mid` does, between 1×1 down and up), with the
    layer's stride, padding and dilation; grouped or non-zero-padded convs materialise instead."""
    if module.groups != 1 or module.padding_mode != "zeros":
        return None
    geometry = (module.stride, module.padding, module.dilation)
    rank = down.shape[0]
    if mid is None:
        hidden = F.conv2d(x, down.reshape(rank, *module.weight.shape[1:]), None, *geometry)
    else:
        hidden = F.conv2d(F.conv2d(x, down.reshape(rank, -1, 1, 1)), mid, None, *geometry)
    return F.conv2d(hidden, up.reshape(up.shape[0], -1, 1, 1))


@dataclass(frozen=True)
class LayerOp:
    """A layer's operation with a given weight (no bias), the output axis its bias runs along, and,
    where the layer has one, its low-rank path up·[mid]·down applied to x without building ΔW."""

    apply_weight: Callable[[torch.nn.Module, Tensor, Tensor], Tensor]
    bias_dim: int  # 1 for channels-first layers, -1 for channels-last (trailing-axes broadcast)
    low_rank: Callable[[torch.nn.Module, Tensor, Tensor, Tensor | None, Tensor], Tensor | None] | None = None

    def __call__(self, module: torch.nn.Module, x: Tensor, dw: Tensor | None, db: Tensor | None,
                 output: Tensor) -> Tensor | None:
        """op(x, ΔW) + Δb broadcast like the layer's bias, or None when both are absent."""
        out = None if dw is None else self.apply_weight(module, x, dw)
        if db is not None:
            bias = _channel_view(db, output, 1) if self.bias_dim == 1 else db
            out = bias if out is None else out + bias
        return out


LAYER_OPS: dict[type[torch.nn.Module], LayerOp] = {
    torch.nn.Linear: LayerOp(_linear, -1, _linear_low_rank),
    torch.nn.Conv2d: LayerOp(_conv, 1, _conv_low_rank),
    torch.nn.GroupNorm: LayerOp(_group_norm, 1),
    torch.nn.LayerNorm: LayerOp(_layer_norm, -1),
    torch.nn.Embedding: LayerOp(_embedding, -1),
}


def op_for(module: torch.nn.Module) -> LayerOp | None:
    """The bypass operation for `module`'s class, or None when it has none (then the adapter
    cannot be applied as a bypass to it, and the caller says so)."""
    for cls in type(module).__mro__:
        if cls in LAYER_OPS:
            return LAYER_OPS[cls]
    return None


def output_dtype(module: torch.nn.Module, x: Tensor) -> torch.dtype:
    """The dtype the layer computes in: its input's for float inputs, its weight's for an index
    lookup (embeddings take integer ids)."""
    return x.dtype if x.is_floating_point() else module.weight.dtype
