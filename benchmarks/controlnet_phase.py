"""The ControlNet rows (issue 38): ours with one ControlNet unit against diffusers' own control pipeline of the
family on the same weights (the checkpoint and one random-weight ControlNet), batch 1, no LoRA, one ABBA pool
with a control. Every row carries it/s and the per-image time, as all rows do.

The ControlNet comes from the family's kit (`Family.controlnet`): its full-size config (the first of
`single_file_configs`) with random weights, or the tiny one in a smoke run; diffusers' side is the diffusers
class our control pipeline and our stack are built on, holding the same ControlNet module, so both sides
compute the same residuals. A family without a kit gets a note instead of a row.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from diffusers.models.modeling_utils import ModelMixin
from PIL import Image

from app.controlnet.units import ControlUnit
from app.demo import build_tiny_controlnet
from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.families import family
from app.settings import Settings
from benchmarks import ours
from benchmarks.config import PROMPT, SEED, Bench, guidance
from benchmarks.denoiser import default_dtype, denoiser_of
from benchmarks.measure import Variant, measure_interleaved, with_control
from benchmarks.phases import FamilyRun, Pairing
from benchmarks.theirs import DiffusersSide

log = logging.getLogger("bench")
NAME = "bench-controlnet"


def _diffusers_base(cls: type) -> type:
    """The diffusers class one of ours is built on (our classes put `EnginePipeline` or a mixin first)."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("diffusers."))


def _write_controlnet(run: FamilyRun, bench: Bench) -> torch.nn.Module:
    """The ControlNet both sides run, saved as a diffusers folder in the run's `models/ControlNet/`."""
    kit, family_name = family(run.model.family).controlnet, run.model.family
    if bench.config.tiny:
        net = build_tiny_controlnet(family_name)
    else:
        with torch.device(bench.device), default_dtype(bench.dtype), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = kit.model_classes[0].from_config(dict(kit.single_file_configs()[0])).eval()
    net.save_pretrained(Settings(data_dir=run.model.data_dir).controlnet_dir / NAME, safe_serialization=True)
    return net.to(device=bench.device, dtype=bench.dtype)


def controlnet_phase(run: FamilyRun, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    model = run.model
    fam = family(model.family)
    if fam.controlnet is None:
        run.notes["controlnet"] = f"{fam.label} takes no ControlNet"
        return
    if engine.snapshot().model is None:
        ours.load(engine, model.name)
    if theirs.pipe is None:
        theirs.load()
    engine.set_offload("none")
    theirs.to_state(0, False)
    side = bench.config.resolution[model.family]
    control = Image.fromarray(np.random.default_rng(SEED).integers(0, 255, (side, side, 3), dtype=np.uint8))
    net = _write_controlnet(run, bench)
    unit = ControlUnit(NAME, control)
    params = GenerateParams(PROMPT, steps=bench.config.steps, cfg=guidance(model.family), seed=SEED, width=side,
                            height=side, sampler="Euler", controlnet_units=(unit,))
    kit, pipeline = fam.controlnet, _diffusers_base(fam.controlnet.pipelines["txt2img"])
    # diffusers' multi-ControlNet class the stack is built on, holding the net; where diffusers has none (its
    # pipeline takes one ControlNet), the net itself, given the unit's values rather than lists
    multi = _diffusers_base(kit.stack_class)
    single = multi is ModelMixin
    expected, _optional = pipeline._get_signature_keys(pipeline)
    parts = {k: v for k, v in theirs.pipe.components.items() if k in expected}
    control_pipe = pipeline(**parts, **{kit.component: net if single else multi([net])})
    control_pipe.set_progress_bar_config(disable=True)
    armed = kit.arm(kit.stack_class([net]), "txt2img", [control], [unit], guidance(model.family))
    arguments = {**fam.call_arguments(guidance(model.family)),
                 **({k: v[0] if isinstance(v, list) else v for k, v in armed.items()} if single else armed)}

    def diffusers_generate():
        return control_pipe(prompt=PROMPT, num_inference_steps=bench.config.steps, width=side, height=side,
                            generator=[torch.Generator("cpu").manual_seed(SEED)], output_type="pil", **arguments).images

    def ours_generate():
        return engine.generate(params)

    ours_key, theirs_key = ("none", 0, "controlnet", 1), ("none", 0, "diffusers-controlnet", 1)
    variants = with_control({ours_key: Variant(lambda: None, ours_generate, denoiser_of(engine.pipeline),
                                               ours.last_timeline(engine)),
                             theirs_key: Variant(lambda: None, diffusers_generate, theirs.denoiser)}, ours_key)
    log.info("[%s] controlnet: %d ABBA rounds", model.family, bench.config.repeats)
    run.pools["controlnet"] = measure_interleaved(variants, bench.device, bench.config.repeats, bench.config.warmup,
                                                  bench.nvml)
    run.pairings.append(Pairing("controlnet", "controlnet", ours_key, "ours ControlNet", theirs_key,
                                "diffusers ControlNet pipeline", ours_key))
    engine.unload_controlnets()
