"""Steady Diffusion: a diffusion app whose engine never mixes devices or dtypes.

Importing any part of the app first sets the process-wide policies that must precede other imports
and threads:

* `HF_HUB_OFFLINE=1`: `huggingface_hub` reads the flag once, at its import, and nothing here may
  ever download weights or configs from a hub.
* The C heap reuses freed memory (`app/heap.py`): the engine's worker thread would otherwise fault
  the CPU kernels' per-step buffers in afresh on every step.
"""

import os

from app import heap

os.environ["HF_HUB_OFFLINE"] = "1"
heap.reuse_freed_memory()
