"""Giving freed memory back: after a model swap, an unload, an out-of-memory error.

Why a module of its own: the diffusion model's lifecycle and the upscaler slot both release memory
after they drop a model, and the upscaler slot is part of the engine snapshot that the lifecycle
reads; kept in the lifecycle, the import went snapshot -> upscaler slot -> lifecycle -> snapshot.
"""

from __future__ import annotations

import gc

import torch

from app import heap


def release_memory() -> None:
    """Return freed RAM/VRAM to the OS/driver so "unload" really shows up in the numbers."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # Pinned host blocks (LoRA backups) stay cached by PyTorch's host allocator after they are
        # freed; its only release is this private binding (CUDA builds only). Suspected cause of the
        # H100 run's RSS growth over LoRA add/remove cycles (2026-11-26); re-check owed on a GPU.
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()
    heap.give_back()
