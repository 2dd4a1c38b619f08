"""ADetailer's mask rules, in its order, counted in pixels (app/detailer/masks.py).

Protects: a box fills exactly its pixels; dilate/erode use ADetailer's square OpenCV kernel (width
|px|, anchor at the centre); the offset moves right/up without wrapping round the edge; the area
ratio filter, top-k by area or by confidence, merge and merge-and-invert; and the outcomes a caller
reports apart: nothing detected, all filtered, a mask covering the whole image.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from app.detailer import masks
from app.detailer.regions import Region
from app.detailer.units import DetailUnit

SIZE = (100, 80)
SMALL = Region((10, 20, 30, 50), 0.9)  # 20 × 30 = 600 px, 7.5 % of the image
LARGE = Region((50, 10, 90, 70), 0.5)  # 40 × 60 = 2400 px, 30 %


def _on(mask: Image.Image) -> int:
    return int((np.asarray(mask) == 255).sum())


def test_box_dilate_erode_offset_pixel_counts():
    """Box 20×30 = 600 px; dilate 4 → 23×33 = 759 (one px left/up, two right/down); erode 4 → 17×27 = 459;
    offset 5 right, 3 up moves the box; 95 px right leaves 5 columns (no wrap to the left edge)."""
    box = masks.region_mask(SMALL, SIZE)
    assert _on(box) == 600 and box.getbbox() == (10, 20, 30, 50)
    grown = masks.dilate_erode(box, 4)
    assert _on(grown) == 23 * 33 and grown.getbbox() == (9, 19, 32, 52)
    shrunk = masks.dilate_erode(box, -4)
    assert _on(shrunk) == 17 * 27 and shrunk.getbbox() == (12, 22, 29, 49)
    assert masks.offset(box, 5, 3).getbbox() == (15, 17, 35, 47)
    edge = masks.offset(masks.region_mask(LARGE, SIZE), 15, 0)
    assert _on(edge) == 35 * 60 and edge.getbbox() == (65, 10, 100, 70)
    assert masks.offset(box, 95, 0).getbbox() is None


def test_ratio_topk_merge_invert():
    """min/max ratio keep 7.5 % or 30 % boxes; top-1 by area is LARGE, by confidence SMALL; merge is the
    union (3000 px) and merge-and-invert its complement (8000 − 3000)."""
    both = [SMALL, LARGE]
    assert masks.filter_by_ratio(both, 0.1, 1.0, SIZE) == [LARGE]
    assert masks.filter_by_ratio(both, 0.0, 0.075, SIZE) == [SMALL]
    assert masks.filter_k(both, 1, "Area") == [LARGE] and masks.filter_k(both, 1, "Confidence") == [SMALL]
    assert masks.filter_k(both, 0) == both
    pair = [masks.region_mask(r, SIZE) for r in both]
    assert [_on(m) for m in masks.merge_invert(pair, "Merge")] == [3000]
    assert [_on(m) for m in masks.merge_invert(pair, "Merge and Invert")] == [8000 - 3000]
    assert masks.merge_invert(pair, "None") == pair


def test_build_masks_in_adetailers_order_and_outcomes():
    """The whole chain on two boxes, and each outcome told apart with its note."""
    unit = DetailUnit("face_opencv_haar", mask_k=1, dilate_erode=0, x_offset=0, mask_min_ratio=0.05)
    result = masks.build_masks([SMALL, LARGE], SIZE, unit)
    assert result.outcome == masks.OK and [_on(m) for m in result.masks] == [2400]
    ratio_first = masks.build_masks([SMALL, LARGE], SIZE, DetailUnit("face_opencv_haar", mask_k=1, mask_max_ratio=0.1))
    assert [_on(m) for m in ratio_first.masks] == [759]  # the ratio drops LARGE before top-1 picks; then dilate 4
    nothing = masks.build_masks([], SIZE, unit)
    assert nothing.outcome == masks.NOTHING_DETECTED and "found nothing" in nothing.note
    filtered = masks.build_masks([SMALL], SIZE, DetailUnit("face_opencv_haar", mask_min_ratio=0.5))
    assert filtered.outcome == masks.ALL_FILTERED and filtered.masks == []
    eroded = masks.build_masks([Region((10, 10, 13, 13), 0.9)], SIZE, DetailUnit("face_opencv_haar", dilate_erode=-8))
    assert eroded.outcome == masks.ALL_FILTERED
    whole = masks.build_masks([Region((2, 2, 98, 78), 0.9)], SIZE, DetailUnit("face_opencv_haar", dilate_erode=8))
    assert whole.outcome == masks.COVERS_EVERYTHING and "whole image" in whole.note
    segment = Region((10, 20, 30, 50), 0.9, masks.region_mask(Region((12, 22, 20, 30), 1.0), SIZE))
    assert _on(masks.build_masks([segment], SIZE, DetailUnit("face_opencv_haar", dilate_erode=0)).masks[0]) == 64
