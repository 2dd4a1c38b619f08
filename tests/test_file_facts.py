"""A checkpoint's hash and weight check are read from its file once per content, after the load, in the
background (`file_scans`), and kept per file (`FileFacts`); a first load returns without reading the
file, and the first image after it still carries the file's `Model hash`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import save_file

from app import safetensors_files
from app.engine import checkpoint_files, file_scans, models
from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.safetensors_files import FileFacts, scan_file
from app.settings import Settings


def _counting_scans(monkeypatch, gate: threading.Event | None = None) -> list[str]:
    """Record every file `scan_file` reads (and hold each read until `gate` is set)."""
    reads, real = [], safetensors_files.scan_file

    def scan(path, stop=None):
        reads.append(path.name)
        assert gate is None or gate.wait(30), "the test never let the read go on"
        return real(path, stop)

    monkeypatch.setattr(safetensors_files, "scan_file", scan)
    return reads


def test_scan_reads_the_hash_and_every_floating_value(tmp_path):
    """One read gives A1111's sha256 of the whole file and names the tensors holding NaN/Inf (fp8's
    NaN bit pattern too) or values that overflow fp16; integer tensors are only hashed."""
    tensors = {"fine": torch.ones(3, dtype=torch.bfloat16), "nan": torch.tensor([1.0, float("nan")]),
               "inf16": torch.tensor([float("inf")], dtype=torch.float16), "huge": torch.tensor([-1e6, 2.0]),
               "fp8": torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn), "ids": torch.arange(4)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    scan = scan_file(path)
    assert scan.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sorted(scan.nonfinite) == ["fp8", "inf16", "nan"] and scan.largest == {"huge": 1e6}
    assert scan.not_finite_in(torch.float16) == [*scan.nonfinite, "huge"]
    assert scan.not_finite_in(torch.bfloat16) == list(scan.nonfinite)
    assert scan_file(path, stop=threading.Event()) is not None
    stopped = threading.Event()
    stopped.set()
    assert scan_file(path, stop=stopped) is None


def test_scan_is_read_once_per_file_identity(tmp_path, monkeypatch):
    """The scan is kept in the store; a restart (a new FileFacts on the same store) reuses it; a new
    mtime or size drops it."""
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(8)}, str(path))
    reads = _counting_scans(monkeypatch)
    store = tmp_path / "facts.json"
    assert FileFacts(store).scan(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert FileFacts(store).scan(path) and len(reads) == 1
    os.utime(path, ns=(1, 1))
    FileFacts(store).scan(path)
    assert len(reads) == 2


def test_a_broken_or_unwritable_store_only_costs_a_recompute(tmp_path, caplog):
    """The store is a cache: garbage in it is ignored, and a folder that cannot be written is reported
    once while the facts still hold for this process."""
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(2)}, str(path))
    store = tmp_path / "facts.json"
    store.write_text("{not json")
    facts = FileFacts(store)
    assert facts.scan(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert json.loads(store.read_text())["version"] == FileFacts.VERSION
    locked = FileFacts(tmp_path / "missing-folder" / "facts.json")
    locked.scan(path)
    locked.scan(path)
    assert sum("cannot write the file facts cache" in r.message for r in caplog.records) == 1


@pytest.fixture
def fresh_engine(demo_paths, tmp_path):
    """An engine on a fresh data folder holding the tiny SD1.5 file (hard-linked): nothing is known of it."""
    settings = Settings(data_dir=tmp_path, device="cpu")
    settings.checkpoints_dir.mkdir(parents=True)
    source = demo_paths["sd15_file"]
    os.link(source, settings.checkpoints_dir / source.name)
    engine = Engine(settings)
    yield engine, settings.checkpoints_dir / source.name
    engine.close()


def test_first_image_after_a_first_load_carries_the_model_hash_read_once(fresh_engine, monkeypatch):
    """A first load returns before its file is read (the read is held back here, and the snapshot has
    no hash yet); the first image, saved while the read still runs, waits for it and writes A1111's
    `Model hash` (sha256[:10] of the file) in its infotext; the file is read once, not again for the
    image, a reload or a new engine."""
    engine, path = fresh_engine
    gate = threading.Event()
    reads = _counting_scans(monkeypatch, gate)
    engine.load_model(path.name)
    assert engine.snapshot().model_hash is None
    want = hashlib.sha256(path.read_bytes()).hexdigest()[:10]
    threading.Timer(0.3, gate.set).start()
    image = engine.generate(GenerateParams("a fox", steps=1, width=64, height=64))[0]
    assert f"Model hash: {want}, Model: {path.name}," in image.infotext
    assert engine.snapshot().model_hash == want and reads == [path.name]
    engine.load_model(path.name, dtype="bf16")  # a reload in another dtype
    again = Engine(Settings(data_dir=path.parents[2], device="cpu"))
    try:
        again.load_model(path.name)
        assert again.snapshot().model_hash == want and reads == [path.name]
    finally:
        again.close()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_later_load_reads_nothing_until_a_file_changes(demo_paths, tmp_path, monkeypatch, kind):
    """A later load of an unchanged checkpoint neither reads its files nor checks its header's shapes
    again; a changed weight file (of any component, for a folder) is read again, alone. (Folders have
    no LDM header to check.)"""
    source = demo_paths["sd15_file" if kind == "file" else "sd15_folder"]
    root = tmp_path / "ckpt"
    root.mkdir()
    target = root / source.name
    if kind == "file":
        os.link(source, target)
    else:
        shutil.copytree(source, target, copy_function=os.link)
    reads, shape_checks = _counting_scans(monkeypatch), []
    real_shapes = models.check_header_shapes
    monkeypatch.setattr(models, "check_header_shapes", lambda *a: shape_checks.append(1) or real_shapes(*a))
    scans = file_scans.FileScans()

    def load() -> tuple[str | None, tuple]:
        info = checkpoint_files.resolve_checkpoint(source.name, root)
        loaded = models.load_pipeline(info, torch.float32, scans=scans)
        scan = scans.start(info.name, models.facts_store(info), loaded.files)
        assert scan.refusal(torch.float32, wait=True) is None  # every file read (and its weights finite)
        return scan.short_hash(), loaded.files

    (first, files), (second, _) = load(), load()
    assert first == second and reads == [f.name for f in files] and len(files) == (1 if kind == "file" else 3)
    assert len(shape_checks) == (1 if kind == "file" else 0)
    assert (root / models.FACTS_FILE).is_file()
    changed = target if kind == "file" else target / "vae" / "diffusion_pytorch_model.safetensors"
    data = changed.read_bytes()
    changed.unlink()  # a new file, not the linked one rewritten: the demo files are shared
    changed.write_bytes(data)
    before = len(reads)
    load()
    assert reads[before:] == [changed.name]
    assert len(shape_checks) == (2 if kind == "file" else 0)
    assert checkpoint_files.discover_checkpoints(root)[0].name == source.name  # the dot file is not a checkpoint
    scans.close()


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
