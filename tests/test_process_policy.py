"""Process-wide policies `import app` sets before any thread starts (see app/__init__.py, app/heap.py)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 100 * 2**20  # above glibc's 32 MB mmap ceiling, like SD1.5's largest conv buffers (59, 118 MB)

# A thread (as the engine's worker) allocates, touches and frees a large block five times; the
# page faults of the last four are printed, then the number of arenas malloc_info lists.
_PROBE = f"""
import ctypes, resource, sys, tempfile, threading
if sys.argv[1] == "app":
    import app
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
faults = []
def work():
    for i in range(5):
        if i == 1:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        block = libc.malloc({BLOCK})
        ctypes.memset(block, 1, {BLOCK})
        libc.free(ctypes.c_void_p(block))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
worker = threading.Thread(target=work)
worker.start()
worker.join()
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile("r", suffix=".xml") as out:
    stream = ctypes.c_void_p(libc.fopen(out.name.encode(), b"w"))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(faults[1] - faults[0], out.read().count("<heap nr="))
"""


def _probe(imports: str) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", _PROBE, imports], capture_output=True, text=True, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, check=True, timeout=60)
    faults, arenas = map(int, done.stdout.split())
    return faults, arenas


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's malloc tuning")
def test_a_worker_thread_reuses_a_freed_large_block_from_the_main_arena():
    """After `import app` a new thread allocates from glibc's main arena and a freed 100 MB block is
    reused by the next request, with no new page faults: the engine's worker runs each denoising
    step's large buffers in memory the previous step already faulted in (it took up to 1.4 M faults
    per SD1.5 generation before). Without the import the same thread maps and faults the block
    afresh every time, from an arena of its own: the control that shows the probe tells them apart."""
    pages = 3 * BLOCK // 4096  # a quarter of the four touches' pages would already be a failure
    control_faults, control_arenas = _probe("plain")
    assert control_faults >= pages and control_arenas == 2
    faults, arenas = _probe("app")
    assert faults < 100 and arenas == 1, (faults, arenas)


_GC_PROBE = """
import gc, weakref
from app.engine.worker import Engine
from app.settings import Settings

class Node:
    pass

cycle = Node()
cycle.self = cycle
dead = weakref.ref(cycle)
del cycle  # cyclic garbage made before the first engine: collected, not pinned by the freeze
first = Engine(Settings(device="cpu"))
frozen = gc.get_freeze_count()
second = Engine(Settings(device="cpu"))
print(dead() is None, frozen, gc.get_freeze_count(), len(gc.get_objects()))
first.close()
second.close()
"""


def test_the_first_engine_freezes_what_the_imports_made_out_of_the_collector():
    """A full gc pass (every model swap, reload and unload runs one) walks only objects made after
    the first `Engine` started: the ~580,000 that importing torch, diffusers and transformers
    leaves behind cost 0.32 s per pass on two cores. Garbage from before is collected first, and a
    second engine freezes nothing more (a later freeze would pin whatever garbage existed then)."""
    done = subprocess.run([sys.executable, "-c", _GC_PROBE], capture_output=True, text=True, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
                          check=True, timeout=120)
    collected, frozen, frozen_later, walked = done.stdout.split()
    assert collected == "True"
    assert int(frozen) > 300_000 and frozen_later == frozen
    assert int(walked) < int(frozen) // 20, (walked, frozen)
