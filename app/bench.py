"""`python -m app.bench` runs the benchmark package under `benchmarks/` (one implementation; see
`benchmarks/bench.py`). `benchmarks/` sits beside its results at the repository root rather than
inside `app`, so the root is put on the import path here when the entry point runs from elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main())
