"""CPU proxies (`python -m app.bench --cpu-proxies`): what can be measured without a GPU, on the
full-size SD1.5, SDXL and FLUX.1-dev architectures with random weights, ours against diffusers in
the same run.

* load: `Engine.load_model` against diffusers' `from_single_file` (offline, `config=` the bundled
  folder), each load in a fresh process (time, process CPU time, peak RSS), in ABBA order with a
  same-vs-same control; our first load of a file (a fresh data folder per probe: nothing learnt
  about the file before) is a variant of its own;
* step: aten ops per UNet call (a dispatch mode inside the UNet's hooks) and thread CPU time per
  step (with its user part and the minor page faults), without and with three fused rank-64 LoRAs
  and against diffusers, at a small latent so two cores can afford it;
* reweight: a third LoRA added, its strength moved, removed (the engine's whole transition, the
  patching alone from the engine's timer, and what each change costs besides its math:
  `mutation_costs.py`);
* fp8: fp8 weight storage against full weights, LoRAs as bypasses or fused copies (`proxy_fp8.py`);
* ops: aten ops per denoiser call on the meta device, so any size fits: ours without LoRAs, with
  three fused and as bypass forwards, against diffusers (`proxy_ops.py`);
* timeline: one whole generation's time outside the denoiser, ours (no LoRA, three fused) against
  diffusers' pipeline call, with our timeline's phases and the host syncs per generation
  (`proxy_timeline.py`);
* fp8-compute: widening casts and fp8 matmuls per denoiser call on the meta device, fp8 storage against
  `--weights fp8-compute` (`proxy_fp8_compute.py`);
* compile: a DiT denoiser's first compile on the meta device, whole against regional (seconds, graphs;
  `proxy_compile.py`).

This CPU computes bf16 at about 1 GFLOP/s against 150 in fp32, so step rows run in fp32 while load and
re-weight rows use bf16 storage (what a GPU user loads, without a dtype conversion). Sections that
do not fit in the memory available are skipped with the reason, never shrunk to another model:
FLUX.1-dev's pipeline (16.9 B parameters, 34 GB in bf16) gets the ops section only on a 23 GB machine.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from app.engine.checkpoint_shapes import meta_components
from app.engine.placement import DTYPES
from app.families import family
from app.settings import Settings
from benchmarks import stats
from benchmarks.config import PROMPT, SEED
from benchmarks.measure import abba, control_key, fits
from benchmarks.probe import spawn_load_probe
from benchmarks.proxy_compile import compile_section
from benchmarks.proxy_fp8 import fp8_section
from benchmarks.proxy_fp8_compute import fp8_compute_section
from benchmarks.proxy_ops import ops_section
from benchmarks.proxy_steps import reweight_section, step_section
from benchmarks.proxy_timeline import timeline_section
from benchmarks.workload import lora_kinds, lora_targets, single_file_numel, write_loras, write_random_single_file

SCHEMA = "steady-diffusion-cpu-proxies/1"
# Variant -> probe side. "ours" is Engine.load_model with the file's facts cached (any load after the
# first); a first load runs in a data folder of its own, made afresh for each probe (the checkpoint
# hard-linked in), so nothing an earlier probe learnt about the file is there; the loader alone leaves
# out the engine's transition.
FIRST_LOAD = "ours, first load (fresh data folder)"
LOAD_VARIANTS = {"ours": "ours", "diffusers": "diffusers", FIRST_LOAD: "ours",
                 "ours, loader alone (models.load_pipeline)": "ours-models"}
CONTROL = control_key(("none", 0, "ours"))[2]
SECTIONS = ("load", "step", "reweight", "fp8", "ops", "timeline", "fp8-compute", "compile")


@dataclass(frozen=True)
class ProxyConfig:
    """What a proxy run varies; the defaults keep each family's run within minutes on 2 cores."""

    cache_dir: Path
    families: tuple[str, ...] = ("sd15", "sdxl")
    sections: tuple[str, ...] = SECTIONS
    storage_dtype: str = "bf16"
    step_dtype: str = "fp32"
    resolution: int = 128
    steps: int = 3
    rounds: int = 4
    reweights: int = 6
    lora_rank: int = 64
    threads: int = 1
    prompt: str = PROMPT
    seed: int = SEED


@dataclass(frozen=True)
class ProxyModel:
    """A cached random-weight single file in an A1111-layout data dir, with three LoRAs."""

    family: str
    data_dir: Path
    name: str
    path: Path
    loras: tuple[str, ...]
    numel: int  # every tensor in the file
    lora_numel: int  # UNet weights the three LoRAs touch (what fused LoRAs back up)


def prepare(family_name: str, config: ProxyConfig) -> ProxyModel:
    """The checkpoint and LoRAs, written once into the cache folder and reused by later runs."""
    settings = Settings(data_dir=config.cache_dir / f"{family_name}-{config.storage_dtype}")
    path = settings.checkpoints_dir / f"random-{family_name}.safetensors"
    if not path.is_file():
        write_random_single_file(family_name, path, DTYPES[config.storage_dtype])
    denoiser = getattr(meta_components(family_name, family(family_name).files.config_dir), family(family_name).denoiser)
    names = tuple(f"bench-{family_name}-{kind}{i}" for i, kind in enumerate(lora_kinds(family_name, denoiser)))
    if not all((settings.lora_dir / f"{n}.safetensors").is_file() for n in names):
        write_loras(denoiser, settings.lora_dir, family_name, config.lora_rank)
    touched = sum(math.prod(shape) for _name, shape in lora_targets(family_name, denoiser, convs=True))
    return ProxyModel(family_name, settings.data_dir, path.name, path, names, single_file_numel(path), touched)


# ------------------------------------------------------------------------------------ load
def _load_spec(model: ProxyModel, side: str, config: ProxyConfig) -> dict[str, Any]:
    return {"side": side, "family": model.family, "data_dir": str(model.data_dir), "name": model.name,
            "path": str(model.path), "dtype": config.storage_dtype, "threads": 2}


def load_section(model: ProxyModel, config: ProxyConfig) -> dict[str, Any]:
    """Fresh-process loads of both sides in ABBA order after one warm-up each (page cache warm, our
    facts written, waiting for the background read of the file); a first load gets a fresh data folder."""
    keys = [*LOAD_VARIANTS, CONTROL]
    specs = {key: _load_spec(model, LOAD_VARIANTS.get(key, "ours"), config) for key in keys}
    for side in ("ours", "diffusers"):
        spawn_load_probe({**_load_spec(model, side, config), "wait_for_scan": True})
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in keys}
    for round_index in range(config.rounds):
        for key in abba(keys, round_index):
            if key != FIRST_LOAD:
                runs[key].append(spawn_load_probe(specs[key]))
                continue
            with tempfile.TemporaryDirectory(prefix="first-load-", dir=model.data_dir.parent) as fresh:
                target = Settings(data_dir=Path(fresh)).checkpoints_dir / model.name
                target.parent.mkdir(parents=True)
                os.link(model.path, target)
                runs[key].append(spawn_load_probe({**specs[key], "data_dir": fresh}))
    return {"family": model.family, "file_gib": model.path.stat().st_size / 2**30, "runs": runs,
            "comparisons": _load_comparisons(runs)}


def _series(runs: list[dict[str, Any]], field: str) -> list[float]:
    return [run[field] for run in runs]


def _load_comparisons(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each of our variants against diffusers: wall time, CPU time, peak RSS; lower is better for all
    three, so each ratio is diffusers / ours. The control is our cached load measured twice."""
    rows = []
    for ours in (key for key in LOAD_VARIANTS if key != "diffusers"):
        for field in ("load_s", "cpu_s", "peak_rss_gib"):
            mine, base = _series(runs[ours], field), _series(runs["diffusers"], field)
            control = stats.paired_ratios(_series(runs["ours"], field), _series(runs[CONTROL], field), False)
            rows.append({"ours": ours, "baseline": "diffusers from_single_file", "figure": field,
                         "ours_median": stats.median_interval(mine).as_dict(),
                         "baseline_median": stats.median_interval(base).as_dict(),
                         **stats.compare(mine, base, control, higher_is_better=False)})
    return rows


# ------------------------------------------------------------------------------------ run
# Sections that run on a random-weight single file (the file and its model must fit in RAM).
WEIGHT_SECTIONS = {"load": load_section, "step": step_section, "reweight": reweight_section, "fp8": fp8_section,
                   "timeline": timeline_section}


def run_proxies(config: ProxyConfig, env: dict[str, Any]) -> dict[str, Any]:
    """Every section for every family, one model in memory at a time."""
    results = {"schema": SCHEMA, "config": {k: str(v) if isinstance(v, Path) else v
                                            for k, v in asdict(config).items()},
               "env": env, "method": stats.METHOD, "models": {}, **{section: [] for section in SECTIONS}}
    torch.set_num_threads(config.threads)
    for family_name in config.families:
        if "ops" in config.sections:
            results["ops"].append(ops_section(family_name, config))
        if "fp8-compute" in config.sections:
            results["fp8-compute"].append(fp8_compute_section(family_name, config))
        if "compile" in config.sections:
            results["compile"].append(compile_section(family_name, config))
        wanted = [section for section in WEIGHT_SECTIONS if section in config.sections]
        why = weights_skip(family_name, config) if wanted else None
        if why:
            for section in wanted:
                results[section].append({"family": family_name, "skipped": why})
            continue
        if wanted:
            model = prepare(family_name, config)
            results["models"][family_name] = {"file": model.name, "numel": model.numel, "lora_numel": model.lora_numel,
                                              "file_gib": model.path.stat().st_size / 2**30}
        for section in wanted:
            results[section].append(WEIGHT_SECTIONS[section](model, config))
    return results


def weights_skip(family_name: str, config: ProxyConfig) -> str | None:
    """Why the weight sections cannot run for `family_name` here, or None. The smallest thing they all need
    is the pipeline's file in the storage dtype; the sections check their own, larger, needs."""
    fam = family(family_name)
    meta = vars(meta_components(family_name, fam.files.config_dir))
    numel = sum(p.numel() for module in meta.values() for p in module.parameters())
    ok, why = fits(numel * DTYPES[config.storage_dtype].itemsize)
    if not ok:
        return (f"memory: the full-size {fam.label} pipeline ({numel / 1e9:.1f} B parameters) in "
                f"{config.storage_dtype} {why}")
    if fam.files.parts:
        return f"the proxies write LDM single files, and {fam.label} has none (its files are read by parts)"
    return None
