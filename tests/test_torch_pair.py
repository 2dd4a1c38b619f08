"""A mismatched torch/torchvision pair stops `python launch.py` with one line naming the pair to install.

What it protects (issue 45, item 1): where PyTorch's CPU index was out of reach, pip combined a CPU torch
with a torchvision built for another torch, and the app died inside spandrel's import with a 150-line
traceback ending in `operator torchvision::nms does not exist`. Both ways a pair breaks are planted in a
folder put first on the launched interpreter's path: a torchvision whose import fails that way (same
version, another build), and a torchvision distribution of another series (0.28 beside torch 2.14).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from app.torch_pair import pair_problem, vision_for

ROOT = Path(__file__).resolve().parents[1]
TORCH = metadata.version("torch")


def _launch(shadow: Path, data: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "--data-dir", str(data), "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=120)


def _one_line_naming_the_fix(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    wanted = vision_for(TORCH)
    assert f"'torch=={TORCH.split('+')[0]}' 'torchvision=={wanted}.*'" in lines[0], lines[0]
    return lines[0]


def test_the_installed_pair_is_accepted():
    """The environment the suite runs in is a working pair: the check says nothing (every launch passes it)."""
    assert pair_problem() is None


def test_a_torchvision_from_another_build_is_named_in_one_line(tmp_path):
    """Same version, another build: the import fails as the user saw it, and launch says so in one line."""
    package = tmp_path / "shadow" / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    line = _one_line_naming_the_fix(_launch(tmp_path / "shadow", tmp_path))
    assert "cannot load with torch" in line and "operator torchvision::nms does not exist" in line, line


def test_a_torchvision_of_another_series_is_named_before_it_is_imported(tmp_path):
    """torchvision 0.28.0 beside torch 2.14: refused from the versions, before importing anything of it."""
    shadow = tmp_path / "shadow"
    info = shadow / "torchvision-0.28.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    (shadow / "torchvision").mkdir()
    (shadow / "torchvision" / "__init__.py").write_text('raise SystemExit("imported: the versions were not read")\n')
    line = _one_line_naming_the_fix(_launch(shadow, tmp_path))
    assert f"torchvision 0.28.0 is not built for torch {TORCH}" in line, line


@pytest.mark.parametrize("torch_version, series", [("2.14.1", "0.29"), ("2.13.0+cpu", "0.28"), ("2.0.1", "0.15"),
                                                   ("3.0.0", None)])
def test_the_series_follows_torchs_minor_version(torch_version, series):
    assert vision_for(torch_version) == series
