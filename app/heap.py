"""How this process's C heap (glibc malloc) is used, and when its memory goes back to the OS.

Why this exists: the engine runs every model on its worker thread, and the CPU convolution kernels
allocate a buffer the size of a large weight (59 MB and 118 MB in SD1.5's UNet) on every call.
glibc's defaults serve those from fresh pages each time: a new thread gets an arena of its own
(built from 64 MB mappings), and a block over 32 MB is mapped on allocation and unmapped on free.
Every step then faults its buffers in again: measured on SD1.5 at 128² on two cores, up to 1.4 M
minor page faults per 3-step generation and 1.25× (no LoRA) to 1.8× (three fused LoRAs, whose
backups fragment the heap) the CPU time of diffusers' pipeline on the main thread.

The policy: one arena, no mapped blocks, no automatic trimming, so a freed buffer is reused by the
next step's same-size request. Memory goes back to the OS after each change to the model
(`give_back` at the end of `ModelLifecycle.realise`: a load, swap, unload, offload switch or LoRA
change), not on every free. Without glibc nothing changes.
"""

from __future__ import annotations

import ctypes

# mallopt parameter numbers, from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_INT_MAX = 2**31 - 1  # mallopt takes an int: frees of 2 GiB at the top of the heap still trim


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def reuse_freed_memory() -> None:
    """Apply the policy. Threads keep the arena they first allocated from, so this must run before
    any thread starts (`app/__init__` calls it at the first import)."""
    libc = _libc()
    if libc is not None:
        for parameter, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX)):
            libc.mallopt(parameter, value)


def give_back() -> None:
    """Return the heap's free pages to the OS (`malloc_trim`), wherever they lie in the heap."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
