"""Steady Diffusion: a diffusion app whose engine never mixes devices or dtypes.

Importing any part of the app first sets the process-wide policies that must precede other imports
and threads:

* `HF_HUB_OFFLINE=1`: `huggingface_hub` reads the flag once, at its import, and nothing here may
  ever download weights or configs from a hub.
* One malloc arena (glibc): the engine runs every model on its worker thread, and glibc gives each
  new thread an arena of its own, built from 64 MB mappings. The CPU kernels' large per-call
  buffers then come from fresh pages every step: a 3-step SD1.5 generation at 128² took 500k minor
  page faults and 25% more CPU time on the worker thread than the same pipeline on the main
  thread (whose arena reuses freed memory). With one arena the worker allocates as the main
  thread does: 0 faults, CPU time level with diffusers. Threads started before this import keep
  their arenas, hence here, before any thread starts.
"""

import ctypes
import os

os.environ["HF_HUB_OFFLINE"] = "1"


def _one_malloc_arena() -> None:
    m_arena_max = -8  # mallopt parameter number, from glibc's malloc.h
    try:
        ctypes.CDLL("libc.so.6").mallopt(m_arena_max, 1)
    except (OSError, AttributeError):  # not glibc: its allocator has no per-thread arenas to limit
        pass


_one_malloc_arena()
