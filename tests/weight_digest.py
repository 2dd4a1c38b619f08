"""Whole-pipeline weight hash shared by the tests that promise "nothing changed" after a refusal or a rollback."""

from __future__ import annotations

import hashlib

import torch

from app.engine import placement


def weights_digest(pipe) -> str:
    """Hash of every parameter and buffer (names, dtypes, shapes and raw bytes) of a pipeline."""
    h = hashlib.sha256()
    for comp, path, _m, name, t, _p in placement.iter_tensors(pipe):
        h.update(f"{comp}.{path}.{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
