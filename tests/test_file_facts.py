"""Hashes and finite-weight verdicts kept per file (`FileFacts`), so only a file's first load reads it
end to end, and a changed file is read again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from app import safetensors_files
from app.engine import checkpoint_files, models
from app.safetensors_files import FileFacts


def test_sha256_is_read_once_per_file_identity(tmp_path, monkeypatch):
    """The digest is kept in the store; a restart (a new FileFacts on the same store) reuses it; a new
    mtime or size drops it."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"abc" * 1000)
    reads = []
    monkeypatch.setattr(safetensors_files, "file_sha256", lambda p: reads.append(p) or hashlib.sha256(
        p.read_bytes()).hexdigest())
    store = tmp_path / "facts.json"
    assert FileFacts(store).sha256(path) == hashlib.sha256(b"abc" * 1000).hexdigest()
    assert FileFacts(store).sha256(path) and len(reads) == 1
    os.utime(path, ns=(1, 1))
    FileFacts(store).sha256(path)
    assert len(reads) == 2


def test_a_broken_or_unwritable_store_only_costs_a_recompute(tmp_path, caplog):
    """The store is a cache: garbage in it is ignored, and a folder that cannot be written is reported
    once while the facts still hold for this process."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"x")
    store = tmp_path / "facts.json"
    store.write_text("{not json")
    facts = FileFacts(store)
    assert facts.sha256(path) == hashlib.sha256(b"x").hexdigest()
    assert json.loads(store.read_text())["version"] == FileFacts.VERSION
    locked = FileFacts(tmp_path / "missing-folder" / "facts.json")
    locked.sha256(path)
    locked.sha256(path)
    assert sum("cannot write the file facts cache" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_second_load_skips_hash_and_checks_until_a_file_changes(demo_paths, tmp_path, monkeypatch, kind):
    """A second load of an unchanged checkpoint neither hashes it, nor checks its weights, nor builds
    its config to check the header's shapes again; a changed weight file (of any component, for a
    folder) makes the next load check again. (Folders have no LDM header to check.)"""
    source = demo_paths["sd15_file" if kind == "file" else "sd15_folder"]
    root = tmp_path / "ckpt"
    root.mkdir()
    target = root / source.name
    if kind == "file":
        os.link(source, target)
    else:
        shutil.copytree(source, target, copy_function=os.link)
    checks, hashes, shape_checks = [], [], []
    real_check, real_hash = models.check_finite_weights, safetensors_files.file_sha256
    real_shapes = models.check_header_shapes
    monkeypatch.setattr(models, "check_finite_weights", lambda *a: checks.append(1) or real_check(*a))
    monkeypatch.setattr(models, "check_header_shapes", lambda *a: shape_checks.append(1) or real_shapes(*a))
    monkeypatch.setattr(safetensors_files, "file_sha256", lambda p: hashes.append(1) or real_hash(p))
    first = models.load_pipeline(checkpoint_files.resolve_checkpoint(source.name, root), torch.float32)
    second = models.load_pipeline(checkpoint_files.resolve_checkpoint(source.name, root), torch.float32)
    assert first.short_hash == second.short_hash and len(hashes) == 1 and len(checks) == 1
    assert len(shape_checks) == (1 if kind == "file" else 0)
    assert (root / models.FACTS_FILE).is_file()
    changed = target if kind == "file" else target / "vae" / "diffusion_pytorch_model.safetensors"
    data = changed.read_bytes()
    changed.unlink()  # a new file, not the linked one rewritten: the demo files are shared
    changed.write_bytes(data)
    models.load_pipeline(checkpoint_files.resolve_checkpoint(source.name, root), torch.float32)
    assert len(checks) == 2 and len(hashes) == (2 if kind == "file" else 1)
    assert len(shape_checks) == (2 if kind == "file" else 0)
    assert checkpoint_files.discover_checkpoints(root)[0].name == source.name  # the dot file is not a checkpoint


def test_a_check_is_recorded_per_key_and_only_when_it_passes(tmp_path):
    """`FileFacts.once` runs a check once per key (a dtype, a config digest) for unchanged contents; a
    check that raises records nothing, so a refused file is checked again, not let through."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"x")
    identity = safetensors_files.FileIdentity.of(path)
    facts, runs = FileFacts(tmp_path / "facts.json"), []
    for key in ("a", "a", "b"):
        facts.once(identity, "verdict", key, lambda: runs.append(1))
    assert len(runs) == 2

    def refuse():
        runs.append(1)
        raise ValueError("bad")

    for _ in range(2):
        with pytest.raises(ValueError):
            FileFacts(tmp_path / "facts.json").once(identity, "verdict", "c", refuse)
    assert len(runs) == 4 and FileFacts(tmp_path / "facts.json").get(identity, "verdict") == ["a", "b"]
