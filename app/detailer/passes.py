"""ADetailer units (`units.DetailUnit`) as the engine's detail passes (`app.engine.detailing.DetailPass`).

Why a module between them: the unit is what the UI, the API and the infotext say (ADetailer's names and
`use_*` switches); the engine's pass is what it runs (a `find` turning a picture into region masks, and
the inpaint settings, 0/None where the main generation's apply). Here the detector is looked up and
checked before anything is queued, so a missing, pickled or wrong-task detector is one clear error
instead of a failed job, and the unit's sampler is matched to the loaded family's names.
"""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image

from app.detailer import detect, masks
from app.detailer.units import SAME_SCHEDULER, DetailUnit, infotext_settings
from app.engine.detailing import DetailParams, DetailPass
from app.engine.generate import SCHEDULERS

_UNSUPPORTED = (("use_noise_multiplier", "ad_use_noise_multiplier: a separate noise multiplier is not supported"),)


def detail_params(units: Sequence[DetailUnit], library: detect.DetectorLibrary, skip_img2img: bool = False
                  ) -> DetailParams:
    """The engine's detail passes for `units`, in order, with the infotext pairs ADetailer writes; every
    detector checked now (`DetectorError` names the file and what to do)."""
    for unit in units:
        library.check(unit.model)
        for field, why in _UNSUPPORTED:
            if getattr(unit, field):
                raise ValueError(why)
    return DetailParams(tuple(_pass(unit, library) for unit in units), tuple(infotext_settings(tuple(units))),
                        skip_img2img)


def _pass(unit: DetailUnit, library: detect.DetectorLibrary) -> DetailPass:
    own = unit.use_inpaint_width_height
    return DetailPass(unit.model, lambda image: _regions(image, unit, library), prompt=unit.prompt,
                      negative_prompt=unit.negative_prompt, denoising_strength=unit.denoising_strength,
                      mask_blur=unit.mask_blur, only_masked=unit.inpaint_only_masked,
                      padding=unit.inpaint_only_masked_padding, width=unit.inpaint_width if own else 0,
                      height=unit.inpaint_height if own else 0, steps=unit.steps if unit.use_steps else 0,
                      cfg=unit.cfg_scale if unit.use_cfg_scale else None,
                      sampler=sampler_of(unit) if unit.use_sampler else "",
                      clip_skip=unit.clip_skip if unit.use_clip_skip else 0)


def _regions(image: Image.Image, unit: DetailUnit, library: detect.DetectorLibrary) -> tuple[list, str]:
    """Detect, then ADetailer's mask rules: (masks in order, the note when none is left)."""
    found = library.detect(image, unit.model, unit.confidence)
    result = masks.build_masks(found, image.size, unit)
    if result.outcome == masks.COVERS_EVERYTHING:  # the whole picture: img2img, not a detail pass
        return [], result.note
    return list(result.masks), result.note


def sampler_of(unit: DetailUnit) -> str:
    """The engine's sampler for ADetailer's sampler and scheduler ("DPM++ 2M" + "Karras" is ours
    "DPM++ 2M Karras"); refused by name where no family here has it."""
    name = unit.sampler
    if unit.scheduler not in (SAME_SCHEDULER, "Automatic") and not name.endswith(unit.scheduler):
        name = f"{name} {unit.scheduler}"
    if name not in SCHEDULERS:
        raise ValueError(f"ad_sampler {name!r} is not a sampler here; choose one of {', '.join(SCHEDULERS)}")
    return name
