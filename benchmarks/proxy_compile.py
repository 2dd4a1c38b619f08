"""The compile proxy (`--sections compile`): the first compile of a full-size DiT denoiser, whole
against regional (`app/engine/compile_regions.py`: each repeated block class once), on the CPU.

Why on the meta device with dynamo's `aot_eager` backend: inductor lowers to Triton on a GPU (on the
CPU it generates C++ instead, another compiler's time), and the largest DiT's transformer does not
fit in this machine's RAM. What grows with the traced graph is common to both: dynamo's trace and
AOTAutograd's joint trace, on fake tensors made from the meta ones; inductor then lowers the graph
it is handed. So the seconds and graph counts here compare whole against regional on that shared
part of a first compile (a proxy: the GPU row, `--sections compile`, measures inductor itself).
Each scope runs through the engine's own `CompileState`, compiling in line; a regional compile first
warms dynamo's imports and caches, uncounted, and each compile ends with `torch._dynamo.reset()`
(the state's `close`), so neither reuses the other's graphs.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from app.engine.compiled import CompileState
from app.engine.placement import DTYPES
from app.families import family
from benchmarks.config import PRESETS
from benchmarks.denoiser import call_inputs, meta_denoiser
from benchmarks.proxy_ops import latent_side

BACKEND = "aot_eager"
SCOPES = ("whole", "regional")


def first_compile(family_name: str, denoiser_config: dict, dtype: torch.dtype, side: int, scope: str) -> dict[str, Any]:
    """Seconds of the first (compiling) call of a fresh meta denoiser, and the graphs compiled."""
    denoiser = meta_denoiser(family_name, denoiser_config, dtype)
    regions = family(family_name).compile_regions(denoiser) if scope == "regional" else ()
    inputs = call_inputs(family_name, denoiser, 1, side)
    state = CompileState(denoiser, backend=BACKEND, background=False, regions=regions)
    try:
        started = time.perf_counter()
        with torch.no_grad():
            denoiser(**inputs)
        seconds = time.perf_counter() - started
        return {"first_compile_s": seconds, "graphs": state.compiles, "regions": list(regions),
                "blocks": sum(type(m).__name__ in regions for m in denoiser.modules())}
    finally:
        state.close()


def compile_section(family_name: str, config, denoiser_config: dict | None = None) -> dict[str, Any]:
    """Whole against regional first compile of `family_name`'s denoiser (the full-size config unless one is given)."""
    fam = family(family_name)
    if fam.compile_regions is None:
        return {"family": family_name, "skipped": f"{fam.label} compiles its denoiser whole (no repeated blocks named)"}
    denoiser_config = denoiser_config or fam.denoiser_class.load_config(fam.files.config_dir / fam.denoiser)
    dtype, side = DTYPES[config.storage_dtype], latent_side(family_name)
    first_compile(family_name, denoiser_config, dtype, side, "regional")  # warm-up: dynamo's first use, uncounted
    scopes = {scope: first_compile(family_name, denoiser_config, dtype, side, scope) for scope in SCOPES}
    return {"family": family_name, "backend": BACKEND, "dtype": config.storage_dtype,
            "resolution": PRESETS["full"].resolution[family_name], "latent_side": side, **scopes,
            "ratio": scopes["whole"]["first_compile_s"] / scopes["regional"]["first_compile_s"]}
