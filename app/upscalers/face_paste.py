"""Face restoration of one image: each face cut to a square with margin, restored at the model's side, and
pasted back through a feathered mask at the asked visibility.

Why this shape: GFPGAN-class models restore a face that fills a square of their input side (512); A1111's
`facexlib` aligns by five landmarks first, which needs a landmark model this app does not ship. The built-in
face detector's box, widened by `MARGIN` on each side and made square, gives the model the whole head at the
scale it was trained on. The paste weight falls linearly to 0 over the outer `FEATHER` of the square, so
the square's border shows no seam, and every pixel outside the squares is the input's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

MARGIN = 0.3  # of the face box's longer side, added on each side
FEATHER = 0.15  # of the square's side: where the paste weight ramps from 0 to 1
Box = tuple[int, int, int, int]


def face_square(box: Box, width: int, height: int) -> Box:
    """The square around `box` with `MARGIN`, moved (not cut) to lie inside the image where it fits."""
    x0, y0, x1, y1 = box
    side = min(round(max(x1 - x0, y1 - y0) * (1 + 2 * MARGIN)), width, height)
    left = min(max(round((x0 + x1 - side) / 2), 0), width - side)
    top = min(max(round((y0 + y1 - side) / 2), 0), height - side)
    return left, top, left + side, top + side


def feather(side: int) -> np.ndarray:
    """The paste weight on a `side` square: 0 on its border, 1 inside, a linear ramp between ((side, side, 1))."""
    ramp = max(1.0, side * FEATHER)
    edge = np.minimum(np.arange(side), np.arange(side)[::-1]).astype(np.float32)
    along = np.clip(edge / ramp, 0.0, 1.0)
    return np.minimum(along[:, None], along[None, :])[..., None]


def restore_faces(image: Image.Image, boxes: Sequence[Box], restore: Callable[[Image.Image], Image.Image],
                  side: int, visibility: float) -> Image.Image:
    """`image` (RGB) with each face in `boxes` restored by `restore` (a `side`² RGB picture in, one out),
    blended at `visibility` (0: the input, bit for bit; 1: the restored face inside the feathered square)."""
    if visibility <= 0 or not boxes:
        return image.copy()
    out = np.asarray(image, dtype=np.float32).copy()
    for box in boxes:
        x0, y0, x1, y1 = face_square(box, image.width, image.height)
        face = image.crop((x0, y0, x1, y1)).resize((side, side), Image.Resampling.LANCZOS)
        done = restore(face).resize((x1 - x0, y1 - y0), Image.Resampling.LANCZOS)
        weight = feather(x1 - x0) * np.float32(min(visibility, 1.0))
        here = out[y0:y1, x0:x1]
        out[y0:y1, x0:x1] = here + (np.asarray(done, dtype=np.float32) - here) * weight
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8))
