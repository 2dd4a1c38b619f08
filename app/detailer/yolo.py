"""Reading a YOLOv8 export's outputs (ultralytics' detect and segment heads) as regions: pure numpy.

The shapes are ultralytics' (what `yolo export format=onnx` writes, and ADetailer's `face_yolov8n`,
`hand_yolov8n`, `person_yolov8n-seg` are): the input is one RGB image scaled to 0…1 and letterboxed
to the network's size with grey 114 padding; output 0 is (1, 4 + classes [+ 32], N) with each
column a box centre x, y, width, height in input pixels, the classes' scores (already sigmoid), and
for a segment head 32 mask coefficients; a segment head's output 1 is (1, 32, H/4, W/4) prototypes.
Suppression follows ultralytics' defaults: per class, IoU 0.7, at most 300 boxes. The runtime that
produces the arrays is `onnx_detector`'s; this module is kept apart so it is tested without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image

from app.detailer.regions import Region, clipped_box, suppress

PAD_GREY = 114
MASK_COEFFICIENTS = 32
NMS_IOU = 0.7
MAX_DETECTIONS = 300


@dataclass(frozen=True)
class Letterbox:
    """How an image was fitted into the network's input: scaled by `scale`, then shifted by the pad."""

    scale: float
    pad_x: int
    pad_y: int
    width: int  # the network's input size
    height: int
    inner_width: int  # the scaled image inside it
    inner_height: int


def letterbox(image: Image.Image, width: int, height: int) -> tuple[np.ndarray, Letterbox]:
    """`image` as the network's (1, 3, height, width) float32 input, aspect kept, centred on grey."""
    scale = min(width / image.width, height / image.height)
    new_w, new_h = round(image.width * scale), round(image.height * scale)
    pad_x, pad_y = round((width - new_w) / 2 - 0.1), round((height - new_h) / 2 - 0.1)
    canvas = np.full((height, width, 3), PAD_GREY, dtype=np.uint8)
    resized = cv2.resize(np.asarray(image.convert("RGB")), (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    canvas[pad_y:pad_y + new_h, pad_x:pad_x + new_w] = resized
    batch = canvas.transpose(2, 0, 1)[None].astype(np.float32) / 255.0
    return batch, Letterbox(scale, pad_x, pad_y, width, height, new_w, new_h)


def decode(output: np.ndarray, num_classes: int, confidence: float, classes: tuple[int, ...] | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boxes (K, 4: x0 y0 x1 y1 in input pixels), scores (K,) and the rows' mask coefficients (K, M; M = 0
    for a detect head) kept after the confidence threshold and per-class suppression, best first.
    `classes`: the class indices that count (None: all)."""
    table = output[0].T  # (N, 4 + classes [+ coefficients])
    class_scores = table[:, 4:4 + num_classes]
    if classes is not None:
        class_scores = np.where(np.isin(np.arange(num_classes), classes), class_scores, 0.0)
    best = class_scores.argmax(axis=1)
    scores = class_scores[np.arange(len(table)), best]
    chosen = scores >= confidence
    centre, size = table[chosen, 0:2], table[chosen, 2:4]
    boxes = np.concatenate([centre - size / 2, centre + size / 2], axis=1).astype(np.float64)
    scores, best, coefficients = scores[chosen], best[chosen], table[chosen, 4 + num_classes:]
    # Per class: shift each class's boxes apart so that boxes of different classes never overlap.
    offset = best[:, None] * (max(float(boxes.max(initial=0.0)), 1.0) + 1.0)
    keep = suppress(boxes + offset, scores.astype(np.float64), NMS_IOU)[:MAX_DETECTIONS]
    return boxes[keep], scores[keep].astype(np.float64), coefficients[keep]


def _unletterboxed(plane: np.ndarray, fit: Letterbox, size: tuple[int, int]) -> np.ndarray:
    """A plane at the network's input size, its padding cut off and scaled to the image's `size`."""
    inner = plane[fit.pad_y:fit.pad_y + fit.inner_height, fit.pad_x:fit.pad_x + fit.inner_width]
    return cv2.resize(inner, size, interpolation=cv2.INTER_LINEAR)


def segment_masks(coefficients: np.ndarray, protos: np.ndarray, boxes: np.ndarray, fit: Letterbox,
                  size: tuple[int, int]) -> list[Image.Image]:
    """Each kept row's outline as a full-size "L" mask: the prototypes mixed by its coefficients, kept
    inside its box (ultralytics' `process_mask`), at the image's `size`."""
    planes, proto_h, proto_w = protos.shape[1:]
    logits = (coefficients @ protos[0].reshape(planes, -1)).reshape(-1, proto_h, proto_w)
    rows, cols = np.arange(fit.height)[:, None], np.arange(fit.width)[None, :]
    masks = []
    for logit, (x0, y0, x1, y1) in zip(logits, boxes, strict=True):
        full = cv2.resize(logit.astype(np.float32), (fit.width, fit.height), interpolation=cv2.INTER_LINEAR)
        inside = (cols >= x0) & (cols < x1) & (rows >= y0) & (rows < y1)
        plane = ((full > 0.0) & inside).astype(np.float32)  # sigmoid(x) > 0.5 ⇔ x > 0
        masks.append(Image.fromarray(((_unletterboxed(plane, fit, size) > 0.5) * 255).astype(np.uint8), "L"))
    return masks


def to_regions(boxes: np.ndarray, scores: np.ndarray, fit: Letterbox, size: tuple[int, int],
               masks: list[Image.Image] | None = None) -> list[Region]:
    """Regions in image pixels from boxes in input pixels; empty boxes (all in the padding) dropped."""
    width, height = size
    regions = []
    for i, (x0, y0, x1, y1) in enumerate(boxes):
        box = clipped_box((x0 - fit.pad_x) / fit.scale, (y0 - fit.pad_y) / fit.scale,
                          (x1 - fit.pad_x) / fit.scale, (y1 - fit.pad_y) / fit.scale, width, height)
        region = Region(box, float(scores[i]), masks[i] if masks is not None else None)
        if region.area > 0:
            regions.append(region)
    return regions
