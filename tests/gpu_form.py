"""The `-m gpu` tests come in two forms. The full form is for a person's own GPU session; the fast
form (`SD_GPU_FAST=1`, set by `python -m app.devicecheck`) is for a lent GPU whose whole budget is a
few minutes: it runs fewer fuzz transitions and fewer (family, dtype) cases of the full-size
sequences, but never drops an assertion nor changes a tolerance's yardstick. Tests whose figures a
device-check bench section already measures (the full-size Flux pipeline, the compiled path) carry
`gpu_long` and stay out of it.
"""

from __future__ import annotations

import os

FAST = os.environ.get("SD_GPU_FAST") == "1"
# (family, dtype) cases the full-size tests run in the fast form, at the full form's size and steps (their
# tolerances are fractions of what a 0.1 strength step changes, which fewer steps would shrink):
# SD1.5 in bf16 (where fusion on the rest device once drifted) and SDXL in fp16 (its VAE upcasts) for
# the txt2img sequences; SD1.5 bf16 for the workflows, whose SDXL run alone took over 90 s on an H100.
SEQUENCE_CASES = {("sd15", "bf16"), ("sdxl", "fp16")}
WORKFLOW_CASES = {("sd15", "bf16")}


def pick(full, fast):
    """`fast` in the fast form, `full` otherwise."""
    return fast if FAST else full


def skip_outside(cases: set[tuple[str, str]], pytest, family_name: str, dtype: str) -> None:
    if FAST and (family_name, dtype) not in cases:
        pytest.skip(f"the fast form (SD_GPU_FAST=1) runs {sorted(cases)} only")
