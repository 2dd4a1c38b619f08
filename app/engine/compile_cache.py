"""Compiled artifacts kept across restarts, through torch's own caches.

`configure_cache` points the inductor cache (`TORCHINDUCTOR_CACHE_DIR`, which holds the FX-graph,
AOTAutograd and Triton caches) at a folder of ours, and `torch.compiler`'s portable "mega-cache"
is saved there after each compile and loaded back on the next `compiled.enable`, where the torch
version provides it: a warm restart skips the minute-long first compile.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
MEGA_CACHE_FILE = "mega-cache.bin"


def configure_cache(cache_dir: Path, *, override: bool = False) -> Path:
    """Point torch's compile caches at `cache_dir` so a restart reuses compiled kernels.

    Must run before the first compile in the process: inductor fixes its cache folder then. An
    explicit `TORCHINDUCTOR_CACHE_DIR` from the environment wins unless `override` (the benchmark
    overrides to measure a cold first compile). Returns the mega-cache file path.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    inductor_dir = str(cache_dir / "inductor")
    if override:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    else:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_dir)
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return cache_dir / MEGA_CACHE_FILE


def load_mega_cache(path: Path) -> bool:
    """Hot-load a saved mega-cache; an unreadable one (another torch version) is reported and skipped,
    because it only saves time: the compile then simply runs from scratch."""
    if not path.is_file() or not hasattr(torch.compiler, "load_cache_artifacts"):
        return False
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - a stale cache must not block compiling
        log.warning("compile cache %s unreadable (%s); compiling from scratch", path, str(exc))
        return False
    if info is None:  # torch logs why (corrupt, other version) and loads nothing
        log.warning("compile cache %s not loaded; compiling from scratch", path)
        return False
    return True


def save_mega_cache(path: Path) -> bool:
    """Write every compile artifact of this process to `path` (atomically); False where unsupported."""
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        return False
    artifacts = torch.compiler.save_cache_artifacts()
    if not artifacts:
        return False
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(artifacts[0])
    tmp.replace(path)
    return True
