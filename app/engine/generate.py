"""One generation: scheduler choice, per-image seeds, denoising, our own VAE decode, PNG infotext.

Seeds use CPU generators, one per image, so the same seed gives the same image whatever the
offload mode, device placement or batch position. The VAE decode is done here rather than by
the diffusers pipeline because the SDXL pipeline upcasts the VAE by *replacing its dtype* in
the middle of a call; our placement plan already keeps that VAE in fp32, so decoding in the
VAE's own dtype is both correct and mutation-free.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    UniPCMultistepScheduler,
)
from PIL import Image, PngImagePlugin

from app.infotext import LoraUse, format_infotext

log = logging.getLogger(__name__)

SCHEDULERS: dict[str, tuple[type, dict]] = {
    "Euler": (EulerDiscreteScheduler, {}),
    "Euler a": (EulerAncestralDiscreteScheduler, {}),
    "DPM++ 2M": (DPMSolverMultistepScheduler, {"use_karras_sigmas": False}),
    "DPM++ 2M Karras": (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "DDIM": (DDIMScheduler, {}),
    "UniPC": (UniPCMultistepScheduler, {}),
}
def _number(value: float) -> str:
    """Whole numbers in full (a seed range reads 4294967295, not 4.29497e+09), others as typed."""
    return str(int(value)) if value == int(value) else f"{value:g}"


@dataclass(frozen=True)
class Range:
    """A closed range one generation setting must lie in: the one rule set the UI, the API and
    `GenerateParams` share. A value outside it, a fraction where a whole number is due, or a
    non-finite number is refused with the range in the message; nothing is clamped or rounded
    behind the user's back."""

    low: float
    high: float
    whole: bool = True
    hint: str = ""

    def __str__(self) -> str:
        span = f"{_number(self.low)}…{_number(self.high)}"
        return f"{span} ({self.hint})" if self.hint else span

    def check(self, field: str, value: object) -> int | float:
        """`value` as an int (whole ranges) or float; ValueError naming the field and the range."""
        kind = "a whole number" if self.whole else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{field} must be {kind} in {self}, got {value!r}")
        if self.whole and value != int(value):
            raise ValueError(f"{field} must be {kind} in {self}, got {value!r}")
        if not self.low <= value <= self.high:
            raise ValueError(f"{field} must be {kind} in {self}, got {_number(value)}")
        return int(value) if self.whole else float(value)


MAX_SEED = 2**32 - 1
LIMITS: dict[str, Range] = {
    "steps": Range(1, 150),
    "cfg": Range(1, 30, whole=False),
    "seed": Range(-1, MAX_SEED, hint="-1 = random"),
    "width": Range(64, 2048),
    "height": Range(64, 2048),
    "batch": Range(1, 16),
}
# Latent pixels per image pixel side: sizes must be multiples of it (the VAE downsamples by 8 in
# both SD1.5 and SDXL). A family with another factor adds its entry here.
SIZE_MULTIPLE: dict[str, int] = {"sd15": 8, "sdxl": 8}
DEFAULT_SIZE_MULTIPLE = 8
_FAMILY_NAMES = {"sd15": "SD1.5", "sdxl": "SDXL"}


@dataclass(frozen=True)
class GenerateParams:
    prompt: str
    negative_prompt: str = ""
    steps: int = 20
    cfg: float = 7.0
    seed: int = -1
    width: int = 512
    height: int = 512
    batch: int = 1
    sampler: str = "Euler a"

    def __post_init__(self) -> None:
        if self.sampler not in SCHEDULERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose one of {sorted(SCHEDULERS)}")
        for field, rule in LIMITS.items():
            rule.check(field, getattr(self, field))
        for side in (self.width, self.height):
            if side % DEFAULT_SIZE_MULTIPLE:
                raise ValueError(f"width and height must be multiples of {DEFAULT_SIZE_MULTIPLE}, got {side}")


def round_size(field: str, value: int, arch: str | None) -> tuple[int, str]:
    """Round a side down to the family's multiple, as A1111 does (its latents are `side // 8`), and
    say so: (rounded, note), the note empty when nothing changed."""
    multiple = SIZE_MULTIPLE.get(arch or "", DEFAULT_SIZE_MULTIPLE)
    rounded = value - value % multiple
    if rounded == value:
        return value, ""
    family = _FAMILY_NAMES.get(arch or "", "this model")
    return rounded, (f"{field} {value} → {rounded}: {family} sizes are multiples of {multiple} "
                     "(rounded down, as A1111 does)")


def params_from_form(values: dict[str, object], arch: str | None) -> tuple[GenerateParams, tuple[str, ...]]:
    """Raw form or API values -> (parameters, notes about what was rounded).

    Every field is checked against `LIMITS` first and all refusals are reported in one message;
    then width and height are rounded to the family's multiple, each with a note to show."""
    problems, checked = [], {}
    for field, rule in LIMITS.items():
        try:
            checked[field] = rule.check(field, values.get(field))
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(";\n".join(problems))
    notes = []
    for field in ("width", "height"):
        checked[field], note = round_size(field, checked[field], arch)
        notes.append(note)
    params = GenerateParams(str(values.get("prompt") or ""), str(values.get("negative_prompt") or ""),
                            sampler=str(values.get("sampler")), **checked)
    return params, tuple(n for n in notes if n)


@dataclass(frozen=True)
class GeneratedImage:
    image: Image.Image
    seed: int
    infotext: str
    path: Path | None = None


@dataclass(frozen=True)
class RunContext:
    """What the engine knows about the model and adapters a generation runs with. `loras` holds
    `LoraUse(name, unet, short_hash, te)` entries (plain tuples in that order work too)."""

    model_name: str
    model_hash: str
    loras: tuple[tuple, ...] = ()


def resolve_seed(seed: int) -> int:
    return random.randint(0, MAX_SEED) if seed == -1 else seed


def infotext(params: GenerateParams, seed: int, ctx: RunContext) -> str:
    """A1111-style `parameters` text (see `app.infotext`), so other tools and our PNG Info read it back."""
    settings = [("Steps", params.steps), ("Sampler", params.sampler), ("CFG scale", f"{params.cfg:g}"),
                ("Seed", seed), ("Size", f"{params.width}x{params.height}"), ("Model hash", ctx.model_hash),
                ("Model", ctx.model_name)]
    loras = tuple(LoraUse(*entry) for entry in ctx.loras)
    return format_infotext(params.prompt, params.negative_prompt, settings, loras)


def _scheduler_for(pipe, sampler: str):
    cls, overrides = SCHEDULERS[sampler]
    return cls.from_config(pipe.scheduler.config, **overrides)


def _decode(pipe, latents: torch.Tensor) -> list[Image.Image]:
    vae = pipe.vae
    # The execution device, not the VAE's current one: under offload the VAE rests on the CPU
    # until its hooks bring it over. The dtype is the VAE's own (fp32 when it must upcast).
    latents = latents.to(device=pipe._execution_device, dtype=next(vae.parameters()).dtype)
    config = vae.config
    mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
    if mean is not None and std is not None:
        mean_t = torch.tensor(mean, device=latents.device, dtype=latents.dtype).view(1, -1, 1, 1)
        std_t = torch.tensor(std, device=latents.device, dtype=latents.dtype).view(1, -1, 1, 1)
        latents = latents * std_t / config.scaling_factor + mean_t
    else:
        latents = latents / config.scaling_factor
    with torch.no_grad():
        decoded = vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(decoded.float(), output_type="pil")


def run(pipe, params: GenerateParams, seed: int, on_step: Callable[[int, int], None] | None = None,
        on_latents: Callable[[int, torch.Tensor], None] | None = None, latents_every: int = 0) -> list[Image.Image]:
    """Denoise and decode `params.batch` images; image i uses seed `seed + i`.

    `on_step(step, total)` follows every step; `on_latents(step, latents)` gets the latents being
    denoised every `latents_every` steps (not after the last: the decoded image follows), for a live
    preview (`app.preview.latent_preview`). Callbacks must only read the latents."""
    pipe.scheduler = _scheduler_for(pipe, params.sampler)
    generators = [torch.Generator("cpu").manual_seed((seed + i) % (MAX_SEED + 1)) for i in range(params.batch)]

    def step_end(_pipe, step, _timestep, kwargs):
        done = step + 1
        if on_step is not None:
            on_step(done, params.steps)
        if on_latents is not None and latents_every > 0 and done % latents_every == 0 and done < params.steps:
            on_latents(done, kwargs["latents"])
        return kwargs

    # no_grad, not inference_mode: offload hooks move weights during the call, and inference-mode
    # tensors could not be patched in place afterwards.
    with torch.no_grad():
        latents = pipe(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt or None,
            num_inference_steps=params.steps,
            guidance_scale=params.cfg,
            width=params.width,
            height=params.height,
            num_images_per_prompt=params.batch,
            generator=generators,
            output_type="latent",
            callback_on_step_end=step_end,
        ).images
    return _decode(pipe, latents)


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def save_png(image: Image.Image, text: str, outputs_dir: Path, seed: int) -> Path:
    """Write `outputs/<date>/<nnnnn>-<seed>.png` with the infotext in the `parameters` chunk."""
    folder = outputs_dir / datetime.now().strftime("%Y-%m-%d")
    folder.mkdir(parents=True, exist_ok=True)
    index = len(list(folder.glob("*.png")))
    path = folder / _UNSAFE.sub("_", f"{index:05d}-{seed}.png")
    while path.exists():
        index += 1
        path = folder / f"{index:05d}-{seed}.png"
    meta = PngImagePlugin.PngInfo()
    meta.add_text("parameters", text)
    image.save(path, pnginfo=meta)
    return path
