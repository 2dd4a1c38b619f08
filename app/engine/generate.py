"""One generation: scheduler choice, per-image seeds, denoising, our own VAE decode, PNG infotext.

Seeds use CPU generators, one per image, so the same seed gives the same image whatever the
offload mode, device placement or batch position. The VAE decode is done here rather than by
the diffusers pipeline because the SDXL pipeline upcasts the VAE by *replacing its dtype* in
the middle of a call; our placement plan already keeps that VAE in fp32, so decoding in the
VAE's own dtype is both correct and mutation-free.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)

SCHEDULERS: dict[str, tuple[type, dict]] = {
    "Euler": (EulerDiscreteScheduler, {}),
    "Euler a": (EulerAncestralDiscreteScheduler, {}),
    "DPM++ 2M": (DPMSolverMultistepScheduler, {"use_karras_sigmas": False}),
    "DPM++ 2M Karras": (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "DDIM": (DDIMScheduler, {}),
    "UniPC": (UniPCMultistepScheduler, {}),
}
MAX_SEED = 2**32 - 1
# Per-request bounds, so one request from a share link cannot hold the worker or the memory for
# long. CLIP reads 75 tokens per chunk and A1111 users rarely go past a few chunks; 16,000
# characters is about 4,000 tokens (the tokenizer averages ~4 characters per token). 10^9
# pixel-steps (batch x width x height x steps: 4 x 1024² x 238, or 16 x 512² x 238) is two to three
# minutes on an H100; the per-field limits alone allowed 16 x 2048² x 150, ten times that.
MAX_PROMPT_CHARS = 16_000
MAX_PIXEL_STEPS = 1_000_000_000


@dataclass(frozen=True)
class GenerateParams:
    prompt: str
    negative_prompt: str = ""
    steps: int = 20
    cfg: float = 7.0
    seed: int = -1
    width: int = 512
    height: int = 512
    batch: int = 1  # images per denoising run (A1111 "batch size")
    sampler: str = "Euler a"
    n_iter: int = 1  # runs one after another, seeds continuing (A1111 "batch count"); Skip ends one

    def __post_init__(self) -> None:
        for label, text in (("prompt", self.prompt), ("negative prompt", self.negative_prompt)):
            if len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"the {label} is {len(text):,} characters long; the limit is "
                                 f"{MAX_PROMPT_CHARS:,} characters (about 4,000 tokens)")
        if self.sampler not in SCHEDULERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose one of {sorted(SCHEDULERS)}")
        if not 1 <= self.steps <= 150:
            raise ValueError(f"steps must be 1..150, got {self.steps}")
        if not 1 <= self.batch <= 16:
            raise ValueError(f"batch must be 1..16, got {self.batch}")
        if not 1 <= self.n_iter <= 100:
            raise ValueError(f"batch count must be 1..100, got {self.n_iter}")
        for side in (self.width, self.height):
            if side % 8 or not 64 <= side <= 2048:
                raise ValueError(f"width and height must be multiples of 8 in 64..2048, got {side}")
        if not -1 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be -1 (random) or 0..{MAX_SEED}, got {self.seed}")
        work = self.batch * self.width * self.height * self.steps
        if work > MAX_PIXEL_STEPS:
            raise ValueError(f"batch x width x height x steps = {self.batch} x {self.width} x {self.height} x "
                             f"{self.steps} = {work:,} is over the per-request cap of {MAX_PIXEL_STEPS:,}; "
                             "use fewer images, steps or pixels")


class NonFiniteLatentsError(RuntimeError):
    """The latents held NaN or Inf after denoising step `step` (1-based) of `total`."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(f"the latents became NaN or Inf at step {step} of {total}: the model or a LoRA "
                         "produced values out of range, and the image would come out black")
        self.step = step
        self.total = total


class _FiniteWatch:
    """Checks the latents after every step, one step behind: step k's flag is computed on the
    device and read at step k+1, when step k+1's work is already queued behind it, so the check
    never leaves a GPU idle waiting for the CPU. `settle()` reads the last flag."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._pending: tuple[int, torch.Tensor] | None = None

    def observe(self, step: int, latents: torch.Tensor) -> None:
        flag = torch.isfinite(latents).all()
        self.settle()
        self._pending = (step, flag)

    def settle(self) -> None:
        if self._pending is not None:
            step, flag = self._pending
            self._pending = None
            if not bool(flag):
                raise NonFiniteLatentsError(step, self.total)


@dataclass(frozen=True)
class GeneratedImage:
    image: Image.Image
    seed: int
    infotext: str
    path: Path | None = None
    stopped_at: int | None = None  # the step an Interrupt or Skip stopped the denoising at (None: ran all)

    @property
    def complete(self) -> bool:
        return self.stopped_at is None


@dataclass(frozen=True)
class RunContext:
    """What the engine knows about the model and adapters a generation runs with."""

    model_name: str
    model_hash: str
    loras: tuple[tuple[str, float, str], ...] = ()  # (name, weight, short hash)


def resolve_seed(seed: int) -> int:
    return random.randint(0, MAX_SEED) if seed == -1 else seed


def infotext(params: GenerateParams, seed: int, ctx: RunContext) -> str:
    """A1111-style `parameters` text, so other tools can read our PNGs back."""
    parts = [
        f"Steps: {params.steps}",
        f"Sampler: {params.sampler}",
        f"CFG scale: {params.cfg:g}",
        f"Seed: {seed}",
        f"Size: {params.width}x{params.height}",
        f"Model hash: {ctx.model_hash}",
        f"Model: {ctx.model_name}",
    ]
    if ctx.loras:
        parts.append('Lora hashes: "' + ", ".join(f"{n}: {h}" for n, _w, h in ctx.loras) + '"')
        parts.append('Lora weights: "' + ", ".join(f"{n}: {w:g}" for n, w, _h in ctx.loras) + '"')
    parts.append("Version: steady-diffusion")
    lines = [params.prompt]
    if params.negative_prompt:
        lines.append(f"Negative prompt: {params.negative_prompt}")
    lines.append(", ".join(parts))
    return "\n".join(lines)


def _scheduler_for(pipe, sampler: str):
    cls, overrides = SCHEDULERS[sampler]
    return cls.from_config(pipe.scheduler.config, **overrides)


def _decode(pipe, latents: torch.Tensor) -> list[Image.Image]:
    vae = pipe.vae
    # The execution device and the VAE's compute dtype, not its resting ones: under offload the
    # VAE rests on the CPU (maybe in a wider dtype) until its hooks bring it over. fp32 when it
    # must upcast.
    dtype = pipe.compute_dtypes.get("vae") or next(vae.parameters()).dtype
    latents = latents.to(device=pipe._execution_device, dtype=dtype)
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


StepCallback = Callable[[int, int, torch.Tensor], bool]


def run(pipe, params: GenerateParams, seed: int, on_step: StepCallback | None = None) -> list[Image.Image]:
    """Denoise and decode `params.batch` images; image i uses seed `seed + i`.

    `on_step(step, total, latents)` runs after each step; when it returns True the remaining steps
    are skipped (diffusers' own interrupt flag) and the latents reached so far are decoded: an
    Interrupt or Skip lands between two steps, never inside a forward. Raises
    `NonFiniteLatentsError` naming the step when the latents stop being finite.
    """
    pipe.scheduler = _scheduler_for(pipe, params.sampler)
    generators = [torch.Generator("cpu").manual_seed((seed + i) % (MAX_SEED + 1)) for i in range(params.batch)]
    watch = _FiniteWatch(params.steps)

    def step_end(_pipe, step, _timestep, kwargs):
        watch.observe(step + 1, kwargs["latents"])
        if on_step is not None and on_step(step + 1, params.steps, kwargs["latents"]):
            _pipe._interrupt = True
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
    watch.settle()
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
