"""How this process uses Python's cyclic garbage collector: what exists when the engine starts is
frozen out of it.

Why: `release_memory` runs a full collection after every model swap, dtype or weight-storage
reload and unload, so a dropped pipeline's reference cycles free their tensors at once. A full
pass walks every tracked object, and importing the app (torch, diffusers, transformers, Gradio)
leaves ~580,000 of them: 0.32 s per pass on two cores, on every such change and at each of the
interpreter's own periodic full passes. Those objects live as long as the process, so the first
`Engine` collects once and freezes the survivors (`gc.freeze`); later passes walk only what was
made after, the pipelines among it.

Once per process: a later freeze would also pin whatever cyclic garbage existed at that moment.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()


def freeze_startup_objects() -> None:
    """Collect once, then move every surviving object to the permanent generation; a no-op once
    anything is frozen (the permanent generation is the record that this already ran)."""
    with _lock:
        if gc.get_freeze_count():
            return
        gc.collect()
        gc.freeze()
