"""The `-m gpu` tests come in two forms. The full form is for a person's own GPU session; the fast
form (`SD_GPU_FAST=1`, set by `python -m app.devicecheck`) is for a lent GPU whose whole budget is a
few minutes: it runs fewer repetitions, steps and pixels, and one dtype per architecture in the
full-size sequences, but never drops an assertion. Tests whose figures a device-check bench section
already measures (the full-size Flux pipeline, the compiled path) carry `gpu_long` and stay out of it.
"""

from __future__ import annotations

import os

FAST = os.environ.get("SD_GPU_FAST") == "1"
# (arch, dtype) cases the full-size sequences run in the fast form: SD1.5 in bf16 (where fusion on
# the rest device once drifted) and SDXL in fp16 (where its VAE upcasts).
FAST_CASES = {("sd15", "bf16"), ("sdxl", "fp16")}


def pick(full, fast):
    """`fast` in the fast form, `full` otherwise."""
    return fast if FAST else full


def skip_outside_fast_cases(pytest, arch: str, dtype: str) -> None:
    if FAST and (arch, dtype) not in FAST_CASES:
        pytest.skip(f"fast form runs {sorted(FAST_CASES)} only (SD_GPU_FAST=1)")
