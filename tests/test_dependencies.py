"""A clean install starts: every third-party module `app/` imports is a declared runtime dependency.

What it protects (issue 32): `pip install -e . && python launch.py` died with `No module named
'accelerate'` because only the test extras pulled accelerate in (through peft), so the suite never
saw it missing. The static check reads every import under `app/` (functions included) and the
distributions that provide each module (`importlib.metadata`, so `PIL` is Pillow and `pynvml` is
nvidia-ml-py) and compares them with `[project].dependencies` in `pyproject.toml`. The install
test builds a fresh virtual environment holding only torch and torchvision (linked from this one: a
user without a GPU installs that pair first, as the README says), runs the README's `pip install -e .`
and asks the launched app for its page.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from served_app import free_port

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the check needs no other parser

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: Path) -> dict[str, set[str]]:
    """Top-level module name -> the files under `package` that import it (absolute imports only;
    imports inside functions count: a lazy import fails as surely, only later)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(package.parent)))
    return found


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def declared_dependencies(pyproject: Path) -> set[str]:
    """The distribution names in `[project].dependencies`, normalised."""
    specs = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    return {_normalised(re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0]) for spec in specs}


def extra_modules(pyproject: Path) -> dict[str, set[str]]:
    """File under app/ -> the distribution names of the one optional extra it may import from: the
    entry points of optional commands (`[tool.steady-diffusion.extra-modules]`, e.g. Ray Serve's)."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    extras = config["project"].get("optional-dependencies", {})
    chosen = config.get("tool", {}).get("steady-diffusion", {}).get("extra-modules", {})
    return {path: {_normalised(re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0]) for spec in extras[extra]}
            for path, extra in chosen.items()}


def undeclared_imports(modules: dict[str, set[str]], declared: set[str], first_party: set[str],
                       optional: dict[str, set[str]] | None = None) -> dict[str, str]:
    """Each imported third-party module no declared distribution provides -> why, naming a file. A
    module imported only by `optional`'s files, each of whose extra names it, is that extra's."""
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, files in sorted(modules.items()):
        if module in sys.stdlib_module_names or module in first_party or module == "__future__":
            continue
        dists = {_normalised(d) for d in providers.get(module, [])}
        if optional and all(_normalised(module) in optional.get(f, set()) | (dists & optional.get(f, set()))
                            for f in files):
            continue
        if not dists & declared:
            where = sorted(files)[0]
            missing[module] = (f"{where} imports {module}, provided by {', '.join(sorted(dists))}, which is not in "
                               "[project].dependencies" if dists else f"{where} imports {module}, which no installed "
                               "distribution provides")
    return missing


def _first_party() -> set[str]:
    """Names of this repository's own top-level modules and packages (app, benchmarks, launch …)."""
    return {p.stem for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}


def test_every_third_party_module_app_imports_is_a_declared_dependency():
    """Only the files pyproject.toml names as an optional extra's entry point (app/cluster.py: Ray Serve)
    may import that extra's packages; taken out of that table, the Ray import is caught too."""
    pyproject = ROOT / "pyproject.toml"
    modules = imported_modules(ROOT / "app")
    missing = undeclared_imports(modules, declared_dependencies(pyproject), _first_party(), extra_modules(pyproject))
    assert missing == {}, "\n".join(missing.values())
    assert "ray" in undeclared_imports(modules, declared_dependencies(pyproject), _first_party())


def test_the_check_catches_accelerate_missing_from_the_dependencies(tmp_path):
    """The bug of issue 32 itself: with accelerate taken out of pyproject.toml's dependencies (it is
    still installed here, through the test extras) the check names it and the file importing it."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    without = re.sub(r'^\s*"accelerate[^"]*",.*\n', "", text, flags=re.MULTILINE)
    assert without != text
    (tmp_path / "pyproject.toml").write_text(without, encoding="utf-8")
    missing = undeclared_imports(imported_modules(ROOT / "app"), declared_dependencies(tmp_path / "pyproject.toml"),
                                 _first_party(), extra_modules(tmp_path / "pyproject.toml"))
    assert list(missing) == ["accelerate"]
    assert "app/engine/component_files.py imports accelerate" in missing["accelerate"] or \
        "app/controlnet/loading.py imports accelerate" in missing["accelerate"]


def _pip(venv_python: Path, *args: str) -> None:
    """The running interpreter's pip installing into the new venv (`--python`: no pip bootstrapped into
    it, which would cost seconds); no bytecode compiled, the app's first import does what it needs."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv_python), "install",
                           "--disable-pip-version-check", "--no-compile", "-q", *args],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def _closure(names: tuple[str, ...]) -> set[str]:
    """The installed distributions `names` need, themselves included (markers evaluated here)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _link_torch_pair(venv_python: Path, folder: Path) -> None:
    """torch and torchvision, and what they need, linked from this environment into `folder`, which the
    venv reads through a .pth file. A user without a GPU installs that pair first from PyTorch's index
    (the README), and copying its gigabytes would cost minutes; everything else is installed afresh."""
    folder.mkdir()
    for name in _closure(("torch", "torchvision")):
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)
    site = subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "torch_pair.pth").write_text(f"{folder}\n")


def _wait_for_page(url: str, process: subprocess.Popen, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"launch.py exited with {process.returncode}"
        try:
            if requests.get(f"{url}/gradio_api/info", timeout=5).ok:
                return requests.get(url, timeout=10).text
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the app did not answer on {url} within {timeout} s")


@pytest.mark.install
def test_a_fresh_venv_with_pip_install_e_dot_starts_the_app(tmp_path):
    """The README's `pip install -e . && python launch.py` in a new virtual environment (no extras, nothing
    from this one but the torch/torchvision pair; pip's cache allowed) serves its page with the demo models."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    _link_torch_pair(python, tmp_path / "torch-pair")
    _pip(python, "-e", str(ROOT))
    port, data = free_port(), tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "NO_PROXY": "localhost,127.0.0.1"}
    log = (tmp_path / "launch.log").open("w")
    process = subprocess.Popen([str(python), str(ROOT / "launch.py"), "--data-dir", str(data), "--create-data-dir",
                                "--port", str(port), "--device", "cpu"], cwd=tmp_path, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        page = _wait_for_page(f"http://127.0.0.1:{port}", process)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its output:\n{(tmp_path / 'launch.log').read_text()[-3000:]}") from None
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()
    assert "Steady Diffusion" in page
