"""fp8 matmuls for stored Linear layers: the `fp8-compute` weights mode.

Why: fp8 storage halves a model's memory but widens each stored weight to the compute dtype in
every forward (one weight-sized cast per Linear per call), so it runs below bf16 speed (0.87-0.90×
on an H100). GPUs with fp8 tensor cores (sm89+) multiply fp8 operands at about twice the bf16 rate:
here a qualifying Linear keeps its weight in fp8 for its forward and runs `torch._scaled_mm` on it
and on its input quantised on the fly, writing the compute dtype (ComfyUI's "fp8 fast" does the same
with unscaled inputs).

The numbers: e4m3 holds ±448 with 3 mantissa bits. Each weight row gets a float32 scale when the
model is stored (its largest magnitude / 448), so a row of small weights uses e4m3's whole range
instead of its subnormals (a plain cast of rows around 0.005 loses about 4× more); each input row
(a token) gets its own scale per forward the same way. The matmul accumulates (xq·sx)(wq·sw) in
float32 and rounds once to bf16 with the bias added. The stored bytes (wq) and scales (sw, a buffer
beside the weight, so placement moves, verifies and streams it) never change while the model is
loaded.

What qualifies (`unfit` says why not): Linear layers of components computing in bf16 (the row-wise
fp8 kernels write bf16) whose in and out features are multiples of 16 (the fp8 GEMM's alignment on
CUDA; the same rule on the CPU, so CPU tests cover the layers a GPU runs). The others keep the
storage path: a plain fp8 cast widened per forward. Devices (`refusal`): CUDA with compute
capability 8.9+ and the CPU (torch's CPU `_scaled_mm`: slow, but it runs the same quantisation, so
CI tests the mode); anything else is refused when the model loads.

LoRAs over such a layer are bypass forwards in the compute dtype (app/adapters/bypass.py): the base
output comes from the fp8 matmul and each adapter adds its share. An adapter whose ΔW reads W (DoRA,
GLoRA, IA3, OFT: `reads_base`) reads the layer's weight in its bypass; while such a LoRA is on a
layer (`WeightReaders`), its forward leaves the dequantised weight (wq·sw in the compute dtype) in
place for the bypass, and the `quant.dequant` hook's `after` points back to the stored bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils._triton import has_triton

from app.engine.codecs import SCALE  # the per-row float32 scales, a buffer of each fp8-matmul layer
from app.hooks import ModelHook

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16  # in and out features must be multiples of this (CUDA's fp8 GEMM alignment)
OUT_DTYPE = torch.bfloat16  # the dtype the row-wise fp8 kernels write
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row: its quantised values stay 0


def refusal(device: torch.device) -> str | None:
    """Why `device` cannot run fp8 matmuls, or None: the CPU and CUDA sm89+ can."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= (8, 9):
            return None
        return (f"weights fp8-compute needs fp8 tensor cores (CUDA compute capability 8.9+: Ada, Hopper, "
                f"Blackwell); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}. "
                "Use weights fp8 (storage only) instead")
    return f"weights fp8-compute runs on CUDA (sm89+) or the CPU, not on {device.type}; use weights fp8 instead"


def unfit(module: torch.nn.Module, compute_dtype: torch.dtype) -> str | None:
    """Why a stored layer keeps the storage path (widened per forward) instead of an fp8 matmul, or None."""
    if not isinstance(module, torch.nn.Linear):
        return f"a {type(module).__name__}: only Linear layers run as fp8 matmuls"
    if compute_dtype != OUT_DTYPE:
        return f"its component computes in {str(compute_dtype).removeprefix('torch.')}: the fp8 kernels write bf16"
    if module.in_features % ALIGN or module.out_features % ALIGN:
        return f"{module.in_features}→{module.out_features} features: fp8 matmuls need multiples of {ALIGN}"
    return None


def quantise_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` (n, k) as e4m3 with one float32 scale per row (n, 1): rows ≈ q·scale, the largest
    magnitude of each row at ±448."""
    amax = torch.linalg.vector_norm(rows, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp(min=_TINY) / E4M3_MAX
    return torch.div(rows, scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


@functools.cache
def _fused_quantise() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`quantise_rows` compiled into one kernel per shape class (dynamic shapes: one for every token
    count), built on first use. Why: eager, it makes four activation-sized passes (amax, divide into
    float32, clamp, cast: ~19 bytes per element), which for a Flux MLP's down projection at 1024² on
    an H100 cost about what the fp8 matmul saves; fused, it reads the bf16 input and writes e4m3. The
    same values bit for bit (checked on the CPU, where the tests run the eager function: compiling
    costs minutes there)."""
    return torch.compile(quantise_rows, dynamic=True)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """x @ (weight·scale)ᵀ + bias as one fp8 matmul: `weight` (out, in) e4m3, `scale` (out, 1) float32.
    On CUDA with Triton the input is quantised by the fused kernel, elsewhere by the eager function."""
    quantise = _fused_quantise() if x.is_cuda and has_triton() else quantise_rows
    rows, row_scale = quantise(x.reshape(-1, x.shape[-1]))
    out = torch._scaled_mm(rows, weight.t(), scale_a=row_scale, scale_b=scale.t(), bias=bias, out_dtype=out_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def dequantised(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The value an fp8-matmul layer's weight stands for, in `dtype`."""
    return (weight.to(torch.float32) * scale).to(dtype)


class Fp8Matmul:
    """One qualifying Linear's forward as an fp8 matmul (installed as the module's `forward`) and the
    `after` of its `quant.dequant` hook. The module's own weight and scale are read at call time, so
    whatever the offload hooks streamed in is what runs."""

    def __init__(self, module: torch.nn.Linear, compute_dtype: torch.dtype,
                 reads_weight: Callable[[torch.nn.Module], bool]) -> None:
        self.module = module
        self.compute_dtype = compute_dtype
        self.reads_weight = reads_weight
        self.stash: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        weight, scale = module._parameters["weight"], module._buffers[SCALE]
        out = linear(x, weight, scale, module.bias, self.compute_dtype)
        if self.reads_weight(module):  # a LoRA whose ΔW reads W is added after this: it reads the true weight
            self.stash.append(weight.data)
            weight.data = dequantised(weight.data, scale, self.compute_dtype)
        return out

    def after(self, module: torch.nn.Module) -> None:
        if self.stash:
            module._parameters["weight"].data = self.stash.pop()

    def hook(self) -> ModelHook:
        return ModelHook("quant.dequant", after=self.after)


class WeightReaders:
    """Which layers carry a bypassed LoRA whose ΔW reads the layer's weight (`Adapter.reads_base`),
    from the LoRA stack's public view (`applied`, `bypass_components`, `bypassed()`); worked out
    again only when the stack's LoRAs or bypass policy change, so a forward pays a tuple comparison."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self.stack = None  # the model's LoraStack, once it exists (it is built after the hooks)
        self._key: tuple | None = None
        self._ids: frozenset[int] = frozenset()

    def __call__(self, module: torch.nn.Module) -> bool:
        stack = self.stack
        if stack is None:
            return False
        key = (stack.applied, stack.bypass_components)
        if key != self._key:
            self._ids = frozenset(id(getattr(self.pipe, component).get_submodule(path))
                                  for (component, path), contributions in stack.bypassed().items()
                                  if any(adapter.reads_base for _name, _strength, adapter in contributions))
            self._key = key
        return id(module) in self._ids
