"""A family is its own files: adding one changes nothing outside `app/families/`, `assets/`, `tests/`
and the README (the family contract's promise; for Z-Image and FLUX.2 Klein, their issues'
acceptance). Checked both ways for every family module the registry reads (discovered, no list to keep), but the
three that predate the contract:

- no tracked file elsewhere names them (code, comments, configuration), so their diff could not
  have touched one; `benchmarks/results/` holds measured output, not code, and is read as data;
- a copy of the application with the family's files taken out imports every module of `app/` and
  `benchmarks/`, registers the other families, and plans the device check without it: nothing
  outside those files depends on them.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import families
from app.families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
OWN_PLACES = ("app/families/", "assets/", "tests/", "README.md", "benchmarks/results/")
# The family modules from before the contract: generic code still names SD1.5, SDXL and FLUX.1 (their
# LoRA conventions, comments). Every other module exporting `FAMILIES` is discovered and checked.
PREDATING = ("flux", "sd15", "sdxl")


def _family_modules() -> dict[str, tuple]:
    """module name -> its families, for every module of app/families that exports some (as the registry finds them)."""
    found = {}
    for info in pkgutil.iter_modules(families.__path__):
        exported = getattr(importlib.import_module(f"app.families.{info.name}"), "FAMILIES", ())
        if exported:
            found[info.name] = tuple(exported)
    return found


MODULES = _family_modules()
ADDED = sorted(set(MODULES) - set(PREDATING))


def _spelled(word: str) -> str:
    """A word as a regex where its separators are optional ("Z-Image": z-image, zimage, z image, z_image)."""
    return r"[-_. ]?".join(re.escape(part) for part in re.split(r"[-_. ]+", word.lower()) if part)


def _words(module: str) -> tuple[str, ...]:
    """What names a module's families: the module, and the first word of each family's name and label
    ("flux2" of "flux2-klein-4b", "z-image" of "Z-Image Turbo"); variant words ("turbo", "4b") are not theirs."""
    fams = MODULES[module]
    return tuple(dict.fromkeys((module, *(f.name.split("-")[0] for f in fams), *(f.label.split()[0] for f in fams))))


def _pattern(module: str, words: tuple[str, ...] | None = None) -> re.Pattern:
    return re.compile("|".join(_spelled(word) for word in (_words(module) if words is None else words)) or "(?!)",
                      re.IGNORECASE)


def _texts(module: str) -> tuple[str, ...]:
    """The module's name and its families' names and labels: what another module's words must not match."""
    return (module, *(f.name for f in MODULES[module]), *(f.label for f in MODULES[module]))


def _line(module: str) -> set[str]:
    return {f.label.split()[0].lower() for f in MODULES[module]}


def _kin(module: str) -> set[str]:
    """The modules of one model line with `module`: their families' labels start with the same word (Qwen-Image and
    Qwen-Image 2.1, each in its own module), so their words name each other's families and none tells them apart.
    Any other match is a word too broad (Z-Image's "qwen" once matched a Qwen-Image family's name): an error."""
    return {other for other in ADDED if other != module and _line(other) & _line(module)}


def _own_words(module: str) -> tuple[str, ...]:
    """The module's words that name no kin module (`_kin`): what only this module's families answer to."""
    kin_texts = [text for other in _kin(module) for text in _texts(other)]
    return tuple(w for w in _words(module) if not any(_pattern(module, (w,)).search(t) for t in kin_texts))


def _own_files(module: str) -> tuple[str, ...]:
    """The module, the family modules named after it (`<module>_layout.py`, …), its families' bundled configs and
    the assets named after it (the script writing those configs)."""
    configs = {f.files.config_dir.relative_to(ROOT).as_posix() for f in MODULES[module]}
    named = [path for path in _tracked() if path.startswith(("app/families/", "assets/"))
             and re.fullmatch(rf"{module}(_\w+)?\.py|make_{module}_configs\.py", Path(path).name)]
    return tuple(sorted({*named, *configs}))


def test_families_are_discovered_and_no_familys_words_name_another():
    """The checked modules are what the registry reads (no list to keep), and one family's words never match
    another family's name, label or module (Z-Image's "qwen" once matched a Qwen-Image family's name) but a kin
    module's of the same model line, whose words name it back (`_kin`)."""
    assert {f.name for fams in MODULES.values() for f in fams} == set(FAMILIES) and ADDED
    for module in ADDED:
        others = [text for other in MODULES if other != module and other not in _kin(module)
                  for text in _texts(other)]
        assert [text for text in others if _pattern(module).search(text)] == [], module
        assert all(Path(ROOT / path).exists() for path in _own_files(module)), module


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def _listed() -> list[tuple[str, bool]]:
    """(path pattern, optional) for each file the contract's docstring says a family consists of."""
    doc = families.__doc__
    section = doc[doc.index("A family consists of these files"):doc.index("How to add a family")]
    return [(m[1].rstrip("/"), bool(m[2])) for m in re.finditer(r"^- `([^`]+)`( \(optional\))?", section, re.M)]


def _expand(pattern: str, module: str) -> set[str]:
    names = [f.name for f in MODULES[module]] if "<family>" in pattern else [""]
    return {pattern.replace("<module>", module).replace("<family>", name) for name in names}


def test_the_contract_lists_exactly_the_files_a_family_consists_of():
    """The docstring of `app/families/__init__.py` lists the files a family consists of: every discovered
    family's own files (its modules, configs, config script, test file) are among them, and each file it
    does not mark optional exists for each family, so a contributor can rely on the list both ways."""
    listed = _listed()
    assert len(listed) >= 5
    for module in ADDED:
        tests = [f"tests/test_{module}.py"] if (ROOT / f"tests/test_{module}.py").exists() else []
        own = {*_own_files(module), *tests}
        allowed = {path for pattern, _ in listed for path in _expand(pattern, module)}
        required = {path for pattern, optional in listed if not optional for path in _expand(pattern, module)}
        assert own - allowed == set(), module
        assert required - own == set(), module


def test_family_files_import_nothing_from_the_engine():
    """A family builds on `app/families/` alone (its base classes and shared pieces live there): no module of the
    package imports `app.engine`, so a new family never reaches into the engine, nor the engine's modules into it
    by a cycle."""
    found = []
    for path in sorted((ROOT / "app/families").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {name}" for name in names if name.startswith("app.engine")]
    assert found == []


@pytest.mark.parametrize("module", ADDED)
def test_no_file_outside_the_familys_places_names_it(module):
    words = _pattern(module)
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


@pytest.mark.parametrize("module", ADDED)
def test_the_application_without_the_familys_files_imports_and_plans_without_it(module, tmp_path):
    own_files = _own_files(module)
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
print(sorted(FAMILIES)); print(config.FAMILY_NAMES); print([s.key for s in devicecheck.PLAN])
"""
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    families, bench_families, sections = proc.stdout.splitlines()[-3:]
    names = {f.name for f in MODULES[module]}  # by name, and by its words that no kin module's families answer to
    gone = re.compile("|".join(rf"'{re.escape(name)}(-offload)?'" for name in names) + "|" +
                      _pattern(module, _own_words(module)).pattern, re.IGNORECASE)
    assert set(ast.literal_eval(families)) == set(FAMILIES) - names, proc.stdout[-500:]
    assert not gone.search(families + bench_families + sections), proc.stdout[-500:]
