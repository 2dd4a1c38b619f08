"""The VAE decode of a batch of latents: whole at ordinary sizes, streamed image by image and tiled above.

Why: a whole-batch decode holds every image's activations at once (the tiny SD1.5 at 2048² x 2 peaked
at +5.4 GiB, issue 43 finding 3; a real VAE's 128-channel full-size layers take 8× that), and then the
whole float32 result and its copies. Above `WHOLE_DECODE_PIXELS` (the batch's pixels together) each image
is decoded on its own and turned into 8 bits at once, so one image's activations and no float result of
the batch are ever held; an image itself above it is decoded in tiles (`tiling.tiled`, the loop the
upscalers use: `DECODE_TILING` in latent pixels, each tile decoded with `overlap` latents of context
and only its core kept, straight into the 8-bit image).

Why that threshold: 1024² is the largest native size of any family today, and lies
above every size the oracle tests compare with diffusers' own pipelines, so at and below it the
decode is diffusers' one call on the batch, bit for bit as before (a batch decoded image by image
differs from the batched call in the last float bits on the CPU: the convolution kernels block
differently). A tiled image differs from a whole decode: GroupNorm's statistics and the mid-block's
attention see a tile and its context rather than the whole picture (tests/test_decoding.py states
the tolerance).

The decode is ours rather than the diffusers pipeline's because the SDXL pipeline upcasts the VAE by
*replacing its dtype* in the middle of a call; our placement plan already keeps that VAE in fp32, so
decoding in the VAE's own dtype is both correct and mutation-free.

The tiles cut the last two axes and the batch is split on the first: the engine's latents are images
(batch, channels, h, w) whatever the VAE, and a video VAE's frame axis (`LatentFormat.frames`: it takes and
returns (batch, channels, frames, h, w)) is added at its input and taken off its output, one frame.

A stop lands inside the decode through the interrupt hooks and attention slices (`app.engine.interrupt`)
of the VAE's blocks: a stop of a streamed batch keeps the images decoded before it.
"""

from __future__ import annotations

import torch
from PIL import Image

from app.engine import timeline
from app.engine.interrupt import StepInterrupted
from app.families import family_of
from app.upscalers.tiling import Tiling, tiled

WHOLE_DECODE_PIXELS = 1024 * 1024
# Latent pixels: a 512-pixel core with 128 pixels of context on each side (a real VAE's 3x3 convolutions
# reach ~40 latents through its blocks; the rest of the difference is GroupNorm's and attention's).
DECODE_TILING = Tiling(tile=64, overlap=16)


def pixels_at_once(image_pixels: int, images: int, scale: int) -> int:
    """Output pixels whose activations `decode` holds at once for `images` images of `image_pixels` each
    (`scale`: the VAE's latent-to-pixel factor): the whole batch up to `WHOLE_DECODE_PIXELS`, else one
    image, else one tile with its context. The memory estimate (app/engine/job_memory.py) reads it."""
    if images * image_pixels <= WHOLE_DECODE_PIXELS:
        return images * image_pixels
    if image_pixels <= WHOLE_DECODE_PIXELS:
        return image_pixels
    side = (DECODE_TILING.tile + 2 * DECODE_TILING.overlap) * scale
    return min(side * side, image_pixels)


def decode(pipe, latents: torch.Tensor) -> list[Image.Image]:
    """Latents -> PIL images through the VAE on the execution device, in the VAE's compute dtype.
    A stop inside a streamed decode returns the images finished before it (a whole decode: none)."""
    vae = pipe.vae
    # The execution device and the VAE's compute dtype, not its resting ones: under offload the
    # VAE rests on the CPU (maybe in a wider dtype) until its hooks bring it over. fp32 when it
    # must upcast.
    dtype = pipe.compute_dtypes.get("vae") or next(vae.parameters()).dtype
    fam = family_of(pipe)
    latents = fam.latents_for_vae(vae, latents.to(device=pipe._execution_device, dtype=dtype))
    frames = fam.latent_format

    def vae_decode(part: torch.Tensor) -> torch.Tensor:
        """The VAE's pictures as RGB: an RGBA VAE's alpha channel is left out, as every tool that
        reads the engine's pictures (upscalers, ControlNet maps, A1111 clients' JPEGs) reads RGB."""
        return frames.from_vae_output(vae.decode(frames.to_vae_input(part), return_dict=False)[0])[:, :3]
    scale = pipe.vae_scale_factor
    rows, columns = latents.shape[-2:]
    image_pixels = rows * columns * scale * scale
    if latents.shape[0] * image_pixels <= WHOLE_DECODE_PIXELS:
        with torch.no_grad(), timeline.phase("decode"):
            decoded = vae_decode(latents)
        with timeline.phase("image conversion"):
            return pipe.image_processor.postprocess(decoded.float(), output_type="pil")
    tiling = DECODE_TILING if image_pixels > WHOLE_DECODE_PIXELS else Tiling(tile=max(rows, columns), overlap=0)
    images = []
    for one in latents.split(1):
        def run(tile_rows: slice, tile_columns: slice, one=one) -> torch.Tensor:
            decoded = vae_decode(one[..., tile_rows, tile_columns])
            return decoded.float() * 0.5 + 0.5  # diffusers' `denormalize`; `tiled` clamps and rounds as it does
        try:
            with torch.no_grad(), timeline.phase("decode"):
                images.append(tiled(rows, columns, run, scale, tiling, lambda done, total: False))
        except StepInterrupted:
            break
    return images
