"""A ControlNet unit: what one control image asks of a generation, as the A1111 extension names it.

Why one frozen value: the UI, the A1111 API (`alwayson_scripts.controlnet.args`), the infotext and
Send-to all speak of the same few settings; each reads or writes this record, and the engine takes a
tuple of them on `GenerateParams`, so a unit checked once is the unit that runs. Names and choices
follow sd-webui-controlnet (module, model, weight, guidance start/end, control mode, resize mode,
pixel perfect, processor resolution, thresholds), because clients send them by those names.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

MAX_UNITS = 3
CONTROL_MODES = ("Balanced", "My prompt is more important", "ControlNet is more important")
RESIZE_MODES = ("Just Resize", "Crop and Resize", "Resize and Fill")
NO_MODEL = "None"
# Which passes of a txt2img with hires fix a unit controls (the extension's `hr_option`)
HR_OPTIONS = ("Both", "Low res only", "High res only")


@dataclass(frozen=True)
class ControlUnit:
    """One enabled ControlNet unit. `image` is the user's picture (None: the img2img init image is
    the control image, as the extension does); `module` the preprocessor that turns it into the
    control map ("none": the picture is the map); `model` a ControlNet's name in `models/ControlNet/`."""

    model: str
    image: Image.Image | None = None
    module: str = "none"
    weight: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0
    control_mode: str = CONTROL_MODES[0]
    resize_mode: str = RESIZE_MODES[1]
    pixel_perfect: bool = False
    hr_option: str = HR_OPTIONS[0]  # with hires fix: the passes the unit controls
    processor_res: int = 512
    threshold_a: float = -1.0  # -1: the preprocessor's own default
    threshold_b: float = -1.0

    def __post_init__(self) -> None:
        if not self.model or self.model == NO_MODEL:
            raise ValueError("a ControlNet unit needs a model: choose one from models/ControlNet/")
        if not 0.0 <= self.weight <= 2.0:
            raise ValueError(f"ControlNet weight must be in 0…2, got {self.weight!r}")
        if not 0.0 <= self.guidance_start < self.guidance_end <= 1.0:
            raise ValueError("ControlNet guidance start and end must satisfy 0 ≤ start < end ≤ 1, got "
                             f"{self.guidance_start!r} and {self.guidance_end!r}")
        if self.control_mode not in CONTROL_MODES:
            raise ValueError(f"unknown ControlNet control mode {self.control_mode!r}; choose one of {CONTROL_MODES}")
        if self.resize_mode not in RESIZE_MODES:
            raise ValueError(f"unknown ControlNet resize mode {self.resize_mode!r}; choose one of {RESIZE_MODES}")
        if self.hr_option not in HR_OPTIONS:
            raise ValueError(f"unknown ControlNet hires option {self.hr_option!r}; choose one of {HR_OPTIONS}")
        if not 64 <= self.processor_res <= 2048:
            raise ValueError(f"ControlNet processor resolution must be in 64…2048, got {self.processor_res!r}")


def check_units(units: tuple[ControlUnit, ...]) -> tuple[ControlUnit, ...]:
    """The units of one generation, at most `MAX_UNITS` (the extension's default count)."""
    if len(units) > MAX_UNITS:
        raise ValueError(f"at most {MAX_UNITS} ControlNet units run at once, got {len(units)}")
    return units
