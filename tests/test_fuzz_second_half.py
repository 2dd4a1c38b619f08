"""The second half of the CPU fuzz's budget (the machine and its invariants: tests/test_fuzz.py).

A module of its own so that pytest-xdist (`--dist loadfile`) can give it to the other worker: the
whole fuzz in one module ran alone on one worker for the last minutes of the suite. Its loads draw
the families in reverse order, so the same derandomized choices walk other sequences.
"""

from __future__ import annotations

import pytest
from test_fuzz import FAMILY_NAMES, fuzz_data, run_cpu_fuzz  # noqa: F401 - fuzz_data: the fixture


@pytest.mark.timeout(1200)
def test_fuzz_engine_api_cpu_second_half(fuzz_data, record_property):  # noqa: F811 - the fixture
    """Second half of the CPU fuzz: the same invariants over other random sequences."""
    run_cpu_fuzz(fuzz_data, record_property, tuple(reversed(FAMILY_NAMES)))
