"""The read of a loaded checkpoint's weight files that a load does not wait for: A1111's `Model hash`
(the sha256 of the whole file) and the check of every weight value, on a thread of its own.

Why not during the load: diffusers returns as soon as the pipeline is built on the memory-mapped
weights (0.5 s for SD1.5, 2.4 s for SDXL on two CPU cores). Hashing the file and checking every
weight before returning made our first load five times slower than that and, by touching every
mapped page, raised its peak resident memory to the file's size (7.3 GiB against 1.1 for SDXL). So:

* the hash cannot come from the file's metadata: no file can record the sha256 of bytes that hold
  the record (kohya's `sshs_model_hash` and ModelSpec's `modelspec.hash_sha256` hash the tensor
  bytes only, another number than A1111's `Model hash`). It comes from the facts store when this
  file was read before, else from one sequential read (`scan_file`) started once the model is placed;
* that read touches files only, never the model (the worker owns the model); each file is read at
  most once per content: a read in flight is shared, a finished one recorded through the one
  `FileFacts` this object keeps per store, so two writers never drop each other's facts;
* what needs the hash waits for that same read (the first image saved, for its infotext), never
  starting a second one;
* weights found holding NaN/Inf, or values beyond the load dtype's range, refuse the model from then
  on: every generation asked of it, and every later load before anything is built. A generation
  that runs before the verdict stops at the first non-finite latents (`NonFiniteLatentsError`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path

import torch

from app.safetensors_files import FileFacts, SafetensorsFileError, ValueScan

log = logging.getLogger(__name__)
_SHOWN = 3


def not_finite_refusal(name: str, scans: Mapping[Path, ValueScan | None], dtype: torch.dtype) -> str | None:
    """Why a model whose files read as `scans` must be refused in `dtype`, or None: every image would
    come out black or noise, with nothing in the log to say why. Inf also appears when a checkpoint's
    values exceed fp16's range (±65504) and it is loaded in fp16, hence the hint."""
    several = len(scans) > 1
    bad = [f"{path.parent.name}/{path.name}:{key}" if several else key
           for path, scan in scans.items() if scan is not None for key in scan.not_finite_in(dtype)]
    if not bad:
        return None
    hint = " (values beyond ±65504 overflow fp16: try bf16 or fp32)" if dtype == torch.float16 else ""
    return (f"{name}: {len(bad)} weight tensors hold NaN or Inf values when loaded in "
            f"{str(dtype).removeprefix('torch.')}, e.g. {', '.join(bad[:_SHOWN])}{hint}; refusing it, "
            "since every image would come out black")


class ModelScan:
    """The reads of one loaded model's weight files, waiting, running or done; `hash_file` names the
    model; `begin` starts the waiting ones (so that waiting for a result can never wait forever)."""

    def __init__(self, name: str, hash_file: Path, reads: dict[Path, Future], begin: Callable[[], None]) -> None:
        self._name = name
        self._hash_file = hash_file
        self._reads = reads
        self._begin = begin

    def short_hash(self, wait: bool = False) -> str | None:
        """sha256[:10] of the hash file (A1111's short form); None while it is being read (unless
        `wait`) or when it could not be read."""
        read = self._reads[self._hash_file]
        if not (wait or read.done()):
            return None
        self._begin()
        scan = _outcome(read)
        return None if scan is None else scan.sha256[:10]

    def refusal(self, dtype: torch.dtype, wait: bool = False) -> str | None:
        """Why the model must be refused in `dtype`, once every file is read; None before then (unless
        `wait`) or when its weights are finite."""
        if not (wait or all(read.done() for read in self._reads.values())):
            return None
        self._begin()
        return not_finite_refusal(self._name, {path: _outcome(read) for path, read in self._reads.items()}, dtype)


def _outcome(read: Future) -> ValueScan | None:
    try:
        return read.result()
    except CancelledError:  # the engine closed before the read started
        return None


def _lowest_priority() -> None:
    """Run this thread at the lowest CPU priority (Linux: nice 19 applies per thread), so a read in
    the background never slows what runs in the foreground: the worker's next step, the UI."""
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priority on this OS
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _done(scan: ValueScan) -> Future:
    future: Future = Future()
    future.set_result(scan)
    return future


class FileScans:
    """The engine's reads of weight files: one thread, one `FileFacts` per store, a read per file
    content at most (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stores: dict[Path, FileFacts] = {}
        self._reads: dict[Path, Future] = {}
        self._waiting: list[tuple[Future, FileFacts, Path]] = []
        self._stop = threading.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="file-scan", initializer=_lowest_priority)

    def facts(self, store: Path) -> FileFacts:
        """The one `FileFacts` of `store` in this engine."""
        with self._lock:
            if store not in self._stores:
                self._stores[store] = FileFacts(store)
            return self._stores[store]

    def known_refusal(self, name: str, store: Path, files: Sequence[Path], dtype: torch.dtype) -> str | None:
        """The refusal earlier reads of these files recorded (nothing is read now), or None."""
        facts = self.facts(store)
        return not_finite_refusal(name, {path: facts.recorded_scan(path) for path in files}, dtype)

    def start(self, name: str, store: Path, files: Sequence[Path]) -> ModelScan:
        """Plan reading the files (the first names the model), each only where neither the facts nor
        a read in flight already has it. The reads wait for `begin`: the worker calls it once the step
        that loaded the model has answered its caller, so the load's time and CPU hold none of them."""
        facts = self.facts(store)
        reads = {}
        with self._lock:
            for path in files:
                key = path.resolve()
                known = facts.recorded_scan(path)
                if known is not None:
                    reads[path] = _done(known)
                    continue
                if key not in self._reads or self._reads[key].done():
                    self._reads[key] = Future()
                    self._waiting.append((self._reads[key], facts, path))
                reads[path] = self._reads[key]
        return ModelScan(name, files[0], reads, self.begin)

    def begin(self) -> None:
        """Start the reads planned so far, one after the other on the scan thread."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
            for read, facts, path in waiting:
                if self._stop.is_set():
                    read.cancel()
                else:
                    self._thread.submit(self._read, read, facts, path)

    def _read(self, read: Future, facts: FileFacts, path: Path) -> None:
        if not read.set_running_or_notify_cancel():
            return
        try:
            read.set_result(facts.scan(path, self._stop))
        except (OSError, SafetensorsFileError) as exc:  # gone or rewritten since the load: no hash to give
            log.warning("could not read %s for its hash and weight check: %s", path, exc)
            read.set_result(None)

    def close(self) -> None:
        """Stop a read in progress (it records nothing), cancel those not started, end the thread."""
        self._stop.set()
        self.begin()
        self._thread.shutdown(wait=True, cancel_futures=True)
        for read in self._reads.values():
            read.cancel()  # those the thread never took up: whoever waits for one is told
