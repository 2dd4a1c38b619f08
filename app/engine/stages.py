"""The model-side work of each workflow stage: stage pipelines, VAE encode, upscale, the carry.

Why: multi-stage workflows are where the SD.Next reports saw devices and dtypes drift — every
stage built another pipeline, moved the VAE, re-encoded latents. Here:

* a stage pipeline (img2img, inpaint) is built on the loaded pipeline's own component objects,
  `from_pipe`-style but without diffusers' `from_pipe`, whose closing `.to(dtype)` would cast every
  shared weight (to fp32 by default). No weight is copied: LoRAs patched into the model, offload
  hooks and the placement plan apply to every stage as they are;
* we encode images ourselves, on the execution device in the VAE's compute dtype, and hand the
  pipelines latents, so diffusers' own encode path (which casts the SDXL VAE in place) never runs;
* what one stage hands to the next (latents, the latent mask, masked-image latents) lives in the
  `Carry`, whose placement the plan states (`carry_placement`) and which the engine verifies and
  repairs with the model's tensors before and after every stage.
"""

from __future__ import annotations

import logging

import torch

from app.engine import generate, image_ops, placement
from app.engine.controlnet_slot import CONTROL_STAGE
from app.engine.generate import GenerateParams, StepCallback
from app.engine.stage_params import LATENT_UPSCALERS, PIXEL_UPSCALERS, HiresParams, InitImages
from app.families import family_of

log = logging.getLogger(__name__)


def carry_placement(plan: placement.PlacementPlan) -> placement.Placement:
    """Where carried tensors live between stages: on the execution device (the next stage feeds them
    to the UNet there) in float32 (sampler state; rounding it to a 16-bit dtype between two passes
    would lose what the first pass computed)."""
    return placement.Placement(plan.device, torch.float32)


class Carry:
    """Named tensors handed from one stage to the next; verified against `carry_placement`."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def put(self, plan: placement.PlacementPlan, **tensors: torch.Tensor) -> None:
        want = carry_placement(plan)
        for name, tensor in tensors.items():
            self._tensors[name] = tensor.detach().to(device=want.device, dtype=want.dtype)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise RuntimeError(f"stage input {name!r} is missing: the stage before did not produce it") from None

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def clear(self) -> None:
        self._tensors.clear()

    def verify(self, plan: placement.PlacementPlan) -> list[placement.Violation]:
        want = carry_placement(plan)
        return [placement.Violation("carried", "", name, str(want), f"{t.device}/{placement.dtype_name(t.dtype)}")
                for name, t in self._tensors.items() if (t.device, t.dtype) != (want.device, want.dtype)]

    def sync(self, plan: placement.PlacementPlan) -> int:
        """Move every misplaced carried tensor back; returns how many moved."""
        found = self.verify(plan)
        self.put(plan, **{v.tensor: self._tensors[v.tensor] for v in found})
        return len(found)


def inpainting_checkpoint(pipe) -> bool:
    """Does the denoiser also read the mask and the masked-image latents (an SD inpainting checkpoint's
    9-channel UNet)? The family says (`Family.inpainting`)."""
    return family_of(pipe).inpainting(pipe)


def txt2img_latents(pipe, stage_for, params: GenerateParams, seed: int, on_step: StepCallback | None = None,
                    total: int | None = None, control=None, **inputs) -> torch.Tensor | None:
    """txt2img's denoised latents (None: stopped before a step completed); `total` and `inputs` as
    `generate.denoise` takes them (the refiner's base pass stops at `denoising_end`). An inpainting
    checkpoint (its denoiser also reads a mask and the masked-image latents) runs as A1111 runs it:
    its conditioning is a blank picture (0.5 grey) masked whole, and the `stage_for("inpaint")`
    pipeline denoises from pure noise (strength 1). With `control` (a `ControlPass`) the family's control
    pipeline runs instead, given the pass's maps (an inpainting checkpoint's control pass is refused)."""
    total = params.steps if total is None else total
    if control is not None:
        if inpainting_checkpoint(pipe):
            raise ValueError("ControlNet units on an inpainting checkpoint are not available yet")
        stage = stage_for(CONTROL_STAGE + "txt2img")
        return generate.denoise(stage, params, seed, on_step, total, width=params.width, height=params.height,
                                **control.arguments(stage, "txt2img", params.cfg), **inputs)
    if not inpainting_checkpoint(pipe):
        return generate.denoise(pipe, params, seed, on_step, total, width=params.width, height=params.height,
                                **inputs)
    blank = unmasked_inputs(pipe, params, seed)
    return denoise_stage(stage_for("inpaint"), params, seed, on_step, total, 1.0, blank["masked_image_latents"],
                         **blank, **inputs)


def unmasked_inputs(pipe, params: GenerateParams, seed: int) -> dict[str, torch.Tensor]:
    """What an inpainting checkpoint reads beside the latents where the user masked nothing (txt2img,
    the hires pass), as A1111 feeds it: the whole picture masked and a blank (0.5 grey) masked image."""
    grey = torch.zeros(params.batch, 3, params.height, params.width)  # 0.5 in [0, 1] is 0 in [-1, 1]
    blank = _encode_pixels(pipe, grey, seed)
    return {"mask_image": torch.ones(1, 1, *blank.shape[-2:], device=blank.device), "masked_image_latents": blank}


def stage_on(pipe, fam, cache: dict[str, object], kind: str):
    """The `kind` stage pipeline on `pipe`'s components, built once per loaded model (kept in `cache`)
    and told the pipeline's current execution device and compute dtypes (an offload switch changes them)."""
    stage = cache.get(kind)
    if stage is None:
        stage = cache[kind] = stage_pipeline(pipe, fam, kind)
    stage.execution_device, stage.compute_dtypes = pipe.execution_device, pipe.compute_dtypes
    return stage


def stage_pipeline(pipe, fam, kind: str):
    """The family's `kind` pipeline on `pipe`'s components (the same objects: no weight is copied or
    cast). The scheduler is a fresh copy, because pipeline constructors may rewrite an old
    scheduler config in place."""
    if kind.startswith(CONTROL_STAGE):  # a control pipeline (needs the ControlNet stack attached)
        kit, base = fam.controlnet, kind.removeprefix(CONTROL_STAGE)
        cls = None if kit is None else kit.pipelines.get(base)
        if cls is None:
            raise ValueError(f"ControlNet units with {base} are not available for {fam.label} models yet")
    else:
        cls = fam.stage_pipelines.get(kind)
    if cls is None:
        raise ValueError(f"{kind} is not available for {fam.label} models yet")
    expected, optional = cls._get_signature_keys(cls)
    components = {name: c for name, c in pipe.components.items() if name in expected}
    components["scheduler"] = type(pipe.scheduler).from_config(pipe.scheduler.config)
    options = {name: pipe.config[name] for name in optional if name in pipe.config}
    stage = cls(**components, **options)
    stage.family = fam
    stage.set_progress_bar_config(disable=True)
    return stage


def encode(pipe, images: list, seed: int | None) -> torch.Tensor:
    """Images -> scaled latents, (batch, channels, h, w): on the execution device in the VAE's compute
    dtype (as `decode`), one image at a time with its own generator (image i seeded `seed + i`, so an
    image does not depend on its batch position; seed None: the distribution's mode, no sampling, what
    the live preview's fit reads). Under offload the VAE's hooks bring the encoder in.
    The inverse of `decoding.decode`'s scaling (`Family.latents_from_vae`)."""
    return _encode_pixels(pipe, image_ops.to_tensor(images), seed)


def _encode_pixels(pipe, pixels: torch.Tensor, seed: int | None) -> torch.Tensor:
    """(batch, 3, h, w) pixels in [-1, 1] -> scaled latents (see `encode`); a video VAE
    (`LatentFormat.frames`) encodes each image as one frame, and the frame axis comes off its latents; an RGBA
    VAE (its encoder reads four channels) gets opaque pictures, as its pipeline converts them."""
    vae, frames = pipe.vae, family_of(pipe).latent_format
    dtype = pipe.compute_dtypes.get("vae") or next(vae.parameters()).dtype
    if encoder_channels(vae) == 4:
        pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
    pixels = pixels.to(device=pipe._execution_device, dtype=dtype)
    generators = [None] * len(pixels) if seed is None else generate.seed_generators(seed, len(pixels))
    latents = []
    with torch.no_grad():
        for i, generator in enumerate(generators):
            drawn = vae.encode(frames.to_vae_input(pixels[i:i + 1])).latent_dist
            sample = drawn.mode() if generator is None else drawn.sample(generator)
            latents.append(frames.from_vae_output(sample).float())
    return family_of(pipe).latents_from_vae(vae, torch.cat(latents))


def encoder_channels(vae) -> int:
    """The channels the VAE's encoder reads: its first convolution's input (3 for RGB, 4 for RGBA)."""
    return next(m for m in vae.encoder.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))).in_channels


def upscale_latents(latents: torch.Tensor, hires: HiresParams, size: tuple[int, int], factor: int) -> torch.Tensor:
    """A1111's latent upscalers: interpolate the latents to the target size / `factor`."""
    mode, antialias = LATENT_UPSCALERS[hires.upscaler]
    target = (size[1] // factor, size[0] // factor)
    align = {} if mode.startswith("nearest") else {"align_corners": False}
    return torch.nn.functional.interpolate(latents, size=target, mode=mode, antialias=antialias, **align)


def upscale_images(images: list, hires: HiresParams, size: tuple[int, int]) -> list:
    """Pixel upscalers: a plain resampler to the target size."""
    return [im.resize(size, PIXEL_UPSCALERS[hires.upscaler]) for im in images]


def img2img_inputs(pipe, source: InitImages, params: GenerateParams, seed: int) -> dict[str, torch.Tensor]:
    """Encode stage of img2img: the init images resized to the request's size, encoded (init latents)."""
    images = [source.images[i % len(source.images)] for i in range(params.batch)]
    resized = [image_ops.resize(im.convert("RGB"), params.width, params.height, source.resize_mode) for im in images]
    return {"latents": encode(pipe, resized, seed)}


def inpaint_inputs(pipe, source: InitImages, params: GenerateParams, seed: int,
                   nine_channels: bool) -> tuple[dict[str, torch.Tensor], list, object]:
    """Encode stage of inpaint: the init latents (with A1111's masked content applied), the latent
    mask and, for a 9-channel UNet, the masked-image latents. Returns them, the resized originals
    (for the overlay) and the prepared mask (blurred, at the request's size)."""
    size = (params.width, params.height)
    mask = image_ops.prepare_mask(source.mask, *size, source.resize_mode, source.mask_blur,
                                  source.inpainting_mask_invert)
    image_ops.check_mask(mask)
    originals = [image_ops.resize(source.images[i % len(source.images)].convert("RGB"), *size, source.resize_mode)
                 for i in range(params.batch)]
    starts = [image_ops.fill(im, mask) for im in originals] if source.inpainting_fill == "fill" else originals
    latents = encode(pipe, starts, seed)
    small = image_ops.latent_mask(mask, tuple(latents.shape[-2:])).to(latents.device)
    if source.inpainting_fill == "latent noise":
        # A1111 draws this noise from the image's seed, as the first noise of the pass itself.
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g)
                             for g in generate.seed_generators(seed, len(starts))])
        latents = latents * (1 - small) + noise.to(latents.device) * small
    elif source.inpainting_fill == "latent nothing":
        latents = latents * (1 - small)
    # The latent mask is also what the pipeline blends with: passed as `mask_image`, it is resized up
    # and back down by nearest neighbour, so the pipeline's mask is this one exactly.
    carried = {"latents": latents, "mask": small}
    if nine_channels:  # the UNet also sees the image with the masked area blanked (grey), as A1111 feeds it
        blank = [image_ops.overlay(im.point(lambda _: 127), im, mask.point(lambda v: 255 if v >= 128 else 0))
                 for im in originals]
        carried["masked"] = encode(pipe, blank, seed)
    return carried, originals, mask


def denoise_stage(pipe, params: GenerateParams, seed: int, on_step: StepCallback, total: int,
                  strength: float, latents: torch.Tensor, control=None, kind: str = "img2img",
                  **inputs) -> torch.Tensor | None:
    """The img2img/inpaint pass: our `generate.denoise` on a stage pipeline, started from the spatial
    `latents` (the pipeline casts them to its dtype, adds noise for `strength` from the seed's
    generators and, for Flux, packs them into patches). `control` (a `ControlPass`): `pipe` is the `kind`
    control pipeline, given the pass's maps."""
    if control is not None:
        inputs.update(control.arguments(pipe, kind, params.cfg))
    return generate.denoise(pipe, params, seed, on_step, total, image=latents, strength=strength,
                            width=params.width, height=params.height, **inputs)

