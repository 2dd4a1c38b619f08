"""The step cache's rows (issue 41, item 4): ours with the step cache on against ours uncached, in one
ABBA pool with a control, with the image difference (PSNR of the 8-bit images, same seed) and how many
denoiser calls ran whole in the row.

Why the whole-call count is in the row: the speed-up is a function of the calls the cache reuses, and
which calls it reuses depends on the weights: the bench's random-weight models change their first block's
output unlike trained ones, so the ratio of a random-weight run says what a skipped call saves, and the
count says how many it skipped. A family whose benched checkpoint is step-distilled (`Sampling.step_distilled`)
refuses the cache and gets a note instead of a row.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
import torch

from app.engine.worker import Engine
from app.families import family
from benchmarks import ours
from benchmarks.config import Bench
from benchmarks.denoiser import denoiser_of
from benchmarks.measure import Variant, measure_interleaved, with_control
from benchmarks.phases import FamilyRun, Pairing
from benchmarks.theirs import DiffusersSide

log = logging.getLogger("bench")


def psnr(image: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two 8-bit images in dB (infinite when they are equal)."""
    mse = float(np.mean((image.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


class WholeCalls:
    """Counts denoiser calls that ran past the first block: forwards of the block after it (the next
    element of the first block's list, `Family.first_block`)."""

    def __init__(self, denoiser: torch.nn.Module, first_block: str) -> None:
        parent, _, index = first_block.rpartition(".")
        self.count = 0
        self._handle = denoiser.get_submodule(parent)[int(index) + 1].register_forward_pre_hook(self._seen)

    def _seen(self, *_args) -> None:
        self.count += 1

    def remove(self) -> None:
        self._handle.remove()


def cache_phase(run: FamilyRun, engine: Engine, _theirs: DiffusersSide, bench: Bench) -> None:
    """Ours at threshold `bench.config.step_cache` against ours uncached (batch 1, no LoRA); the row's
    extra fields: the PSNR of the cached image against the uncached one and the whole calls per
    generation of each."""
    model, threshold = run.model, bench.config.step_cache
    fam = family(model.family)
    if engine.snapshot().model is None:  # an earlier phase (the VRAM budget's) unloaded it
        ours.load(engine, model.name)
    engine.set_offload("none")
    if fam.sampling.step_distilled(engine.pipeline):
        run.notes["cache"] = f"{fam.label}'s benched checkpoint is step-distilled: no step cache"
        log.info("[%s] cache: %s", model.family, run.notes["cache"])
        return
    plain = ours.generator(engine, model, bench, 1)
    cached = ours.generator(engine, model, bench, 1, step_cache=threshold)
    denoiser, none = denoiser_of(engine.pipeline), functools.partial(engine.set_loras, [])
    uncached_key, cached_key = ("none", 0, "uncached", 1), ("none", 0, "step-cache", 1)
    variants = with_control({uncached_key: Variant(none, plain, denoiser), cached_key: Variant(none, cached, denoiser)},
                            uncached_key)
    log.info("[%s] cache: threshold %g, %d ABBA rounds", model.family, threshold, bench.config.repeats)
    run.pools["cache"] = measure_interleaved(variants, bench.device, bench.config.repeats, bench.config.warmup,
                                             bench.nvml)
    counter = WholeCalls(denoiser, fam.first_block)
    try:
        images = {}
        for key, generate in ((uncached_key, plain), (cached_key, cached)):
            counter.count = 0
            images[key] = np.stack([np.asarray(im.image) for im in generate()])
            run.row_fields[key] = {"whole_calls": counter.count}
    finally:
        counter.remove()
    quality = psnr(images[cached_key], images[uncached_key])
    run.row_fields[cached_key] |= {"step_cache": threshold, "uncached_whole_calls": run.row_fields[uncached_key]
                                   ["whole_calls"], "psnr_db": None if math.isinf(quality) else round(quality, 2),
                                   "images_equal": math.isinf(quality)}
    run.pairings.append(Pairing("cache", "cache", cached_key, f"ours step cache {threshold:g}", uncached_key,
                                "ours uncached", uncached_key, "cache"))
