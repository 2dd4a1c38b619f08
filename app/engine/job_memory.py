"""What a job will need in memory, estimated before it starts, and the budget it must fit in.

Why (issue 43, findings 2, 3 and 8): the per-request caps counted pixel-steps and target sizes, not
memory. A txt2img of 2 x 2048² passed 5.4 GiB in the VAE decode, an Extras 1024² x8 passed 6.2 GiB in
the upscaler's float32 passes, and 2,600 `BREAK`s made 2,600 text-encoder passes and embeddings.
Every door of the engine (txt2img with hires fix or refiner, img2img/inpaint, reference editing,
Extras) asks `admit` with the estimate of its job before anything is queued; a job over the budget is
refused with the estimate, the budget and the flag that sets it (`--memory-budget-gib`).

The estimate is the job's peak on top of the loaded models, in two pools: the compute device (the
VAE's and the upscaler's activations, the prompt embeddings) and the host (the pixels: decoded,
post-processed, upscaled, kept until the answer). On a CPU device both are RAM and add up. The
factors below were measured on the whole-batch decode and the upscale (peak RSS growth of a fresh
process, `VmHWM`), in float32; a half-precision VAE needs less, so the estimate stays an upper bound
there. The decode holds them for the pixels it decodes at once (`decoding.pixels_at_once`: above
1024² of a batch it streams image by image, and tiles an image above that), the VAE encode of
img2img and the hires pass for its whole batch.
The denoiser's own activations live at the latent resolution (64 times fewer positions than the
decode's) and stay below the decode's peak, so the decode decides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil
import torch

from app.engine.decoding import pixels_at_once
from app.families import Family

GIB = 2**30
# The VAE decode (and encode) of one output pixel: its full-resolution layers hold this many bytes per
# channel of the VAE's full-resolution width (`block_out_channels[0]`: 128 on every real VAE, 16 on the
# tiny ones), on the device; measured 36-58 across the families' VAEs, tiny and real, rounded up to one
# factor.
VAE_BYTES_PER_CHANNEL = 60
PIXEL_BYTES = 80  # host bytes per decoded pixel: float32 RGB, its post-processed copies, the 8-bit picture
KEPT_BYTES = 12  # host bytes per pixel of each finished image until the answer: the picture, its PNG, base64
# An upscaler pass of output pixels: measured 39-51 bytes on the demo's 4x model when the pass assembled a
# float32 result; tiles now go straight into the 8-bit result (app/upscalers/tiling.py), which needs less,
# so this stays an upper bound until it is measured again. One tile's activations at the output resolution
# on the device (a 64-feature ESRGAN holds a few 64-channel float32 maps there).
UPSCALE_BYTES = 56
UPSCALE_TILE_BYTES = 1024
ASSUMED_UPSCALER_SCALE = 4  # an upscaler model not loaded yet and not named "4x-…"/"…x4": the usual scale
# Prompt chunks (75 tokens, or a `BREAK`): each is a text-encoder pass and an embedding every step reads.
# A1111 users rarely pass a few; 32 is 2,400 tokens, more than the character cap holds in plain words.
MAX_PROMPT_CHUNKS = 32
CHUNK_TOKENS = 77  # a CLIP chunk with BOS and EOS
FLAG = "--memory-budget-gib"
# Where the device computes in RAM, a job's tensors and the pixels share the one C heap, whose policy
# (app/heap.py: one arena, freed blocks kept resident until the next change to the model) lets the RSS
# growth of the same work spread above its live bytes: the tiny VAE's whole 1024² decode grew RSS by
# 513-718 MiB across six runs in one process, and a 2 x 2048² tiled decode by 395-474 MiB here and
# 998 MiB in a CI run, 1.47x its estimate. The RAM pool counts the estimate times this.
RAM_HEAP_SLACK = 2.0


class JobMemoryError(ValueError):
    """A job whose estimate is over the budget, or whose prompt has more chunks than the cap."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate reads from a model: its VAE's full-resolution width and latent-to-pixel factor and,
    per text encoder, the width of its embeddings and whether it reads 75-token chunks (else one row of
    `sequence` tokens)."""

    vae_width: int
    vae_scale: int
    encoders: tuple[tuple[int, bool], ...]
    sequence: int = CHUNK_TOKENS


@dataclass(frozen=True)
class MemoryEstimate:
    device: int  # bytes on the compute device at the job's peak
    host: int  # bytes in RAM at the job's peak
    what: str  # the job, as the refusal names it


@dataclass(frozen=True)
class MemoryBudget:
    """`host`: bytes of RAM a job may plan to use; `device`: of the GPU's memory (None: the device computes in
    RAM, one pool); `rule`: where the numbers come from, for the refusal."""

    host: int
    device: int | None
    rule: str

    def pools(self, estimate: MemoryEstimate) -> list[tuple[str, int, int]]:
        """(pool, bytes the job needs there, its limit) for each pool the job uses."""
        if self.device is None:
            return [("RAM", int((estimate.device + estimate.host) * RAM_HEAP_SLACK), self.host)]
        return [("GPU memory", estimate.device, self.device), ("RAM", estimate.host, self.host)]


def budget_for(gib: float | None, device: torch.device) -> MemoryBudget:
    """The budget: `gib` for every pool when the flag sets it; else a quarter of the machine's RAM, and on a
    GPU half of its memory for what runs there (the models take the rest)."""
    in_ram = device.type != "cuda"
    if gib is not None:
        return MemoryBudget(int(gib * GIB), None if in_ram else int(gib * GIB), f"set by {FLAG}")
    host = psutil.virtual_memory().total // 4
    if in_ram:
        return MemoryBudget(host, None, f"a quarter of this machine's RAM; set it with {FLAG}")
    gpu = torch.cuda.get_device_properties(device).total_memory // 2
    return MemoryBudget(host, gpu, f"a quarter of the RAM, half of the GPU's memory; set it with {FLAG}")


def admit(budget: MemoryBudget, estimate: MemoryEstimate) -> None:
    """Refuse a job whose estimate does not fit the budget, naming both and the flag; nothing is allocated."""
    for pool, need, limit in budget.pools(estimate):
        if need > limit:
            raise JobMemoryError(f"{estimate.what} needs an estimated {need / GIB:.1f} GiB of {pool}, over the "
                                 f"memory budget of {limit / GIB:.1f} GiB ({budget.rule}); use fewer images or "
                                 f"pixels, or raise {FLAG}")


def check_chunks(chunks: int) -> None:
    """Refuse a prompt of more than `MAX_PROMPT_CHUNKS` chunks (all its edited texts together)."""
    if chunks > MAX_PROMPT_CHUNKS:
        raise JobMemoryError(f"the prompts make {chunks:,} chunks of 75 tokens (each BREAK starts one; each edited "
                             f"text has its own); the limit is {MAX_PROMPT_CHUNKS} chunks: shorten the prompt or "
                             f"use fewer BREAKs")


def model_shape(fam: Family, pipe=None) -> ModelShape:
    """The shape of `pipe` (the loaded model the job runs on), else of `fam`'s full-size model (its bundled
    configs): a tiny demo model is estimated as what it is, a model not loaded yet as a real one."""
    vae = _config(fam, pipe, "vae")
    widths = tuple((_width(_config(fam, pipe, te.component)), te.chunked) for te in fam.text_encoders)
    blocks = _vae_widths(vae)
    return ModelShape(blocks[0], 2 ** (len(blocks) - 1), widths, fam.sampling.max_sequence_length or CHUNK_TOKENS)


def _vae_widths(config: Mapping) -> list[int]:
    """A VAE's block widths, full resolution first (one block per 2x scale step after the first): diffusers'
    image VAEs state them (`block_out_channels`); the Wan-style video VAEs a base width and multipliers."""
    blocks = config.get("decoder_block_out_channels") or config.get("block_out_channels")
    if blocks:
        return list(blocks)
    base = config.get("decoder_base_dim") or config["base_dim"]
    return [base * multiple for multiple in config["dim_mult"]]


def _config(fam: Family, pipe, component: str) -> Mapping:
    module = getattr(pipe, component, None) if pipe is not None else None
    if module is None:
        return json.loads((fam.files.config_dir / component / "config.json").read_text())
    config = module.config
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _width(config: Mapping) -> int:
    """A text encoder's embedding width: `hidden_size` (CLIP, decoder-only encoders) or `d_model` (T5);
    nested text configs too."""
    text = config.get("text_config") or config
    return int(text.get("hidden_size") or text.get("d_model") or 0)


def vae_pass(shape: ModelShape, pixels: int) -> tuple[int, int]:
    """(device, host) bytes of a VAE pass over `pixels` output pixels at once (an encode: the whole batch)."""
    return pixels * VAE_BYTES_PER_CHANNEL * shape.vae_width, pixels * PIXEL_BYTES


def decode_pass(shape: ModelShape, width: int, height: int, images: int) -> tuple[int, int]:
    """(device, host) bytes of decoding `images` images of `width` x `height`, streamed as `decode` runs it."""
    return vae_pass(shape, pixels_at_once(width * height, images, shape.vae_scale))


def embeddings(shape: ModelShape, chunks: int, images: int) -> int:
    """Device bytes of the prompt and negative prompt embeddings every image of a batch reads (float32)."""
    rows = sum(width * (chunks * CHUNK_TOKENS if chunked else shape.sequence) for width, chunked in shape.encoders)
    return 2 * images * rows * 4


def upscale_passes(size: tuple[int, int], factor: float, scale: int) -> list[tuple[int, int]]:
    """The output sizes of the model passes `tiling.upscale_by` runs to reach `size` x `factor`."""
    target = (int(size[0] * factor) // 8 * 8, int(size[1] * factor) // 8 * 8)
    passes, current = [], size
    for _ in range(3):  # `tiling.MAX_PASSES`
        if current[0] >= target[0] and current[1] >= target[1] and factor != 1:
            break
        current = (current[0] * scale, current[1] * scale)
        passes.append(current)
    return passes


def upscale(size: tuple[int, int], factor: float, scale: int, tile: int) -> tuple[int, int]:
    """(device, host) bytes of upscaling one image: the largest pass's result and one tile's activations."""
    largest = max((w * h for w, h in upscale_passes(size, factor, scale)), default=0)
    tile_pixels = min(tile * tile, size[0] * size[1]) * scale * scale
    return tile_pixels * UPSCALE_TILE_BYTES, largest * UPSCALE_BYTES


def peak(what: str, phases: Sequence[tuple[int, int]], device: int = 0, host: int = 0) -> MemoryEstimate:
    """The estimate of a job whose `phases` (device, host) run one after another, on top of `device` and
    `host` bytes held throughout (embeddings, finished images)."""
    return MemoryEstimate(device + max((d for d, _h in phases), default=0),
                          host + max((h for _d, h in phases), default=0), what)


def generation(shape: ModelShape, params, chunks: int, what: str, *, encodes: bool = False, second=None,
               upscale_cost=(0, 0)) -> MemoryEstimate:
    """A txt2img, img2img or inpaint job of `params` (`GenerateParams`): each run decodes its batch as
    `decode` streams it (`encodes`: img2img and inpaint encode the whole batch first, at the same size);
    with a hires fix, `second` is the second pass (its encode of the whole batch and its decode at the
    target size) and `upscale_cost` the model upscale of one image, while the decoded first pass waits.
    Every finished image is kept until the answer."""
    first = params.width * params.height * params.batch
    final = second or params
    phases = [decode_pass(shape, params.width, params.height, params.batch)]
    if encodes:
        phases.append(vae_pass(shape, first))
    if second is not None:
        phases += [vae_pass(shape, second.width * second.height * params.batch),
                   (upscale_cost[0], upscale_cost[1] + first * KEPT_BYTES)]
    kept = params.n_iter * params.batch * final.width * final.height * KEPT_BYTES
    return peak(what, phases, embeddings(shape, chunks, params.batch), kept)


def extras(sizes: Sequence[tuple[int, int]], params, scales: Mapping[str, int], tile: int) -> MemoryEstimate:
    """An Extras job (`ExtrasParams`) on images of `sizes`, one after another: each through upscaler 1 (and 2,
    blended; a resampler costs its result only), `scales` giving each model's scale; results kept."""
    phases, kept = [], 0
    for size in sizes:
        factor = params.factor_for(size)
        result = int(size[0] * factor) * int(size[1] * factor)
        costs = [upscale(size, factor, scales[name], tile) if name in scales else (0, result * KEPT_BYTES)
                 for name in (params.upscaler, *([params.upscaler_2] if params.blends else []))]
        phases.append((max(d for d, _h in costs), sum(h for _d, h in costs)))
        kept += result * KEPT_BYTES
    return peak(f"Extras of {len(sizes)} image(s), {params.infotext().split(', ')[0]}", phases, host=kept)
