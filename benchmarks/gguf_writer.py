"""`.gguf` files written with the `gguf` package (the tests' tiny ones, the bench's full-size ones) and what
an exact reader must give back.

Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 tensors are the `gguf` package's own quantisation of the weight. The
package quantises no K type, so a K-type tensor here is synthetic: random scales and quants with the
super-block scale `d` (and `dmin`) set from the weight's standard deviation so its values are
centred and of the weight's size. Either way the reference is what matters: `dequantised` is
`gguf.quants.dequantize` of the very bytes written, the values an exact reader must compute.

A tensor is quantised when it has two or more dimensions and each row (all but the first dimension)
is a whole number of the type's blocks; `kinds` may list several types, tried in order per tensor
(the first that fits), then in turn across tensors, so one small file holds each of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from app.engine.component_files import CONFIGS_METADATA_KEY

# per type written synthetic: (offset of d, offset of dmin or None, the mean of sc·q, the mean of m) to
# centre values on 0 (a signed type's: 0); Q8_0 is written synthetic only where asked (the bench: full-size
# weights, where the package's numpy quantiser would take minutes)
_K_FIELDS = {"Q4_K": (0, 2, 31.5 * 7.5, 31.5), "Q5_K": (0, 2, 31.5 * 15.5, 31.5), "Q6_K": (208, None, 0.0, 0.0),
             "Q8_0": (0, None, 0.0, 0.0)}
ARCHITECTURE = "diffusion"  # the `general.architecture` field written: readers must not rely on it
_QUANTISED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # what `gguf.quants.quantize` writes


def _k_blocks(values: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    rows = values.reshape(values.shape[0], -1)
    raw = rng.integers(0, 256, (rows.shape[0], rows.shape[1] // block, size), dtype=np.uint8)
    d_at, dmin_at, mean_q, mean_m = _K_FIELDS[kind]
    d = np.float16(max(float(values.std()), 1e-4) / (2.0 * (mean_q or 40.0)))
    raw[..., d_at:d_at + 2] = np.frombuffer(d.tobytes(), np.uint8)
    if dmin_at is not None:
        dmin = np.float16(float(d) * mean_q / mean_m)
        raw[..., dmin_at:dmin_at + 2] = np.frombuffer(dmin.tobytes(), np.uint8)
    return raw.reshape(rows.shape[0], -1)


def quantise(values: np.ndarray, kind: str, rng: np.random.Generator, synthetic: bool = False) -> np.ndarray:
    """`values` (rows, …) as packed bytes (rows, bytes per row) of `kind`: `gguf`'s quantisation where it has
    one and `synthetic` is off, else random blocks of the values' size."""
    if kind not in _QUANTISED or (synthetic and kind in _K_FIELDS):
        return _k_blocks(values, kind, rng)
    return gguf.quants.quantize(values.reshape(values.shape[0], -1), T[kind])


def fits(shape: tuple[int, ...], kind: str) -> bool:
    inner = int(np.prod(shape[1:])) if len(shape) > 1 else 0
    return len(shape) >= 2 and inner > 0 and inner % gguf.GGML_QUANT_SIZES[T[kind]][0] == 0


def write_gguf(state: dict[str, torch.Tensor], path: Path, kinds: tuple[str, ...], configs: dict | None = None,
               seed: int = 0, synthetic: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Write `state` to `path` as GGUF (quantised as the module doc says; the rest F32) with `configs` under
    `steady_diffusion.configs`. Returns the float32 tensors an exact reader must give back (`gguf`'s own
    dequantisation of what was written; empty when `synthetic`, which skips that for full-size files)
    and each tensor's type."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), ARCHITECTURE)
    if configs is not None:
        writer.add_string(CONFIGS_METADATA_KEY, json.dumps(configs))
    back, types, turn = {}, {}, 0
    for name, tensor in state.items():
        values = tensor.detach().to(torch.float32).numpy()  # GGUF has no 0-d tensors: a scalar is written (1,)
        usable = [k for k in kinds if fits(values.shape, k)]
        if "weight" in name and values.ndim == 2 and usable:
            kind = usable[turn % len(usable)]
            turn += 1
            packed = quantise(values, kind, rng, synthetic)
            writer.add_tensor(name, packed, raw_dtype=T[kind])
            if not synthetic:
                back[name] = torch.from_numpy(gguf.quants.dequantize(packed, T[kind]).reshape(values.shape).copy())
        else:
            floating = tensor.is_floating_point()
            kind = "F32" if floating else "I" + str(tensor.dtype).removeprefix("torch.int")
            kept = values if floating else tensor.numpy()
            writer.add_tensor(name, np.ascontiguousarray(kept.reshape(kept.shape or (1,))))
            if not synthetic:
                back[name] = torch.from_numpy(values.copy()) if floating else tensor.detach().clone()
        types[name] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return back, types
