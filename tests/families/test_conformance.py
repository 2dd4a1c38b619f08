"""The family contract's proof: one suite every registered family runs, with strict forwards on.

Parametrised over the registry (`app.families.FAMILIES`), so a new family file is held to it with
no edit here, plus `toy` (tests/families/toy_family.py), which carries what no registered family
has yet: a ModuleDict child called by key, a tensor the denoiser owns itself, an fp32-pinned
buffer. Every engine here runs with strict forwards (`app/engine/strict.py`): each module's
forward checks that what it holds is on the compute device in the planned compute dtype, so a
hook on a module whose forward never runs fails the generation that meets it. What it protects, per
family: each declared checkpoint layout loads the saved weights bit for bit; one seed gives one
image and the guidance reaches the model; the denoising loop reads one tensor on the host per step
more than the family's own pipeline (the NaN check's, which a GPU does not wait on); the compiled
denoiser draws the eager latents and LoRAs change it without a recompile; a PEFT LoRA written by
peft fuses to the formula and comes off bit for bit; every offload mode with weights resting in fp32
and computing in bf16 draws the same image with zero violations and exactly the planned hooks; fp8
storage keeps its bytes with whole components moved and blocks streamed; img2img and inpaint run
where the family declares them; embeddings never shrink a table; Interrupt stops its loop within two
steps, keeping the last whole step's image; Diagnostics and the bug report render. A family's own
test file covers only its native file formats.
"""

from __future__ import annotations

import fnmatch
import io
import os
import re
import shutil
import zipfile

import numpy as np
import pytest
import torch
import toy_family
from hook_plan import actual_hooks, expected_hooks
from PIL import Image, ImageFilter
from running_job import Running
from torch.utils._python_dispatch import TorchDispatchMode

from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import adapter_state_digests, write_demo_loras
from app.controlnet.units import ControlUnit
from app.demo import build_tiny_pipeline, component_configs
from app.engine import checkpoint_files, compiled, fp8_matmul, models, offload, placement
from app.engine.detailing import DetailParams, DetailPass
from app.engine.generate import GenerateParams, denoise
from app.engine.strict import StrictForwardError
from app.engine.worker import Engine
from app.families import FAMILIES, family
from app.prompts.notes import prompt_notes
from app.report import build_bug_report
from app.settings import OFFLOAD_CHOICES, Settings
from app.ui import views
from benchmarks.gguf_writer import write_gguf

CONFORMING = [*FAMILIES, toy_family.NAME]
STRENGTH = 0.8


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory):
    """The session's demo models, LoRAs and embeddings (hard links), plus the toy family registered
    for this module with its diffusers folder and demo LoRAs."""
    root = tmp_path_factory.mktemp("conformance")
    for sub in ("models/Stable-diffusion", "models/Lora", "models/ControlNet", "embeddings"):
        shutil.copytree(demo_dir / sub, root / sub, copy_function=os.link)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, toy_family.NAME, toy_family.toy_family())
        toy = build_tiny_pipeline(toy_family.NAME)
        toy.save_pretrained(root / "models/Stable-diffusion" / f"tiny-{toy_family.NAME}-diffusers")
        write_demo_loras(root / "models/Lora", toy, toy_family.NAME)
        yield root


@pytest.fixture(scope="module", params=CONFORMING)
def family_name(request, data) -> str:
    """Module-scoped, so pytest runs every test of one family before the next: each model loads once."""
    return request.param


@pytest.fixture(scope="module")
def plain(data):
    """fp32, nothing offloaded, strict forwards."""
    eng = Engine(Settings(data_dir=data, device="cpu", strict_forwards=True))
    yield eng
    eng.close()


def _moving(data, weights: str) -> Engine:
    """bf16 compute, weights resting in fp32 wherever a mode moves them: every move a real cast on the CPU."""
    return Engine(Settings(data_dir=data, device="cpu", dtype="bf16", rest_dtype="fp32", weights=weights, strict=True,
                           strict_forwards=True, history_size=1000))


@pytest.fixture(scope="module")
def moving(data):
    eng = _moving(data, "full")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def fp8(data):
    """As `moving`, the large weights stored in fp8 (loaded so: no reload per family)."""
    eng = _moving(data, "fp8")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def int8(data):
    """As `moving`, the large weights stored as int8 rows with a float32 scale each (issue 40)."""
    eng = _moving(data, "int8")
    yield eng
    eng.close()


def gguf_checkpoint(data, family_name: str) -> str:
    """The family's demo model written as an all-in-one `.gguf` (benchmarks/gguf_writer.py: Q8_0 and Q4_0
    where rows are whole blocks, the rest F32), on first use; its name under models/Stable-diffusion."""
    name = f"tiny-{family_name}-q.gguf"
    target = data / "models/Stable-diffusion" / name
    if not target.exists():
        pipe = build_tiny_pipeline(family_name)
        write_gguf(family(family_name).single_file_state(pipe), target, ("Q8_0", "Q4_0"),
                   component_configs(pipe, family_name))
    return name


@pytest.fixture(scope="module")
def fp8_compute(data):
    """As `fp8`, the qualifying Linear layers run as fp8 matmuls, their float32 scales moving with them."""
    eng = _moving(data, "fp8-compute")
    yield eng
    eng.close()


def checkpoint(family_name: str) -> str:
    single = "file" in family(family_name).files.layouts
    return f"tiny-{family_name}.safetensors" if single else f"tiny-{family_name}-diffusers"


def params(family_name: str, **changes) -> GenerateParams:
    fam = family(family_name)
    return GenerateParams(**{"prompt": "a red cube", "steps": 2, "width": 64, "height": 64, "seed": 7, "sampler":
                             fam.sampling.default_sampler, "cfg": fam.sampling.default_guidance, **changes})


def pixels(images) -> np.ndarray:
    return np.stack([np.asarray(i.image, dtype=np.int16) for i in images])


def _last_row(engine):
    """The history's last row: where `_rows_since` starts (the history is bounded, so a length is no mark)."""
    history = engine.snapshot().history
    return history[-1] if history else None


def _rows_since(engine, mark) -> tuple:
    """The history rows after `mark` (a `_last_row`), however many older rows the bound has dropped since."""
    history = engine.snapshot().history
    return history if mark is None else history[history.index(mark) + 1:]


def test_every_declared_layout_loads_the_saved_weights_bit_for_bit(data, family_name):
    """Single file (the family's own layout: LDM, ComfyUI's all-in-one) and diffusers folder give
    back every tensor of the tiny model that was written, in fp32, bit for bit, as the family's
    pipeline class, with the hash of the weights file, the bundled tokenizers' pad tokens and the
    parts the family leaves out (SD's safety checker) left out; `files` names the weights file first
    (the one whose hash is its "Model hash")."""
    fam, saved = family(family_name), build_tiny_pipeline(family_name)
    names = {"file": f"tiny-{family_name}.safetensors", "folder": f"tiny-{family_name}-diffusers"}
    for layout in fam.files.layouts:
        path = data / "models/Stable-diffusion" / names[layout]
        info = checkpoint_files.CheckpointInfo(path.name, path, layout, 0)
        loaded = models.load_pipeline(info, torch.float32)
        pipe = loaded.pipe
        assert pipe.family is fam and type(pipe) is fam.pipeline_class and loaded.family == family_name
        assert loaded.files[0] == checkpoint_files.weights_file(info)
        assert all(getattr(pipe, te.tokenizer).pad_token == te.pad_token for te in fam.text_encoders if te.pad_token)
        assert all(getattr(pipe, k, None) is None for k, v in fam.pipeline_kwargs.items() if v is None)
        for component, module in placement.torch_components(saved).items():
            mine, theirs = getattr(pipe, component).state_dict(), module.state_dict()
            assert mine.keys() == theirs.keys(), (layout, component)
            assert all(torch.equal(mine[k], theirs[k]) for k in mine), (layout, component)


def test_one_seed_one_image_and_the_guidance_reaches_the_model(plain, family_name):
    """Same seed, same pixels; another seed, other pixels; the infotext names the guidance as the
    family calls it; where the family has CFG or distilled guidance, another value changes the image;
    a family without a negative prompt (Flux) is not changed by one, and its infotext does not claim one."""
    fam = family(family_name)
    plain.load_model(checkpoint(family_name))
    first, again = plain.generate(params(family_name)), plain.generate(params(family_name))
    assert np.array_equal(pixels(first), pixels(again))
    assert not np.array_equal(pixels(first), pixels(plain.generate(params(family_name, seed=8))))
    assert f"{fam.sampling.guidance_label}: {fam.sampling.default_guidance:g}" in first[0].infotext
    if fam.sampling.distilled_guidance:  # as Forge writes it: no CFG runs
        assert f"CFG scale: 1, {fam.sampling.guidance_label}: {fam.sampling.default_guidance:g}" in first[0].infotext
    if fam.sampling.negative_prompt or fam.sampling.distilled_guidance:
        other = plain.generate(params(family_name, cfg=fam.sampling.default_guidance + 2.5))
        assert not np.array_equal(pixels(first), pixels(other)), "the guidance did not reach the model"
    if not fam.sampling.negative_prompt:
        negative = plain.generate(params(family_name, negative_prompt="blurry"))
        assert np.array_equal(pixels(first), pixels(negative))
        assert "\nNegative prompt: " not in negative[0].infotext and "blurry" not in negative[0].infotext


class _HostReads(TorchDispatchMode):
    """Counts `aten._local_scalar_dense`: a tensor read on the host (`.item()`, `bool()`, `float()`),
    which on a GPU waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_the_loop_reads_one_tensor_a_step_more_than_the_familys_own_pipeline(plain, family_name, monkeypatch):
    """Each host read of a tensor inside the denoising loop makes a GPU wait. Per step, our loop reads
    one tensor more than the family's own diffusers pipeline with the same scheduler does: the NaN
    check's flag. On CUDA that read waits on an event behind its own step (`tests/test_engine.py`,
    `-m gpu`); a read that drained the queue each step is the likely cause of FLUX.2 Klein running at
    0.98× of diffusers on an H100. Counted between a 2- and a 4-step run, so reads made once per
    generation (prompt encoding, decoding) cancel out."""
    from app.engine import generate

    fam = family(family_name)
    plain.load_model(checkpoint(family_name))
    reads: dict[str, _HostReads] = {}
    original = generate.denoise

    def counted(*args, **kwargs):
        with reads["ours"]:
            return original(*args, **kwargs)

    monkeypatch.setattr(generate, "denoise", counted)  # the engine's worker thread runs it: the mode is per thread

    def ours(steps: int) -> int:
        reads["ours"] = _HostReads()
        plain.generate(params(family_name, steps=steps))
        return reads["ours"].count

    theirs_pipe = build_tiny_pipeline(family_name)
    theirs_pipe.scheduler = generate.scheduler_for(theirs_pipe, fam.sampling.default_sampler)
    theirs_pipe.set_progress_bar_config(disable=True)

    def theirs(steps: int) -> int:
        mode = _HostReads()
        with mode, torch.no_grad():
            theirs_pipe(prompt="a red cube", num_inference_steps=steps, height=64, width=64, output_type="latent",
                        generator=torch.Generator().manual_seed(7), **fam.call_arguments(fam.sampling.default_guidance))
        return mode.count

    per_step_ours, per_step_theirs = (ours(4) - ours(2)) / 2, (theirs(4) - theirs(2)) / 2
    assert per_step_ours == per_step_theirs + 1, (per_step_ours, per_step_theirs)


def test_prompts_read_as_a1111_and_a_variation_seed_reach_the_model(plain, family_name):
    """Through the family's `TextEncoder` entries: `a (red:1.0) cube` is `a red cube` bit for bit and
    `(red:1.5)` changes the image (A1111's emphasis reaches its encoders); where the pipeline reads the
    prompt as text (`reads="text"`: Qwen3 on Klein) the weight is left out, the image is `a red cube`'s and a
    note says so. Through its txt2img class (`VariedNoise`): a variation seed at 0.5 changes the image, the
    same one again gives it again, and the infotext names it."""
    plain.load_model(checkpoint(family_name))
    first = pixels(plain.generate(params(family_name)))
    assert np.array_equal(first, pixels(plain.generate(params(family_name, prompt="a (red:1.0) cube"))))
    weighted = pixels(plain.generate(params(family_name, prompt="a (red:1.5) cube")))
    as_text = all(te.reads == "text" for te in family(family_name).text_encoders)
    assert np.array_equal(first, weighted) == as_text
    if as_text:
        notes = prompt_notes(family(family_name), "a (red:1.5) cube", "")
        assert len(notes) == 1 and "emphasis weights and BREAK have no effect" in notes[0]
    varied = plain.generate(params(family_name, subseed=8, subseed_strength=0.5))
    assert not np.array_equal(first, pixels(varied))
    assert np.array_equal(pixels(varied), pixels(plain.generate(params(family_name, subseed=8, subseed_strength=0.5))))
    assert "Variation seed: 8, Variation seed strength: 0.5" in varied[0].infotext


def test_a_refiner_finishes_where_the_family_takes_one_and_is_refused_elsewhere(plain, family_name):
    """Each family in `refiner_families` refines the family's txt2img from the switch point (its tiny
    checkpoint as the refiner, strict forwards on both models): every stage `ok`, zero violations, the
    infotext names the switch point. A family that names none refuses a refiner checkpoint, saying so."""
    fam = family(family_name)
    plain.load_model(checkpoint(family_name))
    if not fam.refiner_families:
        with pytest.raises(ValueError, match="have no refiner stage"):
            plain.generate(params(family_name, steps=4, refiner_checkpoint=checkpoint(family_name),
                                  refiner_switch_at=0.5))
        return
    for refiner in fam.refiner_families:
        mark = _last_row(plain)
        made = plain.generate(params(family_name, steps=4, refiner_checkpoint=checkpoint(refiner),
                                     refiner_switch_at=0.5))
        rows = _rows_since(plain, mark)
        assert [r.command for r in rows] == ["txt2img", "refiner load", "refiner", "refiner unload"], rows
        assert all(r.outcome == "ok" and r.violations_found == 0 for r in rows), rows
        assert "Refiner switch at: 0.5" in made[0].infotext


def test_a_peft_lora_written_by_peft_fuses_to_the_formula_and_comes_off_bit_for_bit(plain, family_name, data):
    """peft itself wraps the denoiser's linear layers among the family's LoRA targets and diffusers
    saves them (alpha in `lora_adapter_metadata`): applied at 0.8 each weight is W0 + 0.8·(α/r)·B·A,
    and removing it gives back every tensor bit for bit."""
    peft = pytest.importorskip("peft")
    fam = family(family_name)
    source = build_tiny_pipeline(family_name)
    denoiser = getattr(source, fam.denoiser)
    targets = [path for path, module in denoiser.named_modules() if isinstance(module, torch.nn.Linear)
               and any(fnmatch.fnmatchcase(f"{fam.denoiser}.{path}", glob) for glob in fam.test_kit.lora_targets)]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft.inject_adapter_in_model(config, denoiser)
    name = f"peft-{family_name}"
    type(source).save_lora_weights(data / "models/Lora", weight_name=f"{name}.safetensors", **{
        f"{fam.denoiser}_lora_layers": peft.get_peft_model_state_dict(denoiser),
        f"{fam.denoiser}_lora_adapter_metadata": config.to_dict()})
    plain.load_model(checkpoint(family_name))
    pipe = plain.pipeline
    before, digests = {p: getattr(pipe, fam.denoiser).get_submodule(p).weight.detach().clone() for p in targets}, \
        adapter_state_digests(pipe)
    plain.set_loras([LoraSpec(name, STRENGTH)])
    lora = {p: (denoiser.get_submodule(p).lora_A["default"].weight, denoiser.get_submodule(p).lora_B["default"].weight)
            for p in targets}
    for path, w0 in before.items():
        a, b = lora[path]
        torch.testing.assert_close(getattr(pipe, fam.denoiser).get_submodule(path).weight.detach(),
                                   w0 + STRENGTH * (8 / 4) * b.detach() @ a.detach(), rtol=1e-5, atol=1e-6)
    plain.set_loras([])
    assert adapter_state_digests(pipe) == digests


def test_the_compiled_denoiser_draws_the_eager_latents_and_loras_do_not_recompile(family_name, data):
    """The compiled path (`app/engine/compiled.py`: torch.compile of the family's denoiser; here dynamo
    with its `eager` backend, inductor on a GPU) gives the eager latents bit for bit; the demo style
    LoRA fused in changes them and fused out restores them, without a new graph (fusing writes in
    place, so dynamo's guards hold)."""
    fam = family(family_name)
    pipe = fam.pipeline_class(**build_tiny_pipeline(family_name).components)
    request = params(family_name)

    def run() -> torch.Tensor:
        return denoise(pipe, request, request.seed, width=request.width, height=request.height)

    eager = run()
    state = compiled.enable(pipe, backend="eager", background=False, device="cpu")
    try:
        assert torch.equal(run(), eager)
        graphs = state.compiles
        assert graphs >= 1
        name = f"demo-style-{family_name}"
        files = {name: read_adapter(name, data / "models/Lora" / f"{name}.safetensors")}
        stack = LoraStack(pipe, family_name)
        stack.reconcile([LoraSpec(name, STRENGTH)], files)
        assert not torch.equal(run(), eager)
        stack.reconcile([], files)
        assert torch.equal(run(), eager) and state.compiles == graphs
    finally:
        compiled.disable(pipe)


def test_every_offload_mode_with_rest_dtype_other_than_compute_dtype(moving, family_name):
    """bf16 compute, fp32 rest, a LoRA on the denoiser and a text encoder, strict forwards on: every
    mode draws the same image (model and balanced bit for bit; within three grey levels on average
    where streamed modes leave neighbours at rest in fp32, or `none` fuses the LoRA into bf16 where
    the others add it as a bypass), with zero violations and each module carrying exactly its mode's
    hooks. Pinned tensors stay in their dtype, bit for bit. A streamed mode's second generation draws
    its first's image bit for bit: by then group offload copies the block that runs next ahead (learned
    in the first), which once left Klein's tied `lm_head` weight at rest. (Not balanced: its first
    generation reads the resting fp32 where the pipeline asks a component's dtype before onloading it.)"""
    moving.load_model(checkpoint(family_name))
    moving.set_loras([LoraSpec(f"demo-style-{family_name}", 1.0)])
    pinned = {(c, p, n): t.clone() for c, p, _m, n, t, _ in placement.iter_tensors(moving.pipeline)
              if family(family_name).pinned_dtype(c, p, n)}
    images = {}
    for mode in offload.MODES:
        snap = moving.set_offload(mode)
        images[mode] = pixels(moving.generate(params(family_name)))
        if offload.MODES[mode].streams_weights:
            assert np.array_equal(pixels(moving.generate(params(family_name))), images[mode]), mode
        snap = moving.snapshot()
        assert snap.violations == () and snap.violations_found_total == 0, (mode, snap.violations)
        bypassed = set(moving.lora_stack.bypassed())
        assert actual_hooks(snap) == expected_hooks(moving.pipeline, mode, bypassed, strict=True), mode
        current = {(c, p, n): t for c, p, _m, n, t, _ in placement.iter_tensors(moving.pipeline)}
        assert all(current[k].dtype == v.dtype and torch.equal(current[k], v) for k, v in pinned.items()), mode
    assert np.array_equal(images["model"], images["balanced"])
    for mode, image in images.items():  # `none` fuses the LoRA into bf16 weights, the others add it as a bypass
        assert np.abs(image - images["model"]).mean() < 3.0, mode
    moving.set_offload("none")
    moving.set_loras([])


STORED_DTYPES = (placement.STORAGE_DTYPES["fp8"], torch.int8, torch.uint8)  # fp8, int8, GGUF's packed bytes
_STORAGE_ENGINES = {"fp8": "fp8", "fp8-compute": "fp8_compute", "int8": "int8", "gguf": "moving"}


@pytest.mark.parametrize("weights", ["fp8", "fp8-compute", "int8", "gguf"])
def test_fp8_storage_keeps_its_bytes_and_draws_the_same_image_in_whole_and_streamed_modes(weights, family_name, request,
                                                                                         data):
    """fp8 weights with a LoRA (a bypass: nothing is fused into 8 bits): the family's sensitive layers
    (`high_precision`) stay in bf16; with nothing moved, whole components moved and blocks streamed,
    the image is the same within rounding, the stored bytes never change, zero violations. With
    fp8-compute (issue 41) the same, its fp8-matmul layers' float32 scales unchanged too. int8 and GGUF
    (issue 40) the same in every offload mode: int8 rows with their float32 scales; a DiT family's GGUF
    file's packed layers (the file chose them, sensitive ones included where their rows fit)."""
    if weights == "gguf" and not family(family_name).files.parts:
        pytest.skip(f"{family(family_name).label} is not assembled from parts: .gguf files are refused for it")
    fp8 = request.getfixturevalue(_STORAGE_ENGINES[weights])
    snap = fp8.load_model(gguf_checkpoint(data, family_name) if weights == "gguf" else checkpoint(family_name))
    assert snap.stored_layers > 0
    assert (snap.matmul_layers > 0) == (snap.weights == "fp8-compute")
    # a GGUF file packs the denoiser only: a LoRA's text-encoder layers (Qwen-Image's demo LoRA has some) fuse
    # into the encoder's full-precision weights; the packed bytes below still never change
    modes = ("bypass", "bypass + fused") if weights == "gguf" else ("bypass",)
    assert fp8.set_loras([LoraSpec(f"demo-style-{family_name}", 0.8)]).lora_mode in modes
    stored = {f"{c}.{p}": t.clone() for c, p, _m, n, t, _ in placement.iter_tensors(fp8.pipeline)
              if t.dtype in STORED_DTYPES and n == "weight"}
    scales = {f"{c}.{p}": t.clone() for c, p, _m, n, t, _ in placement.iter_tensors(fp8.pipeline)
              if n == fp8_matmul.SCALE}
    sensitive = () if weights == "gguf" else family(family_name).precision.high_precision
    assert len(stored) == snap.stored_layers and not [k for k in stored if set(k.split(".")) & set(sensitive)]
    assert len(scales) == (snap.stored_layers if weights == "int8" else snap.matmul_layers)
    assert all(t.dtype == torch.float32 for t in scales.values())
    images = {}
    for mode in ("none", "model", "group") if weights.startswith("fp8") else OFFLOAD_CHOICES:
        fp8.set_offload(mode)
        images[mode] = pixels(fp8.generate(params(family_name)))
        assert fp8.snapshot().violations_found_total == 0, mode
    now = {f"{c}.{p}": t for c, p, _m, n, t, _ in placement.iter_tensors(fp8.pipeline)
           if t.dtype in STORED_DTYPES and n == "weight"}
    assert now.keys() == stored.keys() and all(torch.equal(now[k].view(torch.uint8), v.view(torch.uint8))
                                               for k, v in stored.items())
    now = {f"{c}.{p}": t for c, p, _m, n, t, _ in placement.iter_tensors(fp8.pipeline) if n == fp8_matmul.SCALE}
    assert now.keys() == scales.keys() and all(torch.equal(now[k], v) for k, v in scales.items())
    # within three grey levels, as in the offload test: streamed modes run the first step on fp32 latents
    # (diffusers casts the prompt embeddings to `text_encoder.dtype`, read from a weight resting in fp32)
    assert all(np.abs(image - images["none"]).mean() < 3.0 for image in images.values())
    fp8.set_offload("none")
    fp8.set_loras([])


def test_img2img_and_inpaint_run_where_the_family_declares_them(moving, family_name):
    """Each stage pipeline the family declares runs with weights resting in fp32, whole components
    moved and leaves or blocks streamed, strict forwards on: every transition `ok`, zero violations
    (tests/test_workflows.py runs the stages in every mode in fp32 and bf16). A workflow the family
    declares no stage pipeline for is refused by name, before anything runs."""
    fam = family(family_name)
    stages = fam.stage_pipelines
    moving.load_model(checkpoint(family_name))
    image, mask = Image.new("RGB", (64, 64), (40, 120, 200)), Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    if "img2img" not in stages:
        with pytest.raises(ValueError, match=f"is not available for {re.escape(fam.label)} models"):
            moving.img2img(params(family_name), [image], denoising_strength=0.7)
    if "inpaint" not in stages:
        with pytest.raises(ValueError, match=f"is not available for {re.escape(fam.label)} models"):
            moving.inpaint(params(family_name), image, mask, denoising_strength=0.9)
    if not stages:
        return
    for mode in ("model", "sequential", "group"):
        moving.set_offload(mode)
        mark = _last_row(moving)
        if "img2img" in stages:
            assert moving.img2img(params(family_name), [image], denoising_strength=0.7)[0].image.size == (64, 64)
        if "inpaint" in stages:
            assert moving.inpaint(params(family_name), image, mask, denoising_strength=0.9)[0].image.size == (64, 64)
        rows = _rows_since(moving, mark)
        assert rows and all(row.outcome == "ok" and row.violations_found == 0 for row in rows), (mode, rows)
    moving.set_offload("none")


def test_the_detail_pass_runs_in_every_offload_mode_where_the_family_inpaints(moving, family_name):
    """The detail pass (app/engine/detailing.py) on a picture as it is (skip img2img), weights resting in fp32
    and computing in bf16, strict forwards on, in every offload mode: its detect, encode and detail stages
    `ok` with zero violations, and every pixel outside the blurred mask the picture's bit for bit. A family
    without an inpaint stage refuses it by name before anything runs."""
    moving.load_model(checkpoint(family_name))
    picture, box = Image.new("RGB", (64, 64), (40, 120, 200)), (24, 24, 40, 40)
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, box)
    unit = DetailPass("box", lambda image: ([mask], ""), width=64, height=64, denoising_strength=0.5, mask_blur=2)
    details = DetailParams((unit,), skip_img2img=True)
    if "inpaint" not in family(family_name).stage_pipelines:
        with pytest.raises(ValueError, match=f"{family(family_name).label} models cannot"):
            moving.img2img(params(family_name), [picture], details=details)
        return
    outside = np.asarray(mask.filter(ImageFilter.GaussianBlur(2))) == 0
    for mode in offload.MODES:
        moving.set_offload(mode)
        mark = _last_row(moving)
        out = moving.img2img(params(family_name, steps=2), [picture], details=details)[0].image
        rows = _rows_since(moving, mark)
        assert [r.command for r in rows] == ["detail detect", "detail encode", "detail"], (mode, rows)
        assert all(row.outcome == "ok" and row.violations_found == 0 for row in rows), (mode, rows)
        assert np.array_equal(np.asarray(out)[outside], np.asarray(picture)[outside]), mode
    moving.set_offload("none")


def test_controlnet_in_every_offload_mode_with_fp8_storage_and_a_lora(moving, fp8, family_name):
    """Every family declaring ControlNet support (`Family.controlnet`), with its tiny demo ControlNet: bf16
    compute, fp32 rest, a LoRA (fused under `none`, a bypass elsewhere), strict forwards and strict mode on.
    In every offload mode the unit changes the image, the stack is a planned component whose every module
    carries exactly its mode's hooks, zero violations, and the image is the same as in the other modes (model
    and balanced bit for bit, the others within three grey levels on average, as without ControlNet). With
    fp8 storage the ControlNet's own large weights rest in fp8 too, their bytes unchanged by generations in
    whole-component and streamed modes, with zero violations."""
    if family(family_name).controlnet is None:
        pytest.skip(f"{family(family_name).label} declares no ControlNet support")
    unit = ControlUnit(f"tiny-{family_name}-controlnet", Image.fromarray(
        np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)))
    moving.load_model(checkpoint(family_name))
    moving.set_loras([LoraSpec(f"demo-style-{family_name}", 1.0)])
    images = {}
    for mode in offload.MODES:
        moving.set_offload(mode)
        images[mode] = pixels(moving.generate(params(family_name, controlnet_units=(unit,))))
        snap = moving.snapshot()
        assert snap.violations == () and snap.violations_found_total == 0, (mode, snap.violations)
        assert "controlnet" in moving.placement_plan.components and any(r.component == "controlnet"
                                                                          for r in snap.placement)
        bypassed = set(moving.lora_stack.bypassed())
        assert actual_hooks(snap) == expected_hooks(moving.pipeline, mode, bypassed, strict=True), mode
    assert not np.array_equal(images["none"], pixels(moving.generate(params(family_name))))
    assert np.array_equal(images["model"], images["balanced"])
    assert all(np.abs(image - images["model"]).mean() < 3.0 for image in images.values())
    moving.set_offload("none")
    moving.set_loras([])
    fp8.load_model(checkpoint(family_name))
    fp8.generate(params(family_name, controlnet_units=(unit,), steps=1))
    stored = {(p, n): t.clone() for c, p, _m, n, t, _ in placement.iter_tensors(fp8.pipeline)
              if c == "controlnet" and t.dtype == placement.STORAGE_DTYPES["fp8"]}
    assert stored
    for mode in ("none", "model", "group"):
        fp8.set_offload(mode)
        fp8.generate(params(family_name, controlnet_units=(unit,)))
        assert fp8.snapshot().violations_found_total == 0, mode
    now = {(p, n): t for c, p, _m, n, t, _ in placement.iter_tensors(fp8.pipeline) if c == "controlnet"}
    assert all(torch.equal(now[k].view(torch.uint8), v.view(torch.uint8)) for k, v in stored.items())
    fp8.set_offload("none")
    for eng in (moving, fp8):  # the suite's later tests see the model as they always did
        eng.unload_controlnets()
        assert "controlnet" not in eng.placement_plan.components


def test_embeddings_load_without_shrinking_a_table(plain, family_name):
    """A family that takes embeddings loads the demo's (one vector pair per text encoder) and every
    embedding table keeps its rows: T5's 32,128 rows exceed its tokenizer's 32,100 tokens, and
    resizing to the tokenizer used to cut the spare rows off."""
    fam = family(family_name)
    snap = plain.load_model(checkpoint(family_name))
    if not fam.files.takes_embeddings:
        assert snap.embeddings == ()
        return
    assert snap.embeddings, "the demo embedding did not load"
    fresh = build_tiny_pipeline(family_name)
    for te in fam.text_encoders:
        rows = getattr(plain.pipeline, te.component).get_input_embeddings().weight.shape[0]
        original = getattr(fresh, te.component).get_input_embeddings().weight.shape[0]
        assert rows == max(original, len(getattr(plain.pipeline, te.tokenizer))), te.component


def test_every_floating_tensor_takes_the_new_dtype_after_a_dtype_change(plain, family_name):
    """Checked against the request, not against the placement plan (the engine's own verify compares with the
    plan, so a plan that forgot a component would agree with itself): after each dtype change (fp32 -> bf16 ->
    fp32, nothing offloaded, nothing stored in 8 bits) every floating tensor of every component, parameters and
    buffers, is in the new dtype, the family's pinned ones in their own. (The documented exception, the VAE of
    a family that upcasts in fp16, never applies on the CPU, where fp16 runs as fp32.)"""
    fam = family(family_name)
    plain.load_model(checkpoint(family_name))
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        plain.set_dtype(name)
        wrong = [f"{c}.{p}.{n} is {t.dtype}" for c, p, _m, n, t, _ in placement.iter_tensors(plain.pipeline)
                 if t.is_floating_point() and t.dtype != (fam.pinned_dtype(c, p, n) or dtype)]
        assert wrong == [], name


def test_interrupt_stops_between_steps_and_keeps_the_partial_image(plain, family_name):
    """A user's Interrupt lands within two steps of the request in every family's loop (its own pipeline
    class runs the steps), keeps the image of the last whole step, and leaves the engine READY."""
    plain.load_model(checkpoint(family_name))
    job = Running(plain, params(family_name, steps=150))
    asked_at = job.wait_for_step(2)
    assert plain.interrupt(owner="tab-1")
    job.join()
    (image,) = job.result
    assert not image.complete and asked_at <= image.stopped_at <= asked_at + 2, (asked_at, image.stopped_at)
    assert plain.snapshot().state == "READY" and plain.snapshot().history[-1].outcome == "interrupted"


def test_diagnostics_and_the_bug_report_render(plain, family_name, data):
    """The Diagnostics tab's tables and the bug report (zip with its PNG card) render for the family."""
    snap = plain.load_model(checkpoint(family_name))
    assert snap.family == family_name
    assert views.component_rows(snap) and views.module_rows(snap) and views.status_html(snap)
    with zipfile.ZipFile(io.BytesIO(build_bug_report(plain, plain.settings))) as bundle:
        assert sorted(bundle.namelist()) == ["card.png", "report.json"]


def test_strict_forwards_catch_a_group_hook_on_a_module_whose_forward_never_runs(moving, monkeypatch):
    """The rule group offload had: every non-ModuleList child is a group. On the toy's ModuleDict it
    hooks the dict, whose forward never runs, so its Linear computes with its weight at rest (fp32
    beside bf16 activations; on a GPU, a CPU weight beside CUDA inputs). Strict forwards name it."""
    def old_rule(component):
        groups = []
        for child in component.children():
            groups.extend(child) if isinstance(child, torch.nn.ModuleList) else groups.append(child)
        return groups

    moving.load_model(checkpoint(toy_family.NAME))
    monkeypatch.setattr(offload, "blocks", old_rule)
    moving.set_offload("group")
    with pytest.raises(StrictForwardError, match=r"unet\.context_in\.text\.weight is cpu/fp32"):
        moving.generate(params(toy_family.NAME))
    monkeypatch.undo()
    moving.set_offload("none")
