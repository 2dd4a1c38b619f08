"""Import spandrel, with or without a torchvision that works beside this torch.

spandrel imports torchvision when it is imported, for two architectures that are not upscalers:
LaMa (inpainting: `rotate`, `InterpolationMode`) and RestoreFormer (face restoration:
`normalize`). torchvision must come from the same index as torch: PyPI's build is linked against
CUDA torch, and beside a CPU torch its import fails (`operator torchvision::nms does not exist`),
while installing it through pip swaps the CPU torch for a CUDA one. Where no working torchvision
is installed, spandrel is imported with those three names standing in, each raising if either
architecture ever ran (`arch.describe` refuses both before that: they are not upscalers), and
the stand-ins are taken out of `sys.modules` at once, so nothing else ever sees a torchvision.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from functools import cache

log = logging.getLogger(__name__)

_STAND_INS = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class SpandrelMissing(RuntimeError):
    """spandrel is not installed: upscaler models cannot be read."""


def _needs_torchvision(*_args, **_kwargs):
    raise RuntimeError("this architecture needs torchvision, which is not installed beside this torch; "
                       "install the torchvision that matches it from the same index")


def _stand_in_modules() -> dict[str, types.ModuleType]:
    modules = {name: types.ModuleType(name) for name in _STAND_INS}
    functional = modules["torchvision.transforms.functional"]
    functional.rotate = functional.normalize = _needs_torchvision
    functional.InterpolationMode = types.SimpleNamespace(BILINEAR="bilinear")
    return modules


@cache
def spandrel() -> types.ModuleType:
    """The spandrel module (imported once); `SpandrelMissing` says how to install it."""
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # noqa: BLE001 - ImportError, or RuntimeError from a CUDA build beside a CPU torch
        log.info("spandrel imported without torchvision (%s: %s)", type(exc).__name__, exc)
        return _import_with_stand_ins()
    return _import_spandrel()


def _import_spandrel() -> types.ModuleType:
    try:
        return importlib.import_module("spandrel")
    except ModuleNotFoundError as exc:
        if exc.name != "spandrel":
            raise
        raise SpandrelMissing("upscaler models need spandrel: pip install -e '.[upscalers]' (with torchvision "
                              "from the index torch came from)") from None


def _import_with_stand_ins() -> types.ModuleType:
    saved = {name: sys.modules.pop(name) for name in list(sys.modules)
             if name == "torchvision" or name.startswith("torchvision.")}
    sys.modules.update(_stand_in_modules())
    try:
        return _import_spandrel()
    finally:
        for name in _STAND_INS:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
