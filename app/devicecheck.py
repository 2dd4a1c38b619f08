"""`python -m app.devicecheck --budget SECONDS [--dry-run]`: the one command a lent GPU runs, in
priority order and inside its time budget (the plan and why: `benchmarks/devicecheck.py`)."""

from __future__ import annotations

import sys

from app.bench import ROOT  # noqa: F401 - importing app.bench puts the repository root on the path
from benchmarks import devicecheck

if __name__ == "__main__":
    sys.exit(devicecheck.main())
