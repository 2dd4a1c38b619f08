"""Child-process probes: one model load in a fresh process, so its time and peak RSS are its own.

Peak RSS can only be attributed to one load in a process that did nothing else (the kernel's
`ru_maxrss` is a high-water mark), and a fresh process also starts with no warm Python caches, as a
user's restart does. The parent (`proxies.py`) runs the probes of both sides in ABBA order.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from app.engine import checkpoint_files, models
from app.engine.placement import DTYPES
from app.engine.worker import Engine
from app.families import family
from app.settings import Settings


def _memory() -> dict[str, float]:
    """Resident memory now (anonymous and file-backed, GiB) and the process's peak so far."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {key: int(status[key].split()[0]) for key in ("RssAnon", "RssFile") if key in status}
    return {"rss_anon_gib": kib.get("RssAnon", 0) / 2**20, "rss_file_gib": kib.get("RssFile", 0) / 2**20,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _start_ours(spec: dict[str, Any]):
    """The app's start, before any load: the engine (its first construction collects and freezes the
    objects the imports made, `gc_policy`), timed apart as the imports are."""
    engine = Engine(Settings(data_dir=Path(spec["data_dir"]), device="cpu", dtype=spec["dtype"]))
    return lambda spec: _load_ours(engine, spec)


def _load_ours(engine: Engine, spec: dict[str, Any]):
    engine.load_model(spec["name"])
    return engine


def _load_models_layer(spec: dict[str, Any]):
    """Our `models.load_pipeline` alone, without the engine around it (placement, verify, snapshot):
    splits our load time between the loader and the engine's transition."""
    info = checkpoint_files.resolve_checkpoint(spec["name"], Settings(data_dir=Path(spec["data_dir"])).checkpoints_dir)
    return models.load_pipeline(info, DTYPES[spec["dtype"]])


def _load_diffusers(spec: dict[str, Any]):
    """The offline way to call `from_single_file` (NOTES.md): `config=` a local folder, our tokenizers."""
    family_name = spec["family"]
    return family(family_name).plain_pipeline_class.from_single_file(
        spec["path"], config=str(family(family_name).files.config_dir), dtype=DTYPES[spec["dtype"]],
        local_files_only=True,
        **family(family_name).tokenizers(), **family(family_name).pipeline_kwargs)


def run_load_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """The child side: import everything and start the app first (not timed; the engine's start is
    reported as `start_s`), then time one load; report wall and process CPU seconds (all threads: a
    background read of the file started by the load counts while it runs before the figures are
    taken) and memory."""
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    wall0 = time.perf_counter()
    loader = _start_ours(spec) if spec["side"] == "ours" else {"ours-models": _load_models_layer,
                                                                 "diffusers": _load_diffusers}[spec["side"]]
    start_s, before = time.perf_counter() - wall0, _memory()
    cpu0, wall0 = _cpu_s(), time.perf_counter()
    loaded = loader(spec)
    result = {"load_s": time.perf_counter() - wall0, "cpu_s": _cpu_s() - cpu0, "start_s": start_s,
              "rss_before_gib": before["peak_rss_gib"], **_memory()}
    if spec["side"] == "ours":
        if spec.get("wait_for_scan"):
            loaded.snapshot(wait_for_hash=True)  # a warm-up records the file's facts for the later loads
        loaded.close()
    return result


def spawn_load_probe(spec: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    """Run one probe in a fresh interpreter (`python -m app.bench --load-probe SPEC`)."""
    command = [sys.executable, "-m", "app.bench", "--load-probe", json.dumps(spec)]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"load probe {spec['side']}/{spec['family']} failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
