"""A detected region and the box arithmetic every detector shares (overlap, suppression).

Kept apart from the detectors so the mask rules (`masks`) and the detectors (`haar_face`, `yolo`)
depend on one small record and not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

Box = tuple[int, int, int, int]  # x0, y0, x1, y1 in image pixels; x1 and y1 exclusive


@dataclass(frozen=True)
class Region:
    """One thing a detector found: its box, its score in 0…1 (what `ad_confidence` is compared with),
    and its outline where the detector draws one (a segmentation model: PIL "L", 0/255, the image's
    size); None means the box itself is the mask, as ADetailer fills a detection model's box."""

    box: Box
    score: float
    mask: Image.Image | None = None

    @property
    def area(self) -> int:
        x0, y0, x1, y1 = self.box
        return max(0, x1 - x0) * max(0, y1 - y0)


def clipped_box(x0: float, y0: float, x1: float, y1: float, width: int, height: int) -> Box:
    """A float box rounded to whole pixels (outward) and kept inside a `width` × `height` image."""
    return (int(min(max(np.floor(x0), 0), width)), int(min(max(np.floor(y0), 0), height)),
            int(min(max(np.ceil(x1), 0), width)), int(min(max(np.ceil(y1), 0), height)))


def suppress(boxes: np.ndarray, scores: np.ndarray, overlap: float, of_smaller: bool = False) -> list[int]:
    """Greedy non-maximum suppression: indices of `boxes` (N, 4 as x0 y0 x1 y1) kept, best score first;
    a box is dropped when its intersection with a kept one exceeds `overlap` of their union (YOLO's
    rule), or with `of_smaller` of the smaller box (one face seen whole by one cascade and in part by
    another)."""
    order = np.argsort(-scores, kind="stable")
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep: list[int] = []
    while order.size:
        best, rest = order[0], order[1:]
        keep.append(int(best))
        low = np.maximum(boxes[best, :2], boxes[rest, :2])
        high = np.minimum(boxes[best, 2:], boxes[rest, 2:])
        inter = np.prod(np.clip(high - low, 0, None), axis=1)
        base = np.minimum(areas[best], areas[rest]) if of_smaller else areas[best] + areas[rest] - inter
        order = rest[inter <= overlap * np.maximum(base, 1e-9)]
    return keep
