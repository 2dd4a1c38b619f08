"""Whether the installed torch and torchvision are one pair, asked before the app imports either for real.

Why: torchvision is a compiled extension built against one torch build. Where PyTorch's CPU index is
out of reach, pip happily combines a CPU torch with PyPI's torchvision (built against PyPI's torch), or
keeps an old torchvision beside a new torch; the app then dies deep inside spandrel's import with a
150-line traceback ending in `operator torchvision::nms does not exist` (issue 45, item 1). The check
compares the versions and imports torchvision once at start (spandrel imports it anyway), so a broken
pair costs one line naming the pair to install, not a crash in the middle of loading an upscaler.

Pairs: torchvision 0.(m + 15) is built for torch 2.m (0.15 for 2.0 through 0.29 for 2.14).
"""

from __future__ import annotations

from importlib import metadata

VISION_MINOR_OFFSET = 15


def vision_for(torch_version: str) -> str | None:
    """The torchvision minor series ("0.29") built for a torch version ("2.14.1+cpu"); None if not 2.x."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return f"0.{minor + VISION_MINOR_OFFSET}" if major == 2 else None


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pair_problem() -> str | None:
    """One line saying what is wrong with the installed pair and the command that fixes it; None if torch and
    torchvision import together (or torch is absent: pip's own error says that better)."""
    torch_version, vision_version = _installed("torch"), _installed("torchvision")
    if torch_version is None:
        return None
    wanted = vision_for(torch_version)
    fix = (f"pip install --force-reinstall 'torch=={torch_version.split('+')[0]}' 'torchvision=={wanted}.*'"
           if wanted else "pip install --force-reinstall torch torchvision")
    if not torch_version.endswith("+cpu"):
        fix += " (both from PyPI)"
    else:
        fix += " --index-url https://download.pytorch.org/whl/cpu (both from PyTorch's CPU index)"
    if vision_version is None:
        return f"torchvision is not installed beside torch {torch_version}: {fix}"
    if wanted and not vision_version.startswith(wanted + "."):
        return (f"torchvision {vision_version} is not built for torch {torch_version} (it needs torchvision "
                f"{wanted}): {fix}")
    try:
        import torchvision  # noqa: F401  (registers its compiled operators, nms among them, against torch)
    except (ImportError, RuntimeError) as exc:
        return (f"torchvision {vision_version} cannot load with torch {torch_version}, they come from different "
                f"builds ({exc}): {fix}")
    return None
