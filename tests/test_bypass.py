"""LoRAs as bypass forwards (streamed offload modes; stored-in-another-dtype weights next).

What it protects: a bypassed layer computes base(x) + Σ m·Δ(x) with its own weight untouched,
and that equals the same layer with the LoRA fused, for every algorithm and layer kind, within
the dtype's rounding; output and gradients keep the layer's dtype (a float32 GLoRA on a bf16
layer must not leak float32 into forward or backward: the Unsloth/LyCORIS `expected BFloat16 but
found Float` / `expected m1 and m2 to have the same dtype` reports); plain LoRA runs its factors on
x and never builds ΔW; a forward that raises leaves no hook state behind; switching between fused
and bypass leaves no backup and no hook behind, and a failed switch rolls back.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app.adapters.algos import LoRA
from app.adapters.bypass import BypassLayer
from app.adapters.errors import LoraApplyError
from app.adapters.files import read_adapter
from app.adapters.layer_ops import op_for
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import ALGORITHMS, adapter_state_digests, write_adapter
from app.demo import build_tiny_pipeline
from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.hooks import HookRegistry
from app.settings import Settings

LINEAR = ("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0")
BIASED_CONV = ("unet", "down_blocks.0.resnets.0.conv1")
ALL = frozenset({"unet", "text_encoder"})
# Largest |bypass − fused| relative to the output's magnitude: fp32 rounding vs a few fp16/bf16 ulps.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _pipe(dtype: torch.dtype):
    pipe = build_tiny_pipeline("sd15")
    pipe.unet.to(dtype)
    pipe.text_encoder.to(dtype)
    return pipe


def _write(tmp_path, pipe, algo: str, file_dtype: torch.dtype, targets=None):
    path = tmp_path / f"{algo}.safetensors"
    if not path.exists():
        layout = "kohya" if algo in ("lora", "dora") else "lycoris"
        kwargs = {} if targets is None else {"targets": tuple(".".join(t) for t in targets)}
        write_adapter(path, pipe, "sd15", algo, layout, file_dtype, seed=3, alpha=2.0, **kwargs)
    return read_adapter(algo, path)


def _stack(pipe, file, *, bypass: frozenset[str], strength: float = 0.8) -> LoraStack:
    stack = LoraStack(pipe, "sd15", hooks=HookRegistry(), bypass=bypass)
    stack.reconcile([LoraSpec(file.name, strength)], {file.name: file})
    return stack


def _module(pipe, target):
    return getattr(pipe, target[0]).get_submodule(target[1])


def _input_for(module: torch.nn.Module, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if isinstance(module, torch.nn.Conv2d):
        shape = (1, module.in_channels, 8, 8)
    elif isinstance(module, torch.nn.GroupNorm):
        shape = (1, module.num_channels, 4, 4)
    elif isinstance(module, torch.nn.LayerNorm):
        shape = (2, 3, *module.normalized_shape)
    else:
        shape = (2, 3, module.in_features)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_bypass_output_equals_the_fused_layer_and_leaves_weights_alone(tmp_path, algo, dtype):
    """Every algorithm × every layer it targets (linear, 1×1 and 3×3 convs, norms, text encoder):
    the bypassed layer's output equals the fused layer's within the dtype's rounding and differs
    from the plain layer's; stored weights keep their bits and Parameters their identity."""
    pipe = _pipe(dtype)
    plain, fused_pipe = copy.deepcopy(pipe), copy.deepcopy(pipe)
    before = adapter_state_digests(pipe)
    params = {name: p for name, p in pipe.unet.named_parameters()}
    file = _write(tmp_path, pipe, algo, torch.float32)
    stack = _stack(pipe, file, bypass=ALL)
    _stack(fused_pipe, file, bypass=frozenset())
    assert stack.bypassed() and stack._backups == {}
    for target in stack.bypassed():
        module = _module(pipe, target)
        x = _input_for(module, dtype)
        with torch.no_grad():
            got, want, base = module(x), _module(fused_pipe, target)(x), _module(plain, target)(x)
        assert got.dtype == dtype, target
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= TOLERANCE[dtype] * scale, target
        assert not torch.equal(got, base), f"{target}: the bypass added nothing"
    assert adapter_state_digests(pipe) == before
    assert all(p is params[name] for name, p in pipe.unet.named_parameters())


def test_plain_lora_runs_its_factors_on_x_without_building_the_delta(tmp_path, monkeypatch):
    """LoRA on linear and conv layers: the bypass never materialises ΔW (no call to `delta`)."""
    pipe = _pipe(torch.float32)
    file = _write(tmp_path, pipe, "lora", torch.float16, targets=(LINEAR, BIASED_CONV))
    _stack(pipe, file, bypass=ALL)
    built = []
    monkeypatch.setattr(LoRA, "delta", lambda self, *a, **k: built.append(self) or pytest.fail("ΔW built"))
    for target in (LINEAR, BIASED_CONV):
        module = _module(pipe, target)
        with torch.no_grad():
            module(_input_for(module, torch.float32))
    assert built == []


def test_factors_are_prepared_once_per_strength_not_per_forward(tmp_path, monkeypatch):
    """A LoRA's factors are cast and scaled once per re-weight (the first forward after it), not on
    every call; a re-weight prepares them again, and the output then is the new strength's fuse."""
    pipe = _pipe(torch.bfloat16)
    file = _write(tmp_path, pipe, "lora", torch.float32, targets=(LINEAR,))
    stack = _stack(pipe, file, bypass=ALL)
    prepared = []
    real = LoRA.bypass_forward
    monkeypatch.setattr(LoRA, "bypass_forward", lambda self, *a: prepared.append(a) or real(self, *a))
    module, x = _module(pipe, LINEAR), _input_for(_module(pipe, LINEAR), torch.bfloat16)
    with torch.no_grad():
        first = [module(x) for _ in range(3)]
    assert prepared == [(0.8, torch.bfloat16, torch.device("cpu"))]
    assert all(torch.equal(first[0], out) for out in first[1:])
    stack.reconcile([LoraSpec(file.name, 0.3)], {file.name: file})
    fused = _pipe(torch.bfloat16)
    _stack(fused, file, bypass=frozenset(), strength=0.3)
    with torch.no_grad():
        got, want = module(x).float(), _module(fused, LINEAR)(x).float()
    assert [a[0] for a in prepared] == [0.8, 0.3]
    assert float((got - want).abs().max()) <= TOLERANCE[torch.bfloat16] * float(want.abs().max())
    assert not torch.equal(got, first[0].float())


def test_fp32_glora_on_bf16_layer_keeps_bf16_in_forward_and_backward(tmp_path):
    """Autograd through a bypassed layer: output, input gradient and weight gradient are all bf16,
    like the layer without an adapter; the input gradient differs from the unpatched one (the
    adapter took part in the backward)."""
    pipe = _pipe(torch.bfloat16)
    module = _module(pipe, LINEAR)
    module.weight.requires_grad_(True)
    x = _input_for(module, torch.bfloat16, seed=1).requires_grad_(True)
    module(x).float().square().sum().backward()
    plain_grad = x.grad.clone()
    x.grad, module.weight.grad = None, None

    _stack(pipe, _write(tmp_path, pipe, "glora", torch.float32, targets=(LINEAR,)), bypass=ALL)
    y = module(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and module.weight.grad.dtype == torch.bfloat16
    assert not torch.equal(x.grad, plain_grad)


def test_a_forward_that_raises_leaves_the_layer_working(tmp_path):
    """A forward that raises inside a bypassed layer leaves no half-run hook state: the next
    forward adds the LoRA exactly as before."""
    pipe = _pipe(torch.float32)
    _stack(pipe, _write(tmp_path, pipe, "lora", torch.float16, targets=(LINEAR,)), bypass=ALL)
    module = _module(pipe, LINEAR)
    x = _input_for(module, torch.float32)
    with torch.no_grad():
        first = module(x)
        with pytest.raises(RuntimeError):
            module(torch.randn(3, 7))  # wrong width: F.linear raises inside the forward
        assert torch.equal(module(x), first)


def test_switching_policy_restores_and_leaves_no_hook_or_backup(tmp_path):
    """fused → bypass: stored weights back to the checkpoint bit for bit, backups freed, a
    `lora.bypass` hook on each patched layer; → fused again: weights equal the first fuse, hooks
    gone; removing every LoRA under bypass leaves the checkpoint and no hook."""
    pipe = _pipe(torch.bfloat16)
    checkpoint = adapter_state_digests(pipe)
    file = _write(tmp_path, pipe, "loha", torch.bfloat16)
    hooks = HookRegistry()
    stack = LoraStack(pipe, "sd15", hooks=hooks)
    stack.reconcile([LoraSpec("loha", 0.8)], {"loha": file})
    fused = adapter_state_digests(pipe)
    assert fused != checkpoint and stack._backups
    stack.set_bypass(ALL)
    assert adapter_state_digests(pipe) == checkpoint and stack._backups == {}
    assert {hooks.names(_module(pipe, t)) for t in stack.patched_modules()} == {("lora.bypass",)}
    stack.set_bypass(frozenset())
    assert adapter_state_digests(pipe) == fused and stack.bypassed() == {}
    assert list(hooks.hooked()) == []
    stack.set_bypass(ALL)
    stack.reconcile([], {})
    assert adapter_state_digests(pipe) == checkpoint and list(hooks.hooked()) == []


@pytest.mark.parametrize("mode", ["sequential", "group"])
def test_streamed_mode_reweights_without_writing_and_draws_the_fused_image(data_dir, mode):
    """Engine under a streamed mode: re-weighting touches no stored weight, the snapshot says the
    LoRAs apply as bypass forwards, and each image equals the one `none` (fused) draws at the same
    weight within one grey level (same math, rounded in another order)."""
    engine = Engine(Settings(data_dir=data_dir, device="cpu"))
    try:
        engine.load_model("tiny-sd15.safetensors")
        params = GenerateParams("a red cube", steps=3, seed=7, width=64, height=64)
        images = {}
        for offload in ("none", mode):
            engine.set_offload(offload)
            checkpoint = adapter_state_digests(engine.pipeline) if offload == mode else None
            for weight in (1.0, 1.1, 1.0):
                snap = engine.set_loras([LoraSpec("demo-style-sd15", weight)])
                assert snap.lora_mode == ("fused" if offload == "none" else "bypass")
                images[offload, weight] = np.asarray(engine.generate(params)[0].image, dtype=np.int16)
            if checkpoint is not None:
                assert adapter_state_digests(engine.pipeline) == checkpoint
            engine.set_loras([])
        for weight in (1.0, 1.1):
            assert np.abs(images["none", weight] - images[mode, weight]).max() <= 1, weight
        assert np.abs(images[mode, 1.0] - images[mode, 1.1]).max() > 1
        assert engine.snapshot().violations_found_total == 0
    finally:
        engine.close()


def test_a_failed_switch_to_a_streamed_mode_rolls_back_to_the_fused_weights(data_dir, monkeypatch):
    """If installing the bypass hooks fails half-way through an offload switch, the switch is
    rolled back: previous mode, LoRA fused again bit for bit, no hook left, engine READY."""
    import app.adapters.patcher as patcher

    engine = Engine(Settings(data_dir=data_dir, device="cpu"))
    try:
        engine.load_model("tiny-sd15.safetensors")
        engine.set_loras([LoraSpec("demo-style-sd15", 0.7)])
        fused = adapter_state_digests(engine.pipeline)
        install, calls = patcher.install_bypass, []

        def failing(hooks, module, where, contributions):
            calls.append(where)
            if len(calls) > 3:
                raise RuntimeError("injected: hook install failed")
            return install(hooks, module, where, contributions)

        monkeypatch.setattr(patcher, "install_bypass", failing)
        with pytest.raises(RuntimeError, match="injected"):
            engine.set_offload("sequential")
        snap = engine.snapshot()
        assert (snap.state, snap.offload, snap.lora_mode) == ("READY", "none", "fused")
        assert snap.history[-1].outcome == "failed, rolled back"
        assert adapter_state_digests(engine.pipeline) == fused
        assert not any(row.hooks for row in snap.placement)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_lora_with_a_peft_bias_adds_it_in_the_bypass(kind):
    """PEFT's `lora_bias` (a bias on lora_B): the factor path adds s·m·bias like the layer's own
    bias, so the bypassed output equals W0+ΔW and b0+Δb applied together."""
    g = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(6, 5) if kind == "linear" else torch.nn.Conv2d(6, 5, 3, padding=1)
    down = torch.randn(2, *layer.weight.shape[1:], generator=g)
    up, bias = torch.randn(5, 2, *([1, 1] if kind == "conv" else []), generator=g), torch.randn(5, generator=g)
    adapter = LoRA(down, up, alpha=1.0, up_bias=bias)
    x = torch.randn(3, 6, *([4, 4] if kind == "conv" else []), generator=g)
    op = op_for(layer)
    with torch.no_grad():
        base = layer(x)
        got = base + adapter.bypass_forward(0.7, base.dtype, base.device)(layer, x, op, base)
        delta = adapter.delta(layer.weight, layer.bias)
        fused = op.apply_weight(layer, x, layer.weight + 0.7 * delta.weight)
        want = fused + (layer.bias + 0.7 * delta.bias).reshape(-1, *([1, 1] if kind == "conv" else []))
    assert torch.allclose(got, want, atol=1e-5)


# ------------------------------------------------------------------- joined plain LoRAs (issue 41, item 3)
# Largest |joined − separate sum| relative to the largest separate share: the same factor values
# (each rounded as its own forward rounds it), summed inside one matmul instead of after it. float32:
# accumulation order only; bf16/fp16: each separate share and their sum round to the dtype (a few ulps:
# bf16's is 2⁻⁸, fp16's 2⁻¹¹), the joined matmul accumulates in float32 and rounds once.
JOIN_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.convolution")
THREE = (("lora", torch.float16, 0.8), ("lora", torch.bfloat16, -0.6), ("lora", torch.float32, 1.3))


class _CountMatmuls(TorchDispatchMode):
    """Counts the matmuls and convolutions dispatched while active (as benchmarks/proxy_ops counts ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func.overloadpacket) in MATMULS
        return func(*args, **(kwargs or {}))


def _files(tmp_path, pipe, kinds):
    """One adapter file per (algorithm, file dtype, strength), each drawn from its own seed."""
    files = {}
    for i, (algo, file_dtype, strength) in enumerate(kinds):
        name = f"{algo}{i}"
        layout = "kohya" if algo in ("lora", "dora") else "lycoris"
        write_adapter(tmp_path / f"{name}.safetensors", pipe, "sd15", algo, layout, file_dtype, seed=10 + i,
                      alpha=2.0 + i)
        files[name] = (read_adapter(name, tmp_path / f"{name}.safetensors"), strength)
    return files


def _apply(pipe, files, *, bypass: frozenset[str]) -> LoraStack:
    stack = LoraStack(pipe, "sd15", hooks=HookRegistry(), bypass=bypass)
    stack.reconcile([LoraSpec(name, strength) for name, (_file, strength) in files.items()],
                    {name: file for name, (file, _strength) in files.items()})
    return stack


def _matmuls(module: torch.nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad(), _CountMatmuls() as counter:
        module(x)
    return counter.count


def test_three_plain_loras_cost_the_matmuls_of_one_on_every_bypassed_layer(tmp_path):
    """Issue 41 item 3 (bypass cost): every bypassed layer of the tiny SD1.5 (UNet linears and 1×1 and
    3×3 convs, text encoder) runs three plain LoRAs with as many matmuls/convolutions as one LoRA (two
    more than the bare layer: one joined down, one joined up), not two per LoRA."""
    pipe = _pipe(torch.float32)
    files = _files(tmp_path, pipe, THREE)
    counts = {}
    for n in (1, 3):
        layered = copy.deepcopy(pipe)
        stack = _apply(layered, dict(list(files.items())[:n]), bypass=ALL)
        counts[n] = {target: _matmuls(_module(layered, target), _input_for(_module(layered, target), torch.float32))
                     for target in stack.bypassed()}
    bare = {target: _matmuls(_module(pipe, target), _input_for(_module(pipe, target), torch.float32))
            for target in counts[3]}
    assert len(counts[3]) >= 10 and counts[3].keys() == counts[1].keys()
    assert {target: n - bare[target] for target, n in counts[3].items()} == dict.fromkeys(counts[3], 2)
    assert counts[3] == counts[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_joined_loras_equal_the_separate_forwards_and_the_fused_layers(tmp_path, dtype):
    """Issue 41 item 3: three plain LoRAs (fp16, bf16 and fp32 files, strengths of both signs, each its
    own alpha) beside a LoHa and a Tucker LoCon, which cannot join and keep their own forward. On every
    bypassed layer the output equals the layer plus each adapter's own forward summed (the previous,
    separate path) within JOIN_TOLERANCE, and the fused layer within TOLERANCE; it stays in `dtype`."""
    pipe = _pipe(dtype)
    plain, fused = copy.deepcopy(pipe), copy.deepcopy(pipe)
    files = _files(tmp_path, pipe, (*THREE, ("loha", torch.float16, 0.7), ("lora_tucker", torch.float32, 0.5)))
    stack = _apply(pipe, files, bypass=ALL)
    _apply(fused, files, bypass=frozenset())
    joined_layers = 0
    for target, contributions in stack.bypassed().items():
        module = _module(pipe, target)
        x = _input_for(module, dtype)
        op = op_for(module)
        with torch.no_grad():
            got, want, base = module(x), _module(fused, target)(x), _module(plain, target)(x)
            shares = [a.bypass_forward(m, dtype, x.device)(module, x, op, base) for _n, m, a in contributions]
        separate = base + sum(shares[1:], shares[0])
        assert got.dtype == dtype, target
        from_separate, from_fused = ((got.float() - other.float()).abs().max().item() for other in (separate, want))
        assert from_separate <= JOIN_TOLERANCE[dtype] * max(s.float().abs().max().item() for s in shares), target
        assert from_fused <= TOLERANCE[dtype] * want.float().abs().max().item(), target
        joined_layers += sum(c[2].joins_bypass for c in contributions) > 1
    assert joined_layers >= 10


def test_a_failing_joined_forward_names_the_lora_at_fault(monkeypatch):
    """Issue 41 item 3: a joined forward that fails is re-run one LoRA at a time, so the error names
    the LoRA at fault (the engine counts and forgets a refused LoRA by name), not its joined
    neighbours; should each run alone, the error names every joined LoRA."""
    g = torch.Generator().manual_seed(5)
    layer = torch.nn.Linear(6, 5)

    def lora(width: int) -> LoRA:
        return LoRA(torch.randn(2, width, generator=g), torch.randn(5, 2, generator=g), alpha=1.0)

    contributions = (("good-a", 0.5, lora(6)), ("wrong-width", 0.5, lora(7)), ("good-b", 0.5, lora(6)))
    bypassed = BypassLayer("unet.layer", op_for(layer), contributions)
    x = torch.randn(3, 6, generator=g)
    with pytest.raises(LoraApplyError) as caught, torch.no_grad():
        bypassed.output(layer, x, layer(x))
    assert caught.value.lora_name == "wrong-width" and "unet.layer" in str(caught.value)

    def broken(cls, parts, dtype, device, where):
        raise RuntimeError("injected: the joining failed")

    monkeypatch.setattr(LoRA, "joined", classmethod(broken))
    bypassed.replace((contributions[0], contributions[2]))
    with pytest.raises(LoraApplyError, match="injected") as caught, torch.no_grad():
        bypassed.output(layer, x, layer(x))
    assert caught.value.lora_name == "good-a + good-b"
