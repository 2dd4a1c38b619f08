"""The read-only lists of the A1111 API: samplers, schedulers, LoRAs, embeddings, memory.

Each answer has A1111's fields (see `app.a1111.schema`). Everything is read from the folders
and the engine's snapshot when asked, so the `refresh-*` endpoints have nothing to refresh.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import psutil
import torch

from app.a1111.txt2img import KARRAS, SAMPLER_ALIASES, SCHEDULES
from app.engine.generate import SCHEDULERS
from app.paths import utf8_names
from app.report import redact
from app.safetensors_files import SafetensorsFileError, read_header, read_shapes
from app.settings import Settings
from app.shown_paths import without_folders
from app.ui.common import UiContext
from app.upscalers import faces

log = logging.getLogger(__name__)


def samplers() -> list[dict]:
    """A1111 marks an ancestral sampler with `uses_ensd` and a sampler with a built-in schedule with it."""
    out = []
    for name in SCHEDULERS:
        options = {"scheduler": "karras"} if name.endswith(KARRAS) else {}
        if name.endswith(" a"):
            options["uses_ensd"] = "True"
        out.append({"name": name, "aliases": SAMPLER_ALIASES.get(name, []), "options": options})
    return out


def cmd_flags(settings: Settings) -> dict:
    """`GET /sdapi/v1/cmd-flags`: the options this app was started with (A1111 answers its argparse namespace), with
    passwords removed and paths relative to the data folder, as the bug report shows them."""
    secrets = [password for _user, password in (*settings.auth, *settings.api_auth)]
    return redact(settings.public_dict(), secrets, data_dir=str(settings.data_dir))


def face_restorers(settings: Settings) -> list[dict]:
    """`GET /sdapi/v1/face-restorers`: each face-restoration model file in A1111's folders (`models/GFPGAN`,
    `models/Codeformer`), named by its file's stem, with its folder as `cmd_dir` (relative to the data folder)."""
    return without_folders([{"name": path.stem, "cmd_dir": str(path.parent)}
                            for path in faces.model_files(settings.data_dir / "models")], settings.data_dir)


def schedulers() -> list[dict]:
    """The schedule types `sampler_for` honours; Karras with its usual rho."""
    return [{"name": name, "label": name.capitalize(), "aliases": None,
             "default_rho": 7.0 if name == "karras" else None, "need_inner_model": None} for name in SCHEDULES]


def _metadata(path: Path) -> dict[str, Any]:
    """A LoRA's safetensors metadata, JSON-looking values parsed as A1111 does; {} for an unreadable file."""
    try:
        raw = read_header(path)[1]
    except SafetensorsFileError as exc:
        log.info("LoRA %s listed without metadata: %s", path.name, exc)
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            out[key] = json.loads(value) if value[:1] in "{[" else value
        except ValueError:
            out[key] = value
    return out


def loras(ctx: UiContext) -> list[dict]:
    """`GET /sdapi/v1/loras`: name, alias (the trainer's `ss_output_name`), file path (relative to the data
    folder: clients only show it, and a stranger on a share link must not learn the disk's layout) and
    metadata."""
    out = []
    for name in ctx.engine.library.names():
        path = ctx.engine.library.path_for(name)
        metadata = _metadata(path)
        alias = metadata.get("ss_output_name")
        out.append({"name": name, "alias": alias if isinstance(alias, str) and alias else name, "path": str(path),
                    "metadata": metadata})
    return without_folders(out, ctx.settings.data_dir)


def _embedding_item(path: Path) -> dict | None:
    """A1111's fields for one embedding file: `shape` is the vector width (SDXL: both encoders'
    widths added), `vectors` how many tokens it stands for. None for an unreadable file."""
    try:
        shapes = [shape for shape in read_shapes(path).values() if len(shape) >= 1]
    except SafetensorsFileError as exc:
        log.info("embedding %s not listed: %s", path.name, exc)
        return None
    if not shapes:
        return None
    vectors = shapes[0][0] if len(shapes[0]) > 1 else 1
    return {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": None,
            "shape": sum(shape[-1] for shape in shapes), "vectors": vectors}


def embeddings(ctx: UiContext) -> dict:
    """`loaded`: the files the engine added to the loaded model; `skipped`: the others in the folder."""
    folder = ctx.settings.embeddings_dir
    loaded = set(ctx.engine.snapshot().embeddings)
    out: dict[str, dict] = {"loaded": {}, "skipped": {}}
    files = sorted(utf8_names(folder, folder.glob("*.safetensors"), "embedding")) if folder.is_dir() else []
    for path in files:
        item = _embedding_item(path)
        if item is not None:
            out["loaded" if path.stem in loaded else "skipped"][path.stem] = item
    return out


def memory(device: str) -> dict:
    """`GET /sdapi/v1/memory`: RAM in bytes, and for a CUDA engine A1111's CUDA counters."""
    rss = psutil.Process(os.getpid()).memory_info().rss
    total = psutil.virtual_memory().total
    ram = {"free": total - rss, "used": rss, "total": total}
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return {"ram": ram, "cuda": {"error": "unavailable"}}
    free, whole = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)

    def pair(key: str) -> dict:
        return {"current": stats.get(f"{key}.all.current", 0), "peak": stats.get(f"{key}.all.peak", 0)}

    cuda = {"system": {"free": free, "used": whole - free, "total": whole}, "active": pair("active_bytes"),
            "allocated": pair("allocated_bytes"), "reserved": pair("reserved_bytes"),
            "inactive": pair("inactive_split_bytes"),
            "events": {"retries": stats.get("num_alloc_retries", 0), "oom": stats.get("num_ooms", 0)}}
    return {"ram": ram, "cuda": cuda}
