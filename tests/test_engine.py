"""The engine state machine: transitions, history, rollback, placement repair, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import FAST

from app.demo import build_tiny_pipeline
from app.engine import placement
from app.engine.checkpoint_files import ModelLoadError
from app.engine.generate import GenerateParams
from app.engine.worker import Engine, EngineState
from app.families import family
from app.settings import Settings


def _pixels(result) -> np.ndarray:
    return np.asarray(result[0].image)


def test_each_transition_records_a_history_row(engine):
    """Every public command runs as one transition with its working state, outcome and timing."""
    assert engine.snapshot().state == EngineState.EMPTY.value
    engine.load_model("tiny-sd15.safetensors")
    engine.set_dtype("bf16")
    engine.set_offload("none")
    engine.set_loras([])
    engine.generate(GenerateParams("a cat", seed=1, **FAST))
    snap = engine.unload()
    rows = [(h.command, h.state, h.outcome) for h in snap.history]
    assert rows == [
        ("load_model", "LOADING", "ok"),
        ("set_dtype", "LOADING", "ok"),
        ("set_offload", "MOVING", "ok"),
        ("set_loras", "PATCHING", "ok"),
        ("generate", "GENERATING", "ok"),
        ("unload", "MOVING", "ok"),
    ]
    assert all(h.duration_s >= 0 and h.started > 0 for h in snap.history)
    assert snap.state == EngineState.EMPTY.value and snap.model is None


def test_a_snapshot_that_shows_a_job_ended_shows_its_history_row(engine, monkeypatch):
    """A client polls until `generating` is false, then reads how the job ended: that row must be
    there already (it was the previous job's row while the worker was still recording this one). The
    recording is slowed down so a snapshot taken in the middle of it is certain to be seen."""
    import threading
    import time

    engine.load_model("tiny-sd15.safetensors")
    sample = engine.timeline.sample
    monkeypatch.setattr(engine.timeline, "sample", lambda name: (time.sleep(0.3), sample(name)))
    job = threading.Thread(target=engine.generate, args=(GenerateParams("a cat", seed=1, **FAST),))
    job.start()
    while not engine.snapshot().generating:
        assert job.is_alive(), "the generation ended before it was seen running"
        time.sleep(0.001)
    while (snap := engine.snapshot()).generating:
        time.sleep(0.001)
    job.join()
    assert snap.history[-1].command == "generate" and snap.progress is None


def test_failed_load_of_corrupt_file_keeps_previous_model(engine, data_dir):
    """A corrupt checkpoint fails in LOADING; the previous model stays loaded, READY and usable."""
    engine.load_model("tiny-sd15.safetensors")
    before = {k: v.clone() for k, v in engine.pipeline.unet.state_dict().items()}
    bad = data_dir / "models" / "Stable-diffusion" / "broken.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": broken json}")
    with pytest.raises(ModelLoadError, match="broken.safetensors"):
        engine.load_model("broken.safetensors")
    snap = engine.snapshot()
    assert snap.state == EngineState.READY.value
    assert snap.model == "tiny-sd15.safetensors"
    assert snap.history[-1].outcome == "failed, rolled back"
    assert "broken.safetensors" in snap.last_error.message
    after = engine.pipeline.unet.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(engine.generate(GenerateParams("a cat", seed=3, **FAST))) == 1


def test_injected_dtype_and_stray_buffer_are_repaired_before_generation(engine):
    """verify() finds a weight cast to another dtype and a stray float64 buffer; the engine repairs
    both before denoising, counts them in the history row and the snapshot, and generation runs."""
    engine.load_model("tiny-sd15.safetensors")
    unet = engine.pipeline.unet
    proj = unet.get_submodule("down_blocks.0.attentions.0.proj_in")
    param_id = id(proj.weight)
    proj.weight.data = proj.weight.data.to(torch.bfloat16)
    unet.get_submodule("conv_in").register_buffer("stray", torch.ones(3, dtype=torch.float64))
    result = engine.generate(GenerateParams("a cat", seed=5, **FAST))
    assert len(result) == 1
    snap = engine.snapshot()
    row = snap.history[-1]
    assert row.command == "generate" and row.outcome == "ok"
    assert row.violations_found == 2 and row.violations_repaired == 2
    assert snap.violations_found_total == 2
    assert proj.weight.dtype == torch.float32 and id(proj.weight) == param_id
    assert unet.get_submodule("conv_in").stray.dtype == torch.float32


def test_snapshot_lists_every_violation_it_found(engine):
    """The snapshot names the component, module, tensor, expected and actual placement."""
    engine.load_model("tiny-sd15.safetensors")
    vae = engine.pipeline.vae
    vae.get_submodule("decoder.conv_out").bias.data = vae.get_submodule("decoder.conv_out").bias.data.double()
    snap = engine.set_loras([])
    (v,) = snap.violations
    assert (v.component, v.module, v.tensor) == ("vae", "decoder.conv_out", "bias")
    assert v.expected == "cpu/fp32" and v.actual == "cpu/float64"
    flagged = [r for r in snap.placement if r.violation]
    assert [(r.component, r.module) for r in flagged] == [("vae", "decoder.conv_out")]


def test_batch_image_i_equals_single_image_with_seed_plus_i(engine):
    """Image i of a batch uses seed+i, so any image of a batch can be reproduced alone."""
    engine.load_model("tiny-sd15.safetensors")
    batch = engine.generate(GenerateParams("a cat", seed=7, batch=2, **FAST))
    single = engine.generate(GenerateParams("a cat", seed=8, **FAST))
    assert [r.seed for r in batch] == [7, 8]
    assert np.abs(np.asarray(batch[1].image, dtype=int) - _pixels(single).astype(int)).max() <= 1


def test_png_carries_a1111_infotext(engine):
    """Saved PNGs hold the `parameters` text other tools read."""
    from PIL import Image

    engine.load_model("tiny-sd15.safetensors")
    (img,) = engine.generate(GenerateParams("a red cube", negative_prompt="blurry", seed=11, **FAST))
    text = Image.open(img.path).info["parameters"]
    assert text.startswith("a red cube\nNegative prompt: blurry\nSteps: 2, Sampler: Euler, CFG scale: 5")
    assert "Seed: 11" in text and "Size: 64x64" in text and "Model: tiny-sd15.safetensors" in text


def _zlib_level_class(path) -> int:
    """FLEVEL of the first IDAT's zlib header: 0 = levels 0-1, 1 = 2-5, 2 = 6, 3 = 7-9 (RFC 1950)."""
    data = path.read_bytes()
    idat = data.index(b"IDAT") + 4
    return data[idat + 1] >> 6


@pytest.mark.parametrize(("level", "flevel"), [(None, 1), (1, 0), (9, 3)])
def test_saved_pngs_use_the_compression_level_asked(data_dir, level, flevel):
    """The PNG write sits on the worker's path to the next image: a real 1024² image takes ~5x longer at
    PIL's default level 6 than at 1. Generations save at `Settings.png_compress_level` (default 4: ~2.5x
    faster than 6, ~1% larger), and `--png-compression` reaches the file."""
    eng = Engine(Settings(data_dir=data_dir, device="cpu", **({} if level is None else {"png_compress_level": level})))
    try:
        eng.load_model("tiny-sd15.safetensors")
        (img,) = eng.generate(GenerateParams("a red cube", seed=11, **FAST))
        assert _zlib_level_class(img.path) == flevel
    finally:
        eng.close()


def test_png_compression_out_of_range_is_refused():
    with pytest.raises(ValueError, match="PNG compression level is 0 .none. to 9"):
        Settings(png_compress_level=10)


@pytest.mark.parametrize("model", ["tiny-sd15.safetensors", "tiny-sdxl.safetensors"])
def test_embedding_in_bf16_text_encoder(engine, model):
    """A textual-inversion embedding is cast to a bf16 encoder's dtype and used in generation."""
    engine.load_model(model, dtype="bf16")
    snap = engine.snapshot()
    assert snap.dtype == "bf16" and snap.embeddings
    token = snap.embeddings[0]
    te = engine.pipeline.text_encoder
    assert te.get_input_embeddings().weight.dtype == torch.bfloat16
    out = engine.generate(GenerateParams(f"a photo of {token}", seed=2, **FAST))
    assert out and not snap.violations


def test_vae_upcasts_only_where_diffusers_does(engine):
    """The VAE runs in fp32 only for SDXL in fp16 with `force_upcast` (its fp16 decode overflows),
    as diffusers' SDXL pipeline does; in bf16, and for SD1.5 (whose pipeline never upcasts), it
    computes in the model's dtype, so it takes no second cast at load and no fp32 memory."""
    cuda = torch.device("cuda")  # a plan is data: it can name a GPU on a machine without one
    for family_name, dtype, vae_dtype in (("sdxl", torch.float16, torch.float32),
                                          ("sdxl", torch.bfloat16, torch.bfloat16),
                                          ("sd15", torch.float16, torch.float16)):
        pipe = build_tiny_pipeline(family_name)
        pipe.family = family(family_name)
        assert pipe.vae.config.force_upcast
        plan = placement.plan_placement(pipe, dtype, cuda, "none", moves_weights=False)
        assert (plan.expected("vae").dtype, plan.expected("unet").dtype) == (vae_dtype, dtype), family_name
    engine.load_model("tiny-sdxl.safetensors", dtype="bf16")
    assert {p.dtype for p in engine.pipeline.vae.parameters()} == {torch.bfloat16}
    assert engine.generate(GenerateParams("a cat", seed=1, **FAST))


def test_fp16_request_on_cpu_becomes_fp32(engine):
    """Nothing runs in Half on the CPU (LayerNorm/conv kernels): fp16 there is stored as fp32."""
    snap = engine.load_model("tiny-sd15.safetensors", dtype="fp16")
    assert snap.dtype == "fp32" and snap.requested_dtype == "fp16"


def test_bad_choices_are_refused_before_queueing(engine):
    """Unknown dtype/offload names fail at once with the list of valid choices."""
    with pytest.raises(ValueError, match="dtype must be one of"):
        engine.set_dtype("int8")
    with pytest.raises(ValueError, match="offload must be one of"):
        engine.set_offload("turbo")
    assert engine.snapshot().history == ()


@pytest.mark.gpu
def test_gpu_cpu_bias_is_repaired_before_it_can_raise(gpu_data_dir):
    """The SD.Next #3614 state (a CPU bias beside a CUDA weight) is repaired before denoising."""
    eng = Engine(Settings(data_dir=gpu_data_dir, device="cuda"))
    try:
        snap = eng.load_model("tiny-sd15.safetensors")
        assert snap.dtype == "bf16"  # auto on an H100
        for module in eng.pipeline.unet.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.data = module.bias.data.cpu()
        out = eng.generate(GenerateParams("a cat", seed=1, **FAST))
        assert out and eng.snapshot().history[-1].violations_repaired > 0
        assert all(p.device.type == "cuda" for p in eng.pipeline.unet.parameters())
    finally:
        eng.close()


def test_strict_mode_fails_the_command_that_meets_a_violation(engine):
    """Strict mode: a violation found before a command fails that command (after repairing it)."""
    engine.load_model("tiny-sd15.safetensors")
    engine.set_debug(strict=True)
    conv = engine.pipeline.unet.get_submodule("conv_in")
    conv.bias.data = conv.bias.data.double()
    with pytest.raises(Exception, match="strict mode: 1 placement violations before generate"):
        engine.generate(GenerateParams("a cat", seed=1, **FAST))
    snap = engine.snapshot()
    assert snap.state == EngineState.READY.value and snap.history[-1].outcome == "failed, rolled back"
    assert conv.bias.dtype == torch.float32  # repaired all the same
    engine.set_debug(strict=False)
    assert engine.generate(GenerateParams("a cat", seed=1, **FAST))


def test_failed_undo_enters_error_and_a_load_recovers(engine, monkeypatch):
    """When a command fails and its undo fails too, the engine says ERROR (not READY); loading a
    model is the way out."""
    from app.engine import placement

    engine.load_model("tiny-sd15.safetensors")
    real_apply = placement.apply_plan

    def broken_apply(*_args, **_kwargs):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(placement, "apply_plan", broken_apply)
    with pytest.raises(RuntimeError, match="simulated device failure|could not put the model back"):
        engine.set_offload("model")
    snap = engine.snapshot()
    assert snap.state == EngineState.ERROR.value
    assert snap.history[-1].outcome == "failed, engine in ERROR"
    monkeypatch.setattr(placement, "apply_plan", real_apply)
    assert engine.load_model("tiny-sd15.safetensors").state == EngineState.READY.value


def test_compile_setting_on_cpu_stays_eager_with_a_note(data_dir):
    """`--compile` where inductor cannot run (CPU) keeps the engine working in eager mode and says why
    in the snapshot, instead of failing the load."""
    eng = Engine(Settings(data_dir=data_dir, device="cpu", compile=True))
    try:
        snap = eng.load_model("tiny-sd15.safetensors")
        assert snap.compile is not None and snap.compile.phase == "eager" and snap.compile.note
        assert eng.generate(GenerateParams("a cat", seed=1, **FAST))
        assert eng.snapshot().compile.compiles == 0
    finally:
        eng.close()


@pytest.mark.gpu
def test_gpu_out_of_memory_is_reported_and_the_engine_stays_ready(gpu_data_dir):
    """An oversized batch runs out of GPU memory inside denoising: the engine frees what it can, says
    what to try instead, stays READY with the weights unchanged, and the next normal generation
    succeeds. An 80 GB card holds even 2048² × 16, so the process is capped to a sliver of it first."""
    import torch
    from weight_digest import weights_digest

    # A budget past the card's memory: the default (half of it) refuses this batch before it runs.
    eng = Engine(Settings(data_dir=gpu_data_dir, device="cuda", memory_budget_gib=4096))
    try:
        eng.load_model("tiny-sd15.safetensors")
        digest = weights_digest(eng.pipeline)
        free, total = torch.cuda.mem_get_info()
        used = torch.cuda.memory_allocated()
        torch.cuda.set_per_process_memory_fraction(min(1.0, (used + 256 * 2**20) / total))
        try:
            # 2048² is a 256² latent: self-attention over 65,536 tokens for 32 images (batch 16 × CFG).
            huge = GenerateParams("a cat", steps=1, width=2048, height=2048, batch=16, sampler="Euler", seed=1)
            with pytest.raises(MemoryError, match="out of GPU memory .* smaller batch or size, or an offload mode"):
                eng.generate(huge)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        snap = eng.snapshot()
        assert snap.state == EngineState.READY.value and snap.history[-1].outcome == "failed, rolled back"
        assert weights_digest(eng.pipeline) == digest
        assert eng.generate(GenerateParams("a cat", seed=1, **FAST))
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("read", ["finite flag", "preview"])
def test_a_step_callbacks_host_read_waits_for_that_step_alone(read):
    """The NaN check's flag and the live preview's pixels, taken at step k, are read on the host at step
    k+1 (`HostRead`), so a GPU never idles waiting for the CPU: the read waits for step k's work, not for
    what was queued after it. `bool(flag)` and `.cpu()` waited for everything queued (their copy goes
    behind it), so a step began from an empty queue (Klein ran at 0.98× of diffusers' it/s on an H100;
    1.00× once the flag was read so). Here about a second of matmuls is queued before the read."""
    import time

    from app.engine.generate import _FiniteWatch
    from app.engine.host_read import HostRead
    from app.preview import pictures, preview_pixels

    latents = torch.ones(1, 16, 128, 128, device="cuda")
    a, out = torch.randn(8192, 8192, device="cuda"), torch.empty(8192, 8192, device="cuda")
    watch = _FiniteWatch(2)
    if read == "finite flag":  # through the loop's own check: observing step 2 reads step 1's flag
        watch.observe(1, latents)
        read_it = lambda: watch.observe(2, latents)  # noqa: E731
    else:  # the preview's pixels as the step callback takes them
        taken = HostRead(preview_pixels(latents, "flux-dev"))
        read_it = lambda: pictures(taken.value())  # noqa: E731
    for _ in range(40):
        torch.mm(a, a, out=out)  # step 2's work
    started = time.perf_counter()
    value = read_it()
    waited = time.perf_counter() - started
    torch.cuda.synchronize()
    queued = time.perf_counter() - started
    assert queued > 0.1 and waited < queued / 10, (waited, queued)
    if read == "preview":
        assert value[0].size == (128, 128)
    watch.settle()  # step 2's flag: finite


def test_embedding_notes_are_said_once_and_only_where_relevant(data_dir, caplog):
    """A shared embeddings folder: another family's files are skipped without a log line on every load (A1111
    skips them silently), and a file that no family reads is noted once, naming its tensors, not on each load."""
    import logging

    from safetensors.torch import save_file

    from app.engine import embeddings

    folder = data_dir / "embeddings"
    save_file({"weird": torch.zeros(2, 32)}, str(folder / "junk.safetensors"))
    assert {p.name for p in folder.glob("*.safetensors")} > {"tiny-sdxl-embedding.safetensors", "junk.safetensors"}
    caplog.set_level(logging.INFO, logger="app.engine.embeddings")
    noted: set = set()
    for _load in range(2):  # two model loads, each on a fresh pipeline
        assert embeddings.load_all(build_tiny_pipeline("sd15"), "sd15", folder, noted) == ("tiny-sd15-embedding",)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == ["embedding junk.safetensors skipped: junk.safetensors: its tensors ['weird'] are no family's "
                    "embedding layout (SD1.5 reads emb_params)"], said
