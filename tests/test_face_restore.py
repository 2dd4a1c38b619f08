"""Face restoration (A1111's `restore_faces`): the built-in face detector finds each face, the model restores it,
and it is pasted back through a feathered mask, on a real photograph (scikit-image's astronaut).

The model is `face_models.write_tiny_restorer`'s RestoreFormer (spandrel builds GFPGAN only at ~340 MB); it runs
on the engine's worker as the `face restorer` component of its own slot, verified before and after.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from face_models import write_tiny_restorer
from PIL import Image

from app.engine.snapshot import EngineState
from app.engine.upscaler_slot import FACE_COMPONENT
from app.settings import Settings
from app.upscalers import faces
from app.upscalers.arch import UpscalerFormatError
from app.upscalers.face_paste import face_square
from app.upscalers.files import UpscalerFileError

skdata = pytest.importorskip("skimage.data")
ASTRONAUT_FACE = (180, 75, 275, 178)  # det-find's hand-drawn box of the face (tests/test_detailer_detect.py)


@pytest.fixture(scope="module")
def face_engine(tmp_path_factory):
    from app.engine.worker import Engine

    data = tmp_path_factory.mktemp("faces")
    write_tiny_restorer(data / "models" / "GFPGAN" / "tiny-face.safetensors")
    eng = Engine(Settings(data_dir=data, device="cpu"))
    yield eng
    eng.close()


def _restore(engine, image: Image.Image, visibility: float = 1.0):
    """`Engine._restore_faces` on the worker, as a transition (placement verified before and after)."""
    return engine.submit("restore faces", "test", EngineState.GENERATING,
                         lambda: engine._restore_faces(image, visibility)).result()


@pytest.fixture(scope="module")
def astronaut() -> Image.Image:
    return Image.fromarray(skdata.astronaut())


def test_restore_faces_changes_the_face_square_only(face_engine, astronaut):
    """On the astronaut photograph: pixels change around the face (the detected box), every pixel outside the
    face's square is the input's bit for bit, the model ran as the placed and verified `face restorer`
    component, and the kind is A1111's infotext name for a model in models/GFPGAN."""
    restored, kind = _restore(face_engine, astronaut)
    assert kind == "GFPGAN" and restored.size == astronaut.size
    before, after = np.asarray(astronaut), np.asarray(restored)
    changed = np.any(before != after, axis=2)
    x0, y0, x1, y1 = face_square(ASTRONAUT_FACE, *astronaut.size)
    outside = changed.copy()
    outside[y0 - 8:y1 + 8, x0 - 8:x1 + 8] = False  # the detector's box differs from the hand-drawn one by a few px
    assert not outside.any()
    fx0, fy0, fx1, fy1 = ASTRONAUT_FACE
    assert changed[fy0:fy1, fx0:fx1].mean() > 0.9  # the face itself is redrawn
    plan = face_engine._face_restorer.plan
    assert plan is not None and set(plan.components) == {FACE_COMPONENT}
    assert face_engine.snapshot().violations == ()


def test_visibility_zero_gives_the_input_bit_for_bit(face_engine, astronaut):
    """Visibility blends the restored face in: 0 is the input unchanged, 0.5 lies between input and full."""
    none, _ = _restore(face_engine, astronaut, 0.0)
    assert np.array_equal(np.asarray(none), np.asarray(astronaut))
    half, full = (np.asarray(_restore(face_engine, astronaut, v)[0]).astype(int) for v in (0.5, 1.0))
    x0, y0, x1, y1 = ASTRONAUT_FACE
    face = np.asarray(astronaut).astype(int)[y0:y1, x0:x1]
    assert 0 < np.abs(half[y0:y1, x0:x1] - face).mean() < np.abs(full[y0:y1, x0:x1] - face).mean()


def test_without_a_model_it_is_refused_naming_the_folders(tmp_path):
    """A1111 would download a model; this app refuses, naming where to put one."""
    (tmp_path / "models" / "GFPGAN").mkdir(parents=True)
    with pytest.raises(faces.FaceModelError, match=r"models/GFPGAN or models/Codeformer"):
        faces.first_model(tmp_path / "models")


class _Planted:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickled_pth_that_would_run_code_is_refused_unrun(tmp_path, astronaut):
    """A `.pth` whose pickle would open a file: refused with the reason, and the file never appears."""
    from app.engine.worker import Engine

    marker = tmp_path / "ran.txt"
    folder = tmp_path / "models" / "Codeformer"
    folder.mkdir(parents=True)
    with open(folder / "evil.pth", "wb") as f:
        pickle.dump({"params_ema": {"w": _Planted(marker)}}, f, protocol=2)
    eng = Engine(Settings(data_dir=tmp_path, device="cpu"))
    try:
        with pytest.raises(UpscalerFileError, match="refused"):
            _restore(eng, astronaut)
    finally:
        eng.close()
    assert not marker.exists()


def test_a_codeformer_file_is_refused_with_the_licence_reason():
    """spandrel's core lacks CodeFormer; its extra package is non-commercial and not a dependency: say so."""
    tensors = {"position_emb": torch.zeros(256, 512), "idx_pred_layer.0.weight": torch.zeros(512, 512)}
    with pytest.raises(UpscalerFormatError, match="spandrel_extra_arches"):
        faces.describe(tensors, "codeformer-v0.1.0")


def test_extras_restores_faces_after_the_upscale_at_each_visibility(face_engine, astronaut):
    """Extras' `gfpgan_visibility` runs the models/GFPGAN file on the upscaled picture (A1111's order) and writes
    A1111's text; visibility 0 restores nothing (the picture as sent); `codeformer_visibility` with no file in
    models/Codeformer is refused naming that folder before anything runs."""
    from app.upscalers.extras import ExtrasParams

    small = astronaut.resize((256, 256), Image.Resampling.LANCZOS)
    upscaled = face_engine.extras([small], ExtrasParams(upscaler="Lanczos", factor=2.0))[0].image
    [done] = face_engine.extras([small], ExtrasParams(upscaler="Lanczos", factor=2.0, gfpgan_visibility=0.8))
    assert done.infotext == "Postprocess upscale by: 2, Postprocess upscaler: Lanczos, GFPGAN visibility: 0.8"
    changed = np.any(np.asarray(done.image) != np.asarray(upscaled), axis=2)
    x0, y0, x1, y1 = ASTRONAUT_FACE
    assert changed[y0:y1, x0:x1].mean() > 0.9 and not changed[:, 400:].any()
    [same] = face_engine.extras([small], ExtrasParams(gfpgan_visibility=0.0))
    assert np.array_equal(np.asarray(same.image), np.asarray(small)) and same.infotext == ""
    with pytest.raises(faces.FaceModelError, match="models/Codeformer under"):
        face_engine.extras([small], ExtrasParams(codeformer_visibility=0.5, codeformer_weight=0.5))


def test_unload_upscaler_drops_the_face_restorer_too(face_engine, astronaut):
    """`Engine.unload_upscaler` gives the face model's memory back as it does the upscaler's."""
    _restore(face_engine, astronaut, 0.5)
    assert face_engine._face_restorer.plan is not None
    face_engine.unload_upscaler()
    assert face_engine._face_restorer.plan is None
