"""`python -m app.bench` runs `benchmarks/bench.py` (one implementation; see its docstring).

The benchmark lives beside its results under `benchmarks/`, which is not a package, so it is
loaded by path here rather than imported.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


def load() -> ModuleType:
    """The benchmark module (loaded once per process, registered as `benchmarks.bench`)."""
    if "benchmarks.bench" in sys.modules:
        return sys.modules["benchmarks.bench"]
    spec = importlib.util.spec_from_file_location("benchmarks.bench", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    return load().main(argv)


if __name__ == "__main__":
    sys.exit(main())
