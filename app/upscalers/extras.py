"""The Extras tab's upscale settings, as A1111's "Upscale" postprocessing takes and records them.

A1111 names: upscale *by* a factor (`upscaling_resize`, resize mode 0) or *to* a size
(`upscaling_resize_w/h`, mode 1, the factor being the larger of the two ratios, then centred and
cropped to the size with `upscaling_crop`); `upscaler_1`, and `upscaler_2` blended over it with
`extras_upscaler_2_visibility`. "None" as the first upscaler leaves the image as it is. What an image
went through is written as A1111 writes it: `Postprocess upscale by: 2, Postprocess upscaler: X,
Postprocess upscaler 2: Y` (`infotext`), kept in the PNG's `postprocessing` and `extras` chunks.
Face restoration runs after the upscale, as A1111 orders its postprocessing: the model in `models/GFPGAN`
at `gfpgan_visibility`, then the one in `models/Codeformer` at `codeformer_visibility`
(`app/upscalers/faces.py`). `codeformer_weight` is CodeFormer's own fidelity input; spandrel's core builds no
CodeFormer, so it is checked and written to the text as A1111 writes it, and reaches no model here.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from app.engine.generate import Range
from app.infotext import quote

NONE = "None"
RESIZE_MODES = ("Scale by", "Scale to")  # A1111's resize_mode 0 and 1
MAX_OUTPUT_PIXELS = 8192 * 8192  # the result is assembled in float32 RAM: 8192² x 3 x 4 bytes = 768 MiB
EXTRAS_LIMITS: dict[str, Range] = {
    "upscaling_resize": Range(1, 8, whole=False),
    "upscaling_resize_w": Range(64, 8192),
    "upscaling_resize_h": Range(64, 8192),
    "extras_upscaler_2_visibility": Range(0, 1, whole=False),
    "gfpgan_visibility": Range(0, 1, whole=False),
    "codeformer_visibility": Range(0, 1, whole=False),
    "codeformer_weight": Range(0, 1, whole=False),
}
FACE_PASSES = (("gfpgan_visibility", "GFPGAN"), ("codeformer_visibility", "Codeformer"))  # field, models/ folder


@dataclass(frozen=True)
class ExtrasParams:
    """One Extras request; every number checked by `EXTRAS_LIMITS`, as the API and the tab show them."""

    upscaler: str = NONE
    resize_mode: str | int = RESIZE_MODES[0]
    factor: float = 2.0
    width: int = 512
    height: int = 512
    crop: bool = True
    upscaler_2: str = NONE
    visibility_2: float = 0.0
    gfpgan_visibility: float = 0.0
    codeformer_visibility: float = 0.0
    codeformer_weight: float = 0.0

    def __post_init__(self) -> None:
        mode = self.resize_mode
        if isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode < len(RESIZE_MODES):
            object.__setattr__(self, "resize_mode", RESIZE_MODES[mode])
        elif mode not in RESIZE_MODES:
            raise ValueError(f"resize mode must be one of {', '.join(RESIZE_MODES)} (or 0, 1), got {mode!r}")
        for field, value in (("upscaling_resize", self.factor), ("upscaling_resize_w", self.width),
                             ("upscaling_resize_h", self.height), ("extras_upscaler_2_visibility", self.visibility_2),
                             *((field, getattr(self, field)) for field in
                               ("gfpgan_visibility", "codeformer_visibility", "codeformer_weight"))):
            EXTRAS_LIMITS[field].check(field, value)
        for field in ("upscaler", "upscaler_2"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"{field} must be an upscaler name (or {NONE!r})")

    @property
    def to_size(self) -> bool:
        return self.resize_mode == RESIZE_MODES[1]

    @property
    def blends(self) -> bool:
        """Whether the second upscaler takes part (A1111: named and visible)."""
        return self.upscaler_2 != NONE and self.visibility_2 > 0

    def factor_for(self, size: tuple[int, int]) -> float:
        """The factor an image of `size` is upscaled by (scale to: the larger ratio, so it covers the size)."""
        factor = max(self.width / size[0], self.height / size[1]) if self.to_size else self.factor
        result = int(size[0] * factor) * int(size[1] * factor)
        if result > MAX_OUTPUT_PIXELS:
            raise ValueError(f"upscaling {size[0]}x{size[1]} by {factor:g} makes {result:,} pixels, over the cap of "
                             f"{MAX_OUTPUT_PIXELS:,} (8192²); use a smaller factor or size")
        return factor

    def finish(self, image: Image.Image) -> Image.Image:
        """Scale to with crop: the upscaled image centred on a canvas of exactly the asked size."""
        if not (self.to_size and self.crop):
            return image
        canvas = Image.new("RGB", (self.width, self.height))
        canvas.paste(image, (self.width // 2 - image.width // 2, self.height // 2 - image.height // 2))
        return canvas

    def face_passes(self) -> list[tuple[str, float]]:
        """(models/ folder, visibility) of each face restoration asked for, in A1111's order."""
        return [(folder, getattr(self, field)) for field, folder in FACE_PASSES if getattr(self, field) > 0]

    def infotext(self) -> str:
        """A1111's postprocessing text for this request, in its order ("" when nothing was done)."""
        pairs = self._upscale_pairs() if self.upscaler != NONE else []
        if self.gfpgan_visibility > 0:
            pairs.append(("GFPGAN visibility", round(self.gfpgan_visibility, 3)))
        if self.codeformer_visibility > 0:
            pairs += [("CodeFormer visibility", round(self.codeformer_visibility, 3)),
                      ("CodeFormer weight", round(self.codeformer_weight, 3))]
        return ", ".join(f"{key}: {quote(value)}" for key, value in pairs)

    def _upscale_pairs(self) -> list[tuple[str, object]]:
        pairs: list[tuple[str, object]] = []
        if self.to_size:
            pairs.append(("Postprocess upscale to", f"{self.width}x{self.height}"))
            if self.crop:
                pairs.append(("Postprocess crop to", f"{self.width}x{self.height}"))
        else:
            pairs.append(("Postprocess upscale by", f"{self.factor:g}"))
        pairs.append(("Postprocess upscaler", self.upscaler))
        if self.blends:
            pairs.append(("Postprocess upscaler 2", self.upscaler_2))
        return pairs
