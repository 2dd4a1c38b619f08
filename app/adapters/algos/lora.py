"""LoRA / LoCon (plain and Tucker)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from app.adapters.algos.base import (
    BypassForward,
    Shape,
    _algorithm,
    _f32,
    _Factored,
    _low_rank,
    _low_rank_dims,
    _low_rank_scale,
    _read_scalar,
    _require,
)
from app.adapters.errors import AdapterFormatError
from app.adapters.layer_ops import LayerOp


@_algorithm
class LoRA(_Factored):
    """LoRA / LoCon: ΔW = s · up · down, or s · up ×₁ mid ×₂ down with a Tucker `mid`.

    down (r, in[, kh, kw]), up (out, r[, 1, 1]); Tucker: mid (r, r, kh, kw) and a 1×1 down.
    `up_bias` (out,) is PEFT's `lora_bias=True` (a bias on lora_B): Δb = s · up_bias.
    """

    down: Tensor
    up: Tensor
    mid: Tensor | None = None
    alpha: float | None = None
    up_bias: Tensor | None = None

    algo = "LoRA"
    keys = frozenset({"lora_down.weight", "lora_up.weight", "lora_mid.weight", "lora_up.bias", "alpha"})
    markers = frozenset({"lora_down.weight", "lora_up.weight", "lora_mid.weight"})
    accepts_dora = True

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> LoRA:
        _require(layer, cls.algo, tensors, ("lora_down.weight", "lora_up.weight"))
        return cls(
            tensors["lora_down.weight"],
            tensors["lora_up.weight"],
            tensors.get("lora_mid.weight"),
            _read_scalar(layer, "alpha", tensors),
            tensors.get("lora_up.bias"),
            layer=layer,
        )

    def __post_init__(self) -> None:
        rows, _ = self._dims()
        if self.up_bias is not None and tuple(self.up_bias.shape) != (rows,):
            raise AdapterFormatError(
                f"{self._where}: lora_up.bias must be ({rows},) like lora_up's rows, got {tuple(self.up_bias.shape)}"
            )

    def _dims(self) -> tuple[int, Shape]:
        mid = None if self.mid is None else ("lora_mid", tuple(self.mid.shape))
        return _low_rank_dims(
            self._where, ("lora_up", tuple(self.up.shape)), ("lora_down", tuple(self.down.shape)), mid
        )

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def accumulate(self, acc: Tensor, base_weight: Tensor, base_bias: Tensor | None, strength: float) -> Tensor | None:
        """One fused multiply-add, acc += (m·s)·up·down, instead of building ΔW, scaling it and
        adding it: a third of the memory passes a re-weight of a large layer costs. A bias on lora_B
        takes the general path, which checks it against the layer's bias."""
        if self.mid is not None or self.up_bias is not None or not acc.is_contiguous():
            return super().accumulate(acc, base_weight, base_bias, strength)
        self.validate_against(base_weight.shape)
        dev = acc.device
        with torch.no_grad():
            up, down = _f32(self.up, dev).flatten(1), _f32(self.down, dev).flatten(1)
        acc.view(acc.shape[0], -1).addmm_(up, down, alpha=strength * _low_rank_scale(self.alpha, self.rank))
        return None

    def bypass_forward(self, strength: float, dtype: torch.dtype, device: torch.device) -> BypassForward:
        """up(mid(down(x))) on x itself where the layer has a low-rank path (linear, conv): no
        weight-sized tensor per forward. The factors are cast to the compute dtype with the scale and
        strength folded into `up` once, here, not on every call (three casts per LoRA per layer per
        forward were a third of the bypass's ops); PEFT's `lora_bias` adds onto the output like the
        layer's own bias."""
        scale = strength * _low_rank_scale(self.alpha, self.rank)
        down, up = self.down.to(device, dtype), (self.up.to(device, torch.float32) * scale).to(dtype)
        mid = None if self.mid is None else self.mid.to(device, dtype)
        bias = None if self.up_bias is None else (self.up_bias.to(device, torch.float32) * scale).to(dtype)
        general = super().bypass_forward(strength, dtype, device)

        def forward(module: torch.nn.Module, x: Tensor, op: LayerOp, output: Tensor) -> Tensor | None:
            out = None if op.low_rank is None else op.low_rank(module, x, down, mid, up)
            if out is None:
                return general(module, x, op, output)
            return out if bias is None else op(module, x, None, bias, out) + out

        return forward

    @property
    def joins_bypass(self) -> bool:
        return self.mid is None

    @classmethod
    def joined(cls, parts: Sequence[tuple[float, LoRA]], dtype: torch.dtype, device: torch.device,
               layer: str) -> LoRA:
        """One LoRA whose ΔW is Σ mᵢ·sᵢ·upᵢ·downᵢ over `parts` ((strength, plain LoRA) on one layer):
        the downs stacked along the rank (the ranks summed), the ups side by side along it with each
        one's mᵢ·sᵢ folded into its columns, PEFT biases summed. Its bypass forward at strength 1 runs
        every part as one pair of matmuls/convs instead of two per part. Every factor is rounded as its
        own forward rounds it (down cast to `dtype`, up scaled in float32 and cast once), so the joined
        output differs from the sum of the separate ones only by where the additions round. A plain
        down always has its layer's kernel (`validate_against`), so conv parts stack as well."""
        down = torch.cat([lora.down.to(device, dtype).flatten(1) for _, lora in parts])
        scaled = [(lora, strength * _low_rank_scale(lora.alpha, lora.rank)) for strength, lora in parts]
        up = torch.cat([lora.up.to(device, torch.float32).flatten(1) * scale for lora, scale in scaled], dim=1)
        biases = [lora.up_bias.to(device, torch.float32) * scale for lora, scale in scaled if lora.up_bias is not None]
        return cls(down, up, up_bias=sum(biases[1:], biases[0]) if biases else None, layer=layer)

    def _bias_delta(self, device: torch.device) -> Tensor | None:
        if self.up_bias is None:
            return None
        return _f32(self.up_bias, device) * _low_rank_scale(self.alpha, self.rank)

    def _row_axes(self) -> dict[str, int]:
        return {"up": 0, "up_bias": 0}

    def _weight_delta(self, w0: Tensor) -> Tensor:
        dev = w0.device
        mid = None if self.mid is None else _f32(self.mid, dev)
        return _low_rank(_f32(self.up, dev), _f32(self.down, dev), mid) * _low_rank_scale(
            self.alpha, self.rank
        )


