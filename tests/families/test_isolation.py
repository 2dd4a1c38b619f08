"""A family is its own files: adding one changes nothing outside `app/families/`, `assets/`, `tests/`
and the README (the family contract's promise; for Z-Image and FLUX.2 Klein, their issues'
acceptance). Checked both ways for the families added through the contract:

- no tracked file elsewhere names them (code, comments, configuration), so their diff could not
  have touched one; `benchmarks/results/` holds measured output, not code, and is read as data;
- a copy of the application with the family's files taken out imports every module of `app/` and
  `benchmarks/`, registers the other families, and plans the device check without it: nothing
  outside those files depends on them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OWN_PLACES = ("app/families/", "assets/", "tests/", "README.md", "benchmarks/results/")
# module -> (what names it anywhere, its own files: module, layout, bundled configs and their script)
ADDED_FAMILIES = {
    "klein": (r"klein|flux\.?2", ("app/families/klein.py", "app/families/klein_layout.py",
                                   "assets/configs/flux2-klein-4b", "assets/configs/flux2-klein-9b",
                                   "assets/make_klein_configs.py")),
    "zimage": (r"z-?image|cap_feat|qwen", ("app/families/zimage.py", "app/families/zimage_layout.py",
                                           "assets/configs/zimage-turbo", "assets/configs/zimage-base",
                                           "assets/make_zimage_configs.py")),
}


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("module", sorted(ADDED_FAMILIES))
def test_no_file_outside_the_familys_places_names_it(module):
    words = re.compile(ADDED_FAMILIES[module][0], re.IGNORECASE)
    hits = []
    for path in _tracked():
        if path.startswith(OWN_PLACES):
            continue
        try:
            text = (ROOT / path).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary (a screenshot) or not in this checkout
        hits += [f"{path}:{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1)
                 if words.search(line)]
    assert hits == []


@pytest.mark.parametrize("module", sorted(ADDED_FAMILIES))
def test_the_application_without_the_familys_files_imports_and_plans_without_it(module, tmp_path):
    own_files = ADDED_FAMILIES[module][1]
    for part in ("app", "assets", "benchmarks"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("results", "__pycache__"))
    for path in own_files:
        target = tmp_path / path
        assert target.exists(), path  # the list above names real files
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    check = """
import importlib, pkgutil
import app, benchmarks
for package in (app, benchmarks):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # an optional extra's package (Ray), not one of ours
            if exc.name.split(".")[0] in ("app", "benchmarks"):
                raise
from app.families import FAMILIES
from benchmarks import config, devicecheck
print(sorted(FAMILIES)); print(config.ARCHS); print([s.key for s in devicecheck.PLAN])
"""
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    families, archs, sections = proc.stdout.splitlines()[-3:]
    gone = re.compile(ADDED_FAMILIES[module][0], re.IGNORECASE)
    assert "sd15" in families and not gone.search(families + archs + sections), proc.stdout[-500:]
