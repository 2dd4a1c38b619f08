"""The on-the-fly adapter path (streamed offload modes): LoRAs applied at each forward, never fused.

What it protects: under sequential/group offload the stored weights stay the checkpoint's while
every patched layer's forward computes with exactly the fused value (same bits); the swap is
undone after every forward, a raising one included; output and gradients keep the parameters'
dtype (a float32 GLoRA on a bf16 layer must not leak float32 into forward or backward, the
Unsloth/LyCORIS `expected BFloat16 but found Float` / `expected m1 and m2 to have the same dtype`
reports); switching between fused and on-the-fly leaves no backup and no hook behind.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import adapter_state_digests, write_adapter
from app.demo import build_tiny_pipeline
from app.engine.engine import Engine
from app.engine.generate import GenerateParams
from app.settings import Settings

LINEAR = ("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0")
BIASED_CONV = ("unet", "down_blocks.0.resnets.0.conv1")


def _pipe(dtype: torch.dtype):
    pipe = build_tiny_pipeline("sd15")
    pipe.unet.to(dtype)
    pipe.text_encoder.to(dtype)
    return pipe


def _stack(pipe, tmp_path, algo: str, file_dtype: torch.dtype, *, on_the_fly: bool, strength: float = 0.8):
    path = tmp_path / f"{algo}.safetensors"
    if not path.exists():
        targets = tuple(".".join(t) for t in (LINEAR, BIASED_CONV))
        write_adapter(path, pipe, "sd15", algo, "kohya", file_dtype, targets=targets, seed=3)
    stack = LoraStack(pipe, "sd15", on_the_fly=on_the_fly)
    stack.reconcile([LoraSpec(algo, strength)], {algo: read_adapter(algo, path)})
    return stack


def _module(pipe, target):
    return getattr(pipe, target[0]).get_submodule(target[1])


@pytest.mark.parametrize("algo", ["lora", "glora", "full"])
def test_forward_uses_the_fused_bits_and_leaves_stored_weights_alone(tmp_path, algo):
    """A patched layer's output equals the same layer fused in place, bit for bit; its Parameter
    objects and stored values are the checkpoint's before and after the forward."""
    pipe = _pipe(torch.bfloat16)
    fused_pipe = copy.deepcopy(pipe)
    before = adapter_state_digests(pipe)
    stack = _stack(pipe, tmp_path, algo, torch.float32, on_the_fly=True)
    _stack(fused_pipe, tmp_path, algo, torch.float32, on_the_fly=False)
    for target, shape in ((LINEAR, (2, 5, 32)), (BIASED_CONV, (1, 32, 8, 8))):
        module, fused = _module(pipe, target), _module(fused_pipe, target)
        weight, bias = module.weight, module.bias
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(module(x), fused(x)), target
        assert module.weight is weight and module.bias is bias
    assert adapter_state_digests(pipe) == before
    assert adapter_state_digests(pipe, stack) == adapter_state_digests(fused_pipe)
    assert stack._backups == {}


def test_fp32_glora_on_bf16_layer_keeps_bf16_in_forward_and_backward(tmp_path):
    """Autograd through an on-the-fly layer: output, input gradient and weight gradient are all
    bf16, like the layer without an adapter; the gradient differs from the unpatched one (the
    patched weight took part in the backward)."""
    pipe = _pipe(torch.bfloat16)
    module = _module(pipe, LINEAR)
    module.weight.requires_grad_(True)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_(True)
    module(x).float().square().sum().backward()
    plain_grad = x.grad.clone()
    x.grad, module.weight.grad = None, None

    _stack(pipe, tmp_path, "glora", torch.float32, on_the_fly=True)
    y = module(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and module.weight.grad.dtype == torch.bfloat16
    assert not torch.equal(x.grad, plain_grad)
    assert isinstance(module._parameters["weight"], torch.nn.Parameter)


def test_a_forward_that_raises_still_puts_the_parameters_back(tmp_path):
    pipe = _pipe(torch.float32)
    _stack(pipe, tmp_path, "lora", torch.float16, on_the_fly=True)
    module = _module(pipe, LINEAR)
    weight = module.weight
    with pytest.raises(RuntimeError):
        module(torch.randn(3, 7))  # wrong width: F.linear raises inside the forward
    assert module._parameters["weight"] is weight


def test_switching_policy_restores_refuses_and_leaves_no_hook_or_backup(tmp_path):
    """fused → on the fly: stored weights back to the checkpoint bit for bit, backups freed, hooks
    on each patched layer; → fused again: weights equal the first fuse, hooks gone."""
    pipe = _pipe(torch.bfloat16)
    checkpoint = adapter_state_digests(pipe)
    stack = _stack(pipe, tmp_path, "loha", torch.bfloat16, on_the_fly=False)
    fused = adapter_state_digests(pipe)
    assert fused != checkpoint and stack._backups
    stack.set_on_the_fly(True)
    assert adapter_state_digests(pipe) == checkpoint and stack._backups == {}
    assert adapter_state_digests(pipe, stack) == fused
    assert all(_module(pipe, t)._forward_pre_hooks and _module(pipe, t)._forward_hooks for t in stack.patched_modules())
    stack.set_on_the_fly(False)
    assert adapter_state_digests(pipe) == fused and stack._patches == {}
    assert not any(_module(pipe, t)._forward_pre_hooks or _module(pipe, t)._forward_hooks
                   for t in stack.patched_modules())
    stack.set_on_the_fly(True)
    stack.reconcile([], {})
    assert adapter_state_digests(pipe) == checkpoint and stack._patches == {}
    assert not any(_module(pipe, t)._forward_hooks for t in (LINEAR, BIASED_CONV))


@pytest.mark.parametrize("mode", ["sequential", "group"])
def test_streamed_mode_reweights_without_writing_and_draws_the_fused_image(data_dir, mode):
    """Engine under a streamed mode: re-weighting touches no stored weight, the snapshot says the
    LoRAs apply on the fly, and each image equals the one `none` (fused) draws at the same weight,
    pixel for pixel (same math, same CPU)."""
    engine = Engine(Settings(data_dir=data_dir, device="cpu"))
    try:
        engine.load_model("tiny-sd15.safetensors")
        params = GenerateParams("a red cube", steps=3, seed=7, width=64, height=64)
        lora = "demo-style-sd15"
        images = {}
        for offload in ("none", mode):
            engine.set_offload(offload)
            checkpoint = adapter_state_digests(engine.pipeline) if offload == mode else None
            for weight in (1.0, 1.1, 1.0):
                snap = engine.set_loras([LoraSpec(lora, weight)])
                assert snap.lora_mode == ("fused" if offload == "none" else "on the fly")
                images[offload, weight] = np.asarray(engine.generate(params)[0].image)
            if checkpoint is not None:
                assert adapter_state_digests(engine.pipeline) == checkpoint
            engine.set_loras([])
        for weight in (1.0, 1.1):
            assert np.array_equal(images["none", weight], images[mode, weight]), weight
        assert not np.array_equal(images[mode, 1.0], images[mode, 1.1])
        assert engine.snapshot().violations_found_total == 0
    finally:
        engine.close()


def test_a_failed_switch_to_a_streamed_mode_rolls_back_to_the_fused_weights(data_dir, monkeypatch):
    """If installing the on-the-fly hooks fails half-way through an offload switch, the switch is
    rolled back: previous mode, LoRA fused again bit for bit, no hook left, engine READY."""
    engine = Engine(Settings(data_dir=data_dir, device="cpu"))
    try:
        engine.load_model("tiny-sd15.safetensors")
        engine.set_loras([LoraSpec("demo-style-sd15", 0.7)])
        fused = adapter_state_digests(engine.pipeline)
        install = LoraStack._set_patch
        calls = []

        def failing(self, module, target, contributions):
            calls.append(target)
            if contributions and len(calls) > 3:
                raise RuntimeError("injected: hook install failed")
            return install(self, module, target, contributions)

        monkeypatch.setattr(LoraStack, "_set_patch", failing)
        with pytest.raises(RuntimeError, match="injected"):
            engine.set_offload("sequential")
        snap = engine.snapshot()
        assert (snap.state, snap.offload, snap.lora_mode) == ("READY", "none", "fused")
        assert snap.history[-1].outcome == "failed, rolled back"
        assert adapter_state_digests(engine.pipeline) == fused
        assert not any(m._forward_pre_hooks or m._forward_hooks
                       for c in (engine.pipeline.unet, engine.pipeline.text_encoder) for m in c.modules())
    finally:
        engine.close()
