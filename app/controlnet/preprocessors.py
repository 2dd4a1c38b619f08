"""Placeholder of cn-pre's preprocessor module (branch i-cn-pre replaces it at merge): module "none" only,
so the engine's ControlNet path runs on this branch. Same signature as cn-pre's `detect_map`."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def detect_map(module: str, image: Image.Image, resolution: int, threshold_a: float, threshold_b: float, *,
               mask: Image.Image | None = None, models_dir: Path | None = None) -> Image.Image:
    """The control map `module` detects in `image`: "none" passes the picture on as RGB."""
    if module != "none":
        raise ValueError(f"unknown ControlNet preprocessor {module!r}")
    return image.convert("RGB")
