"""The compiled UNet path (`app.engine.compiled`).

On the CPU these run dynamo with its `eager` backend: tracing, guards, per-signature dispatch, the
compile counter and the LoRA contract are the same code the GPU runs with inductor, in seconds. The
`gpu` tests repeat the contract with inductor and CUDA graphs.
"""

from __future__ import annotations

import copy
import inspect
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file
from tiny import FAST
from torch.utils import _pytree as pytree

from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline
from app.engine import compile_cache, compiled
from app.engine.compiled import CompileStatus
from app.engine.generate import GenerateParams
from app.engine.offload import MODES
from app.engine.worker import Engine
from app.families import FAMILIES, family, family_of
from app.settings import Settings
from launch import build_parser, settings_from_args


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny models gain nothing from a second thread, and OpenMP's spin-waiting makes them many
    times slower on a busy two-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small_pipe():
    """The tiny SD1.5 pipeline with a one-level UNet: the same UNet class and code paths, fewer
    modules, so dynamo traces it in a fraction of the time."""
    pipe = build_tiny_pipeline("sd15")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(block_out_channels=(32,), down_block_types=("CrossAttnDownBlock2D",),
                                    up_block_types=("CrossAttnUpBlock2D",), layers_per_block=1,
                                    cross_attention_dim=32, attention_head_dim=8, sample_size=8)
    pipe.register_modules(unet=unet.eval())
    return pipe


@pytest.fixture
def pipe():
    pipe = _small_pipe()
    yield pipe
    compiled.disable(pipe)


def _inputs(batch: int = 1, device: str = "cpu", dtype=torch.float32) -> tuple:
    """UNet inputs as the SD pipeline passes them under CFG (2 × batch rows)."""
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2 * batch, 4, 8, 8, generator=generator).to(device, dtype)
    hidden = torch.randn(2 * batch, 77, 32, generator=generator).to(device, dtype)
    return sample, torch.tensor(500.0, device=device), hidden


def _unet_out(pipe, batch: int = 1, **kw) -> torch.Tensor:
    with torch.no_grad():
        return pipe.unet(*_inputs(batch, **kw), return_dict=False)[0].clone()


def _lora_files(tmp_path, unet, names=("a", "b"), component="unet", within=".attn") -> dict:
    """PEFT-layout LoRAs on every Linear whose path holds `within` (attention projections), large enough
    to move the output."""
    files = {}
    for seed, name in enumerate(names):
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for path, module in unet.named_modules():
            if isinstance(module, torch.nn.Linear) and within in path:
                key = f"{component}.{path}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(4, module.in_features, generator=generator) * 0.3
                tensors[f"{key}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=generator) * 0.3
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        files[name] = read_adapter(name, tmp_path / f"{name}.safetensors")
    return files


def _reweight_sequence() -> list[list[LoraSpec]]:
    """Add, ten re-weights, add a second, remove the first, remove all: every step changes the weights."""
    steps = [[LoraSpec("a", 1.0)]] + [[LoraSpec("a", 1.1 if i % 2 == 0 else 0.9)] for i in range(10)]
    return steps + [[LoraSpec("a", 0.9), LoraSpec("b", 1.0)], [LoraSpec("b", 1.0)], []]


def test_lora_changes_reach_the_output_without_recompiling(pipe, tmp_path):
    """Fusing with copy_ keeps every parameter's identity and metadata, so adding, re-weighting and
    removing LoRAs changes the compiled output without a single new graph; removing all restores the
    original output bit for bit. The compiled forward computes what the plain one does."""
    eager = _unet_out(pipe)
    state = compiled.enable(pipe, backend="eager", background=False, device="cpu")
    files = _lora_files(tmp_path, pipe.unet)
    stack = LoraStack(pipe, "sd15")
    assert state.compiles == 0
    base = _unet_out(pipe)
    torch.testing.assert_close(base, eager)
    graphs = state.compiles
    assert graphs >= 1 and state.status().shapes_ready == 1
    previous = base
    for specs in _reweight_sequence():
        stack.reconcile(specs, files)
        out = _unet_out(pipe)
        assert not torch.equal(out, previous), f"LoRA change {specs} did not reach the compiled output"
        previous = out
    assert torch.equal(previous, base)
    assert state.compiles == graphs


def _linear_pipe() -> SimpleNamespace:
    """A stand-in pipeline whose "UNet" is one Linear: dispatch and warm-up do not depend on the
    module, and dynamo traces this one in milliseconds."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return SimpleNamespace(unet=torch.nn.Linear(8, 8), _execution_device=torch.device("cpu"), family=family("sd15"))


def _linear_out(pipe) -> torch.Tensor:
    with torch.no_grad():
        return pipe.unet(torch.ones(2, 8)).clone()


class _TextMix(torch.nn.Module):
    """A "UNet" reading `encoder_hidden_states` as the real one does (keyword, (batch, tokens, features))."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, sample, encoder_hidden_states):
        return self.proj(sample) + encoder_hidden_states.mean(dim=1)


def test_prompt_lengths_past_the_cap_run_eager_with_a_note():
    """A1111 prompts come in 77-token chunks, each chunk count a new input length: only the first
    MAX_TEXT_LENGTHS lengths compile, longer prompts run eager (same output) and the status says so,
    so long prompts never recompile without bound nor use up the image sizes."""
    pipe = SimpleNamespace(unet=_TextMix(), _execution_device=torch.device("cpu"), family=family("sd15"))
    state = compiled.enable(pipe, backend="eager", background=False, device="cpu")
    try:
        sample = torch.ones(2, 8)
        outs = []
        for chunks in range(1, compiled.MAX_TEXT_LENGTHS + 3):
            text = torch.full((2, 77 * chunks, 8), float(chunks))
            with torch.no_grad():
                outs.append(pipe.unet(sample, encoder_hidden_states=text))
        assert state.status().shapes_ready == compiled.MAX_TEXT_LENGTHS
        assert "more than 3 lengths" in state.note
        with torch.no_grad():  # a compiled length still runs compiled; the eager ones gave the same values
            pipe.unet(sample, encoder_hidden_states=torch.ones(2, 77, 8))
            assert torch.equal(outs[-1], type(pipe.unet).forward(pipe.unet, sample, torch.full((2, 77 * 5, 8), 5.0)))
        assert state.status().shapes_ready == compiled.MAX_TEXT_LENGTHS
    finally:
        compiled.disable(pipe)


def test_background_compile_keeps_generating_eagerly_until_ready():
    """With background=True a new shape starts a compile on a helper thread and the calls meanwhile run
    eager (no waiting); the status says "compiling" with the ~1 min hint; once ready, calls go compiled."""
    entered, release = threading.Event(), threading.Event()

    def slow_backend(gm, _example_inputs):
        entered.set()
        release.wait(60)
        return gm.forward

    pipe = _linear_pipe()
    eager = _linear_out(pipe)
    state = compiled.enable(pipe, backend=slow_backend, background=True, device="cpu")
    try:
        torch.testing.assert_close(_linear_out(pipe), eager)
        assert entered.wait(60)
        status = state.status()
        assert status.phase == "compiling"
        assert "compiling the UNet" in status.note and "1 min" in status.note and "eagerly" in status.note
        torch.testing.assert_close(_linear_out(pipe), eager)  # does not block on the compile in flight
        release.set()
        assert state.wait(60)
        assert state.status().phase == "compiled" and state.status().shapes_ready == 1
        graphs = state.compiles
        torch.testing.assert_close(_linear_out(pipe), eager)
        assert graphs == 1 and state.compiles == graphs
    finally:
        release.set()
        compiled.disable(pipe)


def test_background_compile_failure_is_reported_and_stays_eager():
    """A compile that fails leaves that size eager and says so; generation keeps working."""

    def broken_backend(_gm, _example_inputs):
        raise RuntimeError("no compiler here")

    pipe = _linear_pipe()
    eager = _linear_out(pipe)
    state = compiled.enable(pipe, backend=broken_backend, background=True, device="cpu")
    try:
        _linear_out(pipe)
        assert state.wait(60)
        status = state.status()
        assert status.phase == "failed" and "no compiler here" in status.note
        torch.testing.assert_close(_linear_out(pipe), eager)
    finally:
        compiled.disable(pipe)


@pytest.mark.parametrize("offload", ["model", "balanced", "sequential", "group"])
def test_offload_modes_that_move_weights_stay_eager(pipe, offload):
    """Modes that move weights would invalidate compiled graphs: nothing is installed and the note says why."""
    state = compiled.enable(pipe, offload=offload, backend="eager", device="cpu")
    assert state.phase == "eager" and f"'{offload}'" in state.note and "eager" in state.note
    assert "forward" not in vars(pipe.unet) and compiled.installed_state(pipe.unet) is None
    assert state.compiles == 0


def test_inductor_needs_cuda(pipe):
    """The GPU path (inductor) refuses a CPU device with a clear note instead of a minutes-long compile."""
    state = compiled.enable(pipe, device="cpu")
    assert state.phase == "eager" and "CUDA" in state.note
    assert compiled.installed_state(pipe.unet) is None


def test_gpu_path_defaults_to_inductor_with_cuda_graphs(pipe):
    """Without arguments enable() is the GPU path: inductor in reduce-overhead mode, i.e. CUDA graphs."""
    defaults = {k: p.default for k, p in inspect.signature(compiled.enable).parameters.items()}
    assert defaults["backend"] == "inductor" and defaults["mode"] == "reduce-overhead"
    state = compiled.CompileState(pipe.unet, background=False)  # nothing compiles until a call
    try:
        assert state.backend == "inductor" and state.config_patches == {"triton.cudagraphs": True}
    finally:
        state.close()
    state = compiled.CompileState(pipe.unet, mode="default", background=False)
    assert state.config_patches == {}
    state.close()


def test_enable_replaces_and_disable_restores_the_plain_forward(pipe):
    """Only `unet.forward` is set; a second enable closes the first; disable removes it again."""
    first = compiled.enable(pipe, backend="eager", background=False, device="cpu")
    assert compiled.installed_state(pipe.unet) is first
    second = compiled.enable(pipe, backend="eager", background=False, device="cpu")
    assert first.phase == "closed" and compiled.installed_state(pipe.unet) is second
    compiled.disable(pipe)
    assert "forward" not in vars(pipe.unet) and second.phase == "closed"
    assert _unet_out(pipe).shape == (2, 4, 8, 8)


def test_cache_dir_and_unreadable_mega_cache(tmp_path, monkeypatch):
    """configure_cache points inductor's caches at our folder; a corrupt mega-cache is skipped, not fatal."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")  # restored after the test
    mega = compile_cache.configure_cache(tmp_path / "cache", override=True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert torch._inductor.config.fx_graph_cache
    mega.write_bytes(b"not a cache")
    assert compile_cache.load_mega_cache(mega) is False
    assert compile_cache.load_mega_cache(tmp_path / "missing.bin") is False


# ------------------------------------------------------------------------------- regional (DiT blocks)
# One family per transformer class whose family compiles regions (the DiTs), found in the registry.
REGIONAL = tuple({f.denoiser_class: f.name for f in FAMILIES.values() if f.compile_regions}.values())


def _deep_dit(family_name: str, copies: int = 3):
    """The family's tiny pipeline with every run of repeated blocks `copies` times as long (re-seeded
    deep copies appended): several instances per block class, so a compile per instance would show.
    Returns the pipeline, its denoiser and the number of runs (ModuleLists of repeated blocks)."""
    pipe = build_tiny_pipeline(family_name)
    denoiser = getattr(pipe, family(family_name).denoiser)
    names = set(family(family_name).compile_regions(denoiser))
    generator = torch.Generator().manual_seed(1)
    runs = [m for m in denoiser.modules() if isinstance(m, torch.nn.ModuleList) and len(m)
            and all(type(block).__name__ in names for block in m)]
    for run in runs:
        for block in list(run) * (copies - 1):
            clone = copy.deepcopy(block)
            with torch.no_grad():
                for param in clone.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.02)
            run.append(clone)
    return pipe, denoiser, len(runs)


def _denoiser_call(pipe) -> tuple[tuple, dict]:
    """The arguments of the first denoiser call of a two-step 32² generation, to call it directly (two: one step
    of a schedule stretched to a terminal sigma, Qwen-Image's `shift_terminal`, is NaN in diffusers)."""
    calls = []
    denoiser = getattr(pipe, family_of(pipe).denoiser)
    handle = denoiser.register_forward_pre_hook(lambda _m, a, k: calls.append((a, k)), with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    return calls[0]


def _denoise(module_or_forward, call: tuple[tuple, dict]) -> torch.Tensor:
    """One denoiser call's output as one flat tensor (Z-Image returns a list per image)."""
    args, kwargs = call
    with torch.no_grad():
        out = module_or_forward(*args, **kwargs)
    return torch.cat([t.flatten() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])


def _blocks(denoiser, state) -> list[torch.nn.Module]:
    return [m for m in denoiser.modules() if type(m).__name__ in state.status().regions]


@pytest.mark.parametrize("family_name", REGIONAL)
def test_regional_compile_shares_one_graph_per_block_class(family_name):
    """Issue 41 (6), regional compilation: `--compile` on a DiT compiles each repeated block class once,
    its instances sharing the graph (parameters are graph inputs), not once per block: with three times
    the tiny model's blocks, at most two graphs per run of blocks (a run's input layout: FLUX's first
    single block gets other strides; Z-Image's one class runs as modulated noise refiner, unmodulated
    caption refiner and main layers), fewer than the blocks. The output is the
    eager one; the blocks stay the same modules with the same parameters (placement, verify and the
    patcher see them), and disable gives every block its plain forward back."""
    pipe, denoiser, runs = _deep_dit(family_name)
    call = _denoiser_call(pipe)
    eager = _denoise(denoiser, call)
    modules, params = dict(denoiser.named_modules()), dict(denoiser.named_parameters())
    state = compiled.enable(pipe, backend="eager", background=False, device="cpu")
    try:
        assert state.compiles == 0 and state.status().regions == family(family_name).compile_regions(denoiser)
        torch.testing.assert_close(_denoise(denoiser, call), eager)
        blocks = _blocks(denoiser, state)
        assert len(blocks) >= 3 * runs
        assert 1 <= state.compiles <= 2 * runs < len(blocks), (state.compiles, runs, len(blocks))
        graphs = state.compiles
        torch.testing.assert_close(_denoise(denoiser, call), eager)
        assert state.compiles == graphs and state.mode == "default" and "blocks" in state.note
        assert dict(denoiser.named_modules()) == modules and dict(denoiser.named_parameters()) == params
    finally:
        compiled.disable(pipe)
    assert not [b for b in blocks if "forward" in vars(b)] and "forward" not in vars(denoiser)
    torch.testing.assert_close(_denoise(denoiser, call), eager)


def test_regional_lora_changes_reach_the_output_without_recompiling(tmp_path):
    """Issue 41 (6): LoRAs fuse with copy_ into the blocks' own parameters, so adding, re-weighting and
    removing them under the regionally compiled DiT changes its output exactly as in eager (the same
    blocks' plain forwards), with no new graph; removing all restores the first output bit for bit."""
    family_name = REGIONAL[0]
    pipe, denoiser, _runs = _deep_dit(family_name, copies=2)
    call = _denoiser_call(pipe)
    files = _lora_files(tmp_path, denoiser, component=family(family_name).denoiser, within="blocks")
    stack = LoraStack(pipe, family_name)
    state = compiled.enable(pipe, backend="eager", background=False, device="cpu")
    plain = type(denoiser).forward.__get__(denoiser)  # the blocks run their plain forward outside the state
    try:
        base = _denoise(denoiser, call)
        graphs, previous = state.compiles, base
        assert graphs >= 1
        for specs in _reweight_sequence():
            stack.reconcile(specs, files)
            out = _denoise(denoiser, call)
            assert not torch.equal(out, previous), f"LoRA change {specs} did not reach the compiled output"
            torch.testing.assert_close(out, _denoise(plain, call))
            previous = out
        assert torch.equal(previous, base)
        assert state.compiles == graphs
    finally:
        compiled.disable(pipe)


@pytest.mark.parametrize("offload", [name for name, mode in MODES.items() if mode.moves_weights])
def test_regional_compile_stays_eager_where_offload_moves_weights(offload):
    """Issue 41 (6): the regional path keeps the compiled path's offload rule: a mode that moves weights
    installs nothing on the denoiser or its blocks and the note says why (placing.py re-enables the
    compiled path after every offload change, which then decides again)."""
    pipe = build_tiny_pipeline(REGIONAL[0])
    denoiser = getattr(pipe, family_of(pipe).denoiser)
    state = compiled.enable(pipe, offload=offload, backend="eager", device="cpu")
    assert state.phase == "eager" and f"'{offload}'" in state.note and state.compiles == 0
    assert not [m for m in denoiser.modules() if "forward" in vars(m)]


def test_regional_background_compile_keeps_the_worker_eager():
    """Issue 41 (6): the compiled block forwards are switched on per thread: while a background compile
    traces the blocks on its helper thread, the worker's calls through the same blocks run eager and
    never enter the compiler (a switch shared by the threads would compile on the worker, or block it)."""
    entered, release, threads = threading.Event(), threading.Event(), []

    def slow_backend(gm, _example_inputs):
        threads.append(threading.current_thread().name)
        entered.set()
        release.wait(30)
        return gm.forward

    pipe = build_tiny_pipeline(REGIONAL[0])
    denoiser = getattr(pipe, family_of(pipe).denoiser)
    call = _denoiser_call(pipe)
    eager = _denoise(denoiser, call)
    state = compiled.enable(pipe, backend=slow_backend, background=True, device="cpu")
    try:
        torch.testing.assert_close(_denoise(denoiser, call), eager)
        assert entered.wait(60) and state.status().phase == "compiling"
        torch.testing.assert_close(_denoise(denoiser, call), eager)
        assert set(threads) == {"unet-compile"}
        release.set()
        assert state.wait(60) and state.status().phase == "compiled"
        torch.testing.assert_close(_denoise(denoiser, call), eager)
        assert set(threads) == {"unet-compile"}
    finally:
        release.set()
        compiled.disable(pipe)


def _compiled_by_now(eng: Engine, timeout_s: float = 120) -> CompileStatus:
    """The engine's compile status once its background compile is done (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while eng.snapshot().compile.phase in ("compiling", "waiting") and time.monotonic() < deadline:
        time.sleep(0.2)
    return eng.snapshot().compile


def test_regional_compile_in_the_engine_with_strict_forwards_loras_and_offload_changes(data_dir):
    """Issue 41 (6), the engine's own path: `--compile` on a DiT with strict forwards on compiles the
    blocks by regions on a helper thread (the first generation runs eager meanwhile); every strict check
    and every verify after a command passes (the blocks keep their parameters); a LoRA change recompiles
    nothing; an offload mode that moves weights takes the compiled path off the blocks (as the whole
    compile is taken off) and `none` puts it back."""
    family_name = REGIONAL[0]
    eng = Engine(Settings(data_dir=data_dir, device="cpu", compile=True, compile_backend="eager",
                          strict_forwards=True))
    params = GenerateParams("a cat", seed=7, **{**FAST, "cfg": 1.0})
    try:
        eng.load_model(f"tiny-{family_name}.safetensors")
        eng.generate(params)
        status = _compiled_by_now(eng)
        assert status.phase == "compiled" and status.regions and status.mode == "default", status.note
        eng.generate(params)
        graphs = eng.snapshot().compile.compiles
        eng.set_loras([LoraSpec(f"demo-style-{family_name}", 0.8)])
        eng.generate(params)
        eng.set_loras([LoraSpec(f"demo-style-{family_name}", 0.5)])
        eng.generate(params)
        assert eng.snapshot().compile.compiles == graphs
        denoiser = getattr(eng.pipeline, family(family_name).denoiser)
        eng.set_offload("model")
        assert eng.snapshot().compile.phase == "eager"
        assert not [m for m in denoiser.modules() if "forward" in vars(m)]
        eng.generate(params)
        eng.set_offload("none")
        assert len([m for m in denoiser.modules() if "forward" in vars(m)]) > len(status.regions)
        eng.generate(params)
        assert _compiled_by_now(eng).phase == "compiled"
        history = eng.snapshot().history
        assert history and all(h.outcome == "ok" and h.violations_found == 0 for h in history)
    finally:
        eng.close()


def test_compile_whole_flag_keeps_the_dit_whole(data_dir):
    """Issue 41 (6): `--compile-whole` reaches the engine: the DiT's denoiser is compiled whole (no block
    is touched, the configured mode with its CUDA graphs) instead of by regions, the family's default."""
    settings = settings_from_args(build_parser().parse_args(["--compile", "--compile-whole"]))
    assert settings.compile_whole and not Settings().compile_whole
    family_name = REGIONAL[0]
    eng = Engine(Settings(data_dir=data_dir, device="cpu", compile=True, compile_backend="eager", compile_whole=True))
    try:
        eng.load_model(f"tiny-{family_name}.safetensors")
        status = eng.snapshot().compile
        assert status.regions == () and status.mode == "reduce-overhead" and "blocks" not in status.note
        denoiser = getattr(eng.pipeline, family(family_name).denoiser)
        assert "forward" in vars(denoiser) and not [m for m in denoiser.modules() if "forward" in vars(m)][1:]
    finally:
        eng.close()


# ----------------------------------------------------------------------------------------------- GPU
def _cuda_pipe():
    pipe = _small_pipe()
    pipe.unet.to("cuda", torch.float16)
    return pipe


@pytest.mark.gpu
@pytest.mark.gpu_long  # minutes of compiling: the device check's compile section
def test_cuda_graphs_survive_lora_changes(tmp_path):
    """Inductor + CUDA graphs: LoRA add/re-weight/remove change the output with no new graph and no
    CUDA-graph re-recording; removing all LoRAs restores the original output exactly."""
    pipe = _cuda_pipe()
    try:
        state = compiled.enable(pipe, background=False, device="cuda")
        files = _lora_files(tmp_path, pipe.unet)
        stack = LoraStack(pipe, "sd15")
        base = [_unet_out(pipe, device="cuda", dtype=torch.float16) for _ in range(3)][-1]  # compile, warm, record
        graphs, recordings = state.compiles, state.cudagraph_recordings
        previous = base
        for specs in _reweight_sequence():
            stack.reconcile(specs, files)
            out = _unet_out(pipe, device="cuda", dtype=torch.float16)
            assert not torch.equal(out, previous)
            previous = out
        assert torch.equal(previous, base)
        assert state.compiles == graphs
        assert recordings is None or state.cudagraph_recordings == recordings
    finally:
        compiled.disable(pipe)


@pytest.mark.gpu
@pytest.mark.gpu_long  # minutes of compiling: the device check's compile section
def test_background_compile_then_replays_on_the_calling_thread():
    """The engine's shape without CUDA graphs: the compile runs on a helper thread, replays happen on
    the worker thread and match eager. (CUDA-graph trees belong to the thread that records them, so
    `reduce-overhead` compiles on the worker itself; measured on an H100, a background recording
    failed in `cudagraph_trees.get_container`.)"""
    pipe = _cuda_pipe()
    eager = _unet_out(pipe, device="cuda", dtype=torch.float16)
    try:
        state = compiled.enable(pipe, mode="default", background=True, device="cuda")
        _unet_out(pipe, device="cuda", dtype=torch.float16)
        assert state.wait(600) and state.status().phase == "compiled"
        outs = [_unet_out(pipe, device="cuda", dtype=torch.float16) for _ in range(4)]
        graphs = state.compiles
        outs.append(_unet_out(pipe, device="cuda", dtype=torch.float16))
        assert state.compiles == graphs
        for out in outs:
            torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
    finally:
        compiled.disable(pipe)


@pytest.mark.gpu
@pytest.mark.gpu_long  # inductor compiles: the device check's compile section
def test_regional_inductor_blocks_match_eager_and_survive_lora_changes(tmp_path):
    """Issue 41 (6) with inductor on the GPU: a bf16 tiny DiT with twice its blocks compiles by regions
    (fewer graphs than blocks), matches its eager forward within bf16 rounding, and LoRA add/re-weight/
    remove reach the output with no new graph; removing all restores the first output exactly."""
    family_name = REGIONAL[0]
    pipe, denoiser, runs = _deep_dit(family_name, copies=2)
    pipe.to("cuda", torch.bfloat16)
    call = _denoiser_call(pipe)
    plain = type(denoiser).forward.__get__(denoiser)  # the blocks' plain forwards, outside the state
    files = _lora_files(tmp_path, denoiser, component=family(family_name).denoiser, within="blocks")
    stack = LoraStack(pipe, family_name)
    try:
        state = compiled.enable(pipe, background=False, device="cuda")
        base = _denoise(denoiser, call)
        graphs, previous = state.compiles, base
        assert state.status().regions and 1 <= graphs <= 2 * runs < len(_blocks(denoiser, state))
        torch.testing.assert_close(base, _denoise(plain, call), atol=3e-2, rtol=3e-2)
        for specs in _reweight_sequence():
            stack.reconcile(specs, files)
            out = _denoise(denoiser, call)
            assert not torch.equal(out, previous)
            torch.testing.assert_close(out, _denoise(plain, call), atol=3e-2, rtol=3e-2)
            previous = out
        assert torch.equal(previous, base) and state.compiles == graphs
    finally:
        compiled.disable(pipe)
