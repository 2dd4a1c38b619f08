"""The GGUF rows (issue 40): ours reading a transformer-only `.gguf` vs diffusers' GGUF loader, and vs bf16.

For each quant type (Q8_0, Q4_K) the run's random-weight denoiser is written twice with the same
blocks: in the original (BFL/ComfyUI) names, the file a user downloads, which our engine loads with
the encoders and VAE as single files from `models/text_encoder` and `models/VAE`; and in diffusers'
names, which `from_single_file(..., quantization_config=GGUFQuantizationConfig(...))` loads without
its name converter (that converter hard-codes the 12B model's widths, so `--smoke`'s tiny models go
through it only this way). The blocks are synthetic (random, sized like the weights: the speed of a
dequantising forward does not depend on the values; `gguf`'s numpy quantiser would take minutes per
full-size model and writes no K type). One pool per type: ours with no LoRA and with 3 LoRAs as
bypasses, diffusers' GGUF pipeline, diffusers bf16 eager. Our full-precision engine is unloaded first.

    python -m app.bench --families <a DiT family> --sections gguf --batches 1 --loras 0,3 --repeats 2 --steps 8
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from diffusers import GGUFQuantizationConfig

from app.demo import component_configs
from app.engine.worker import Engine
from app.families import family
from app.families.file_layout import all_in_one_state, file_shapes, to_file
from app.settings import Settings
from benchmarks import ours
from benchmarks.config import Bench
from benchmarks.denoiser import denoiser_of
from benchmarks.gguf_writer import write_gguf
from benchmarks.measure import Variant, free_memory, with_control
from benchmarks.theirs import DiffusersSide, euler, generator, load_pipeline
from benchmarks.workload import PreparedModel

log = logging.getLogger("bench")
KINDS = ("Q8_0", "Q4_K")


def write_files(model: PreparedModel, bench: Bench, kind: str) -> tuple[str, Path]:
    """Our transformer-only file (its name under models/Stable-diffusion) and diffusers' twin, same blocks;
    the other parts as one single file in each folder the family reads them from (written once)."""
    fam, settings = family(model.family), Settings(data_dir=model.data_dir)
    pipe = load_pipeline(model, bench, to_device=False)
    denoiser_part = next(p for p in fam.files.parts if p.component == fam.denoiser)
    state = getattr(pipe, fam.denoiser).state_dict()
    layout = denoiser_part.layout(getattr(pipe, fam.denoiser))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    name = f"{model.name}-{kind}.gguf"
    write_gguf(to_file(layout, state, file_shapes(layout, shapes)), settings.checkpoints_dir / name, (kind,),
               component_configs(pipe, model.family), synthetic=True)  # every part's config, as the demo's files
    theirs = model.data_dir / f"{model.name}-{kind}-diffusers-names.gguf"
    write_gguf(state, theirs, (kind,), synthetic=True)  # seed 0 both: the same blocks in the same order
    rest = [p for p in fam.files.parts if p.component != fam.denoiser]
    for folder in {getattr(settings, p.folder) for p in rest}:
        target = folder / "bench-parts.safetensors"
        if not target.exists():
            from safetensors.torch import save_file

            folder.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in all_in_one_state(pipe, rest).items()}, str(target))
    del pipe
    free_memory()
    return name, theirs


def diffusers_gguf(model: PreparedModel, bench: Bench, path: Path):
    """The pipeline with diffusers' GGUF transformer, as its users load one (compute in the run's dtype)."""
    fam = family(model.family)
    denoiser = fam.denoiser_class.from_single_file(
        str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=bench.dtype), config=str(model.folder),
        subfolder=fam.denoiser, torch_dtype=bench.dtype, local_files_only=True)
    pipe = fam.plain_pipeline_class.from_pretrained(model.folder, dtype=bench.dtype, local_files_only=True,
                                                    **{fam.denoiser: denoiser}, **fam.pipeline_kwargs)
    pipe.scheduler = euler(model.family, pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(bench.device)


def gguf_phase(run, engine: Engine, theirs: DiffusersSide, bench: Bench) -> None:
    """One pool per quant type in `KINDS` (see the module doc); the rows' notes say what each side stored."""
    from benchmarks.phases import Pairing, _measure

    model = run.model
    if not family(model.family).files.parts:
        run.notes["gguf"] = f"{family(model.family).label} is not assembled from parts: no .gguf files are read for it"
        return
    engine.unload()
    free_memory()
    for kind in KINDS[-1:] if bench.config.mode == "smoke" else KINDS:  # smoke: the K type's pool (same code)
        name, their_file = write_files(model, bench, kind)
        mine = ours.new_engine(model, bench)
        pipe = None
        try:
            ours.load(mine, name)
            snap = mine.snapshot()
            run.notes[f"gguf {kind}"] = (f"ours: {snap.stored_layers} layers packed "
                                         f"({', '.join(snap.stored_as)}), {snap.resting_bytes / 2**30:.2f} GiB")
            pipe = diffusers_gguf(model, bench, their_file)
            if theirs.pipe is None:
                theirs.load()
            key0, key3 = ("none", 0, f"gguf-{kind}", 1), ("none", 3, f"gguf-{kind}-bypass", 1)
            base, eager = ("none", 0, f"diffusers-gguf-{kind}", 1), ("none", 0, "eager", 1)
            generate, denoiser, read = ours.generator(mine, model, bench, 1), denoiser_of(mine.pipeline), \
                ours.last_timeline(mine)
            pool = f"gguf {kind}"
            _measure(run, bench, pool, with_control({
                key0: Variant(ours.lora_setup(mine, model, 0), generate, denoiser, read),
                key3: Variant(ours.lora_setup(mine, model, 3), generate, denoiser, read),
                base: Variant(lambda: None, generator(pipe, model, bench, 1), denoiser_of(pipe)),
                eager: Variant(theirs.state_setup(0, False), theirs.generator(1), theirs.denoiser)}, key0))
            run.pairings += [Pairing("gguf", pool, key0, f"ours GGUF {kind}", base, f"diffusers GGUF {kind}", key0),
                             Pairing("gguf", pool, key0, f"ours GGUF {kind}", eager, f"diffusers {bench.config.dtype}",
                                     key0),
                             Pairing("gguf", pool, key3, f"ours GGUF {kind} + 3 LoRAs bypass", key0,
                                     f"ours GGUF {kind}", key0)]
        finally:
            ours.close(mine)
            del pipe
            free_memory()
            for path in (model.data_dir / "models" / "Stable-diffusion" / name, their_file):
                if os.path.exists(path):
                    os.remove(path)
