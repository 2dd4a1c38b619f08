"""The Detailer's detectors: the built-in face detector on real photographs, and users' YOLO exports.

Protects: the built-in detector (OpenCV's Haar cascades, no download) finds each face of real
photographs shipped by scikit-image (Eileen Collins in `astronaut`, the turned face in `camera`,
faces of Labeled Faces in the Wild), its boxes on the true faces, and no face in LFW's non-face
patches; an ONNX file with YOLOv8's output (1, 4 + classes, N) decodes to the planted boxes in image
pixels through the letterbox, with suppression, confidence and per-task classes; a segment head's
masks; ultralytics `.pt` pickles refused without being unpickled, with how to convert; a detector
named for one task whose classes are another's refused; the `/adetailer/v1` routes.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from app.detailer.detect import BUILTIN_FACE, DetectorError, DetectorLibrary

skdata = pytest.importorskip("skimage.data")

# True face boxes (x0, y0, x1, y1), measured by eye on the photographs: forehead to chin, ear to ear.
ASTRONAUT_FACE = (180, 75, 275, 178)
CAMERAMAN_FACE = (178, 112, 258, 200)
LFW_TILE, LFW_FACE = 110, 84  # LFW crops are the face itself: each shown at 84 px in a 110 px grey tile


def _iou(a, b) -> float:
    inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
    area = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / area


def _lfw_grid(first: int, count: int, columns: int) -> tuple[Image.Image, list[tuple[int, int, int, int]]]:
    faces = skdata.lfw_subset()
    rows = -(-count // columns)
    grid = Image.new("RGB", (columns * LFW_TILE, rows * LFW_TILE), (128, 128, 128))
    boxes = []
    for i in range(count):
        x = (i % columns) * LFW_TILE + (LFW_TILE - LFW_FACE) // 2
        y = (i // columns) * LFW_TILE + (LFW_TILE - LFW_FACE) // 2
        tile = Image.fromarray((faces[first + i] * 255).astype(np.uint8)).resize((LFW_FACE, LFW_FACE),
                                                                               Image.Resampling.BICUBIC)
        grid.paste(tile.convert("RGB"), (x, y))
        boxes.append((x, y, x + LFW_FACE, y + LFW_FACE))
    return grid, boxes


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return DetectorLibrary(tmp_path_factory.mktemp("adetailer"))


def test_builtin_detector_finds_each_face_of_real_photographs(library):
    """Astronaut and cameraman side by side over LFW's first four faces: six faces, each found at
    ADetailer's default confidence with its box on the true face (IoU ≥ 0.5), nothing else found."""
    lfw, lfw_boxes = _lfw_grid(0, 4, 4)
    photo = Image.new("RGB", (1024, 512 + lfw.height), (128, 128, 128))
    photo.paste(Image.fromarray(skdata.astronaut()), (0, 0))
    photo.paste(Image.fromarray(skdata.camera()).convert("RGB"), (512, 0))
    photo.paste(lfw, (0, 512))
    truth = [ASTRONAUT_FACE, tuple(v + d for v, d in zip(CAMERAMAN_FACE, (512, 0, 512, 0), strict=True)),
             *[(x0, y0 + 512, x1, y1 + 512) for x0, y0, x1, y1 in lfw_boxes]]
    found = library.detect(photo, BUILTIN_FACE, 0.3)
    assert len(found) == len(truth)
    for face in truth:
        best = max(_iou(face, r.box) for r in found)
        assert best >= 0.5, (face, [r.box for r in found])


def test_builtin_detector_on_lfw_faces_and_non_faces(library):
    """LFW's 100 faces in a grid: at least 95 found (99 measured), nothing else; its 100 non-face patches: none."""
    faces, boxes = _lfw_grid(0, 100, 10)
    found = library.detect(faces, BUILTIN_FACE, 0.3)
    hit = {i for i, box in enumerate(boxes) if any(_iou(box, r.box) >= 0.4 for r in found)}
    assert len(hit) >= 95 and len(found) == len(hit)
    others, _ = _lfw_grid(100, 100, 10)
    assert library.detect(others, BUILTIN_FACE, 0.3) == []


# ------------------------------------------------------------------------------- ONNX YOLO exports
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

NET = 64  # the tiny network's input side


class _TinyYolo(torch.nn.Module):
    """YOLOv8's output layout with a planted table: (1, 4 + classes [+ 32], N) plus, for a segment head,
    (1, 32, NET/4, NET/4) prototypes; the image enters the graph (times 0) so it is a real input."""

    def __init__(self, table: np.ndarray, protos: np.ndarray | None = None) -> None:
        super().__init__()
        self.register_buffer("table", torch.tensor(table, dtype=torch.float32)[None])
        self.protos = None if protos is None else torch.nn.Buffer(torch.tensor(protos, dtype=torch.float32)[None])

    def forward(self, images):
        out = self.table + images.mean() * 0
        return out if self.protos is None else (out, self.protos + images.mean() * 0)


def _column(cx, cy, w, h, scores, coefficients=()) -> list[float]:
    return [cx, cy, w, h, *scores, *coefficients]


def _export(path, table, metadata, protos=None) -> None:
    model = _TinyYolo(np.asarray(table, dtype=np.float32).T, protos)
    outputs = ["output0"] if protos is None else ["output0", "output1"]
    torch.onnx.export(model, (torch.zeros(1, 3, NET, NET),), str(path), dynamo=False, input_names=["images"],
                      output_names=outputs)
    proto = onnx.load(str(path))
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(path))


# An image 128 × 64 is letterboxed into 64 × 64 at scale 0.5 with 16 px of grey above and below: a box
# centred (32, 32), 16 × 8 in the network's pixels is (48, 24)–(80, 40) in the image's.
PLANTED = (48, 24, 80, 40)


def test_onnx_detect_head_decodes_planted_boxes(library):
    """The best box comes back in image pixels; a near-copy of it is suppressed; one under the confidence
    and one of the other class (a `person_` file keeps only 'person') are dropped."""
    table = [_column(32, 32, 16, 8, (0.9, 0.0)), _column(33, 32, 16, 8, (0.8, 0.0)),
             _column(10, 20, 4, 4, (0.2, 0.0)), _column(50, 40, 8, 8, (0.0, 0.95))]
    _export(library.folder / "person_tiny.onnx", table, {"task": "detect", "names": "{0: 'person', 1: 'car'}",
                                                         "imgsz": f"[{NET}, {NET}]"})
    found = library.detect(Image.new("RGB", (128, 64)), "person_tiny.onnx", 0.3)
    assert [(r.box, round(r.score, 3), r.mask) for r in found] == [(PLANTED, 0.9, None)]
    assert "person_tiny.onnx" in library.names()


def test_onnx_segment_head_draws_the_outline(library):
    """Prototype 0 is 1 inside the network's 24–40 × 28–36 window and −1 elsewhere; a row using it gets
    that window, cut to its box and mapped to the image: the planted box's 32 × 16 pixels less its four
    corners, which the prototypes' bilinear upsampling rounds off (one network pixel each, 2 × 2 in the
    image), as ultralytics' does."""
    protos = -np.ones((32, NET // 4, NET // 4), dtype=np.float32)
    protos[0, 28 // 4:36 // 4, 24 // 4:40 // 4] = 1.0
    table = [_column(32, 32, 16, 8, (0.9,), (1.0,) + (0.0,) * 31)]
    _export(library.folder / "face_seg.onnx", table, {"task": "segment", "names": "{0: 'face'}"}, protos)
    (region,) = library.detect(Image.new("RGB", (128, 64)), "face_seg.onnx", 0.3)
    mask = np.asarray(region.mask)
    assert region.box == PLANTED and mask.shape == (64, 128)
    assert int((mask == 255).sum()) == 32 * 16 - 4 * 2 * 2 and region.mask.getbbox() == PLANTED


def test_wrong_task_and_non_region_models_are_refused(library):
    """A `face_` file whose classes are hands, and a pose model, are refused by name before any run."""
    _export(library.folder / "face_wrong.onnx", [_column(32, 32, 8, 8, (0.9,))], {"task": "detect",
                                                                                 "names": "{0: 'hand'}"})
    with pytest.raises(DetectorError, match="named as a face detector, but the model finds hand"):
        library.check("face_wrong.onnx")
    _export(library.folder / "person_pose.onnx", [_column(32, 32, 8, 8, (0.9,))], {"task": "pose",
                                                                                  "names": "{0: 'person'}"})
    with pytest.raises(DetectorError, match="'pose' model"):
        library.detect(Image.new("RGB", (64, 64)), "person_pose.onnx", 0.3)


class _Trap:
    """Unpickling this would write a file: its absence proves the `.pt` was never unpickled."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_pickled_detectors_are_refused_unread(library, tmp_path):
    """An ultralytics `.pt` (a pickle) is refused with the reason and the export command, without being
    read; ADetailer's `.pt` name is served by the ONNX export of the same stem; `.safetensors` refused."""
    trap = tmp_path / "unpickled"
    (library.folder / "hand_yolov8n.pt").write_bytes(pickle.dumps(_Trap(str(trap))))
    with pytest.raises(DetectorError, match=r"pickle.*yolo export model=hand_yolov8n.pt format=onnx"):
        library.check("hand_yolov8n.pt")
    assert not trap.exists() and "hand_yolov8n.pt" not in library.names()
    assert dict(library.refused())["hand_yolov8n.pt"].startswith("hand_yolov8n.pt is an ultralytics PyTorch file")
    with pytest.raises(DetectorError, match="does not download"):
        library.check("face_yolov8n.pt")
    (library.folder / "person_tiny.pt").write_bytes(b"not read")
    assert library.path_for("person_tiny.pt").name == "person_tiny.onnx"
    (library.folder / "face_x.safetensors").write_bytes(b"")
    with pytest.raises(DetectorError, match="no detector architecture"):
        library.check("face_x.safetensors")
    with pytest.raises(DetectorError, match="not a path"):
        library.check("../face_seg.onnx")


def test_adetailer_routes(library):
    """`/adetailer/v1/version` and `/ad_model` answer as ADetailer's routes do, the folder read afresh."""
    from app.a1111.adetailer import adetailer_router

    state = SimpleNamespace(ctx=SimpleNamespace(settings=SimpleNamespace(adetailer_dir=library.folder)))
    app = FastAPI()
    app.include_router(adetailer_router(state))
    client = TestClient(app)
    assert client.get("/adetailer/v1/version").json() == {"version": "25.3.0"}
    listed = client.get("/adetailer/v1/ad_model").json()["ad_model"]
    assert listed[0] == BUILTIN_FACE and listed == library.names()
