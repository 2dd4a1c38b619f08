"""Krea 2's own behaviour, on the tiny model: our images equal diffusers' `Krea2Pipeline`'s on the same weights,
seed and settings, bit for bit on the CPU in fp32 (txt2img without and with CFG, where the page's CFG is Krea's
guidance + 1; Turbo's fixed shift and its defaults, from a folder's `is_distilled` or a file's name); Krea's
file names read as diffusers' own converter reads them, and ComfyUI's separate files (fp8 with `weight_scale`,
the Qwen3-VL encoder and Qwen-Image's VAE beside); a PEFT LoRA saved by diffusers, kohya and ComfyUI LoRAs fuse
to the float64 formula on exactly their modules and come off bit for bit; an fp32 LoRA on bf16 and fp8
generates; a step-scheduled LoRA runs its strengths step by step and leaves the model exact. What every family
must do (offload modes, fp8, strict forwards, refusals of img2img and inpaint) is the conformance suite's."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import Krea2Pipeline
from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
from safetensors.torch import save_file

from app.adapters.prompt import parse_prompt_loras
from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline
from app.engine.generate import GenerateParams
from app.families import family
from tests import family_files as kit
from tests.families.test_latent_formats import _pipeline_lines
from tests.weight_digest import weights_digest

FAMILY = "krea-2"
FILE, FOLDER = f"tiny-{FAMILY}.safetensors", f"tiny-{FAMILY}-diffusers"
W = 0.8  # LoRA strength
data, eng, oracle = kit.data, kit.eng, kit.oracle  # the module's fixtures (tests/family_files.py)
params = kit.params


def theirs(pipe, p: GenerateParams) -> np.ndarray:
    """The pipeline's pictures at Krea's guidance for the page's CFG (CFG − 1; 0: no unconditional pass)."""
    out = pipe(prompt=p.prompt, negative_prompt=p.negative_prompt or None, num_inference_steps=p.steps,
               height=p.height, width=p.width, guidance_scale=p.cfg - 1, num_images_per_prompt=p.batch,
               generator=[torch.Generator().manual_seed(p.seed + i) for i in range(p.batch)], output_type="np").images
    return (out * 255).round().astype(np.uint8)


def test_txt2img_equals_krea2_pipeline_without_and_with_cfg(eng, oracle):
    """The file at CFG 1 (Krea's guidance 0: no unconditional pass) and the folder at CFG 3 with a negative prompt
    (Krea's guidance 2: `cond + 2·(cond − uncond)`, A1111's CFG 3) give diffusers' pixels exactly; the negative
    prompt changes the image. The base model's defaults are the model card's 28 steps at guidance 4.5."""
    assert eng.load_model(FILE).defaults == (28, 5.5)
    kit.equals_oracle_without_and_with_cfg(eng, oracle, theirs, FILE, FOLDER)


def test_decode_statistics_are_krea2_pipelines_arithmetic_bit_for_bit():
    """`Krea2Pipeline.__call__`'s de-normalising lines, run as diffusers writes them on the bundled VAE config's
    per-channel statistics, equal the family's latent format (Qwen-Image's VAE: the std as its reciprocal) bit for
    bit; the plain `x * std` rule is a grey level off now and then, which a 64² image may not show."""
    config = SimpleNamespace(**json.loads((family(FAMILY).files.config_dir / "vae" / "config.json").read_text()))
    pipe = SimpleNamespace(vae=SimpleNamespace(config=config))
    latents = 3 * torch.randn(2, config.z_dim, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    decode = {"self": pipe, "torch": torch, "latents": latents}
    exec(_pipeline_lines(Krea2Pipeline.__call__, "latents_mean = (", "latents = latents / latents_std"), decode)
    assert torch.equal(family(FAMILY).latents_for_vae(pipe.vae, latents[:, :, 0]), decode["latents"][:, :, 0])


def test_turbo_file_runs_the_fixed_shift_with_its_defaults(eng, oracle, data):
    """A file named "…turbo…" is the distilled checkpoint: 8 steps without guidance filled in, and the fixed
    shift (mu 1.15) instead of the resolution's, as the pipeline with `is_distilled` draws it, pixel for pixel;
    the same weights as the base model draw another image."""
    models = data / "models/Stable-diffusion"
    if not (models / "tiny-krea-2-turbo.safetensors").exists():
        os.link(models / FILE, models / "tiny-krea-2-turbo.safetensors")
    assert eng.load_model("tiny-krea-2-turbo.safetensors").defaults == (8, 1.0)
    oracle.register_to_config(is_distilled=True)
    try:
        turbo = kit.ours(eng.generate(params(steps=3)))
        assert np.array_equal(turbo, theirs(oracle, params(steps=3)))
    finally:
        oracle.register_to_config(is_distilled=False)
    eng.load_model(FILE)
    assert not np.array_equal(kit.ours(eng.generate(params(steps=3))), turbo)


def test_krea_file_names_are_diffusers_converters_and_comfyui_separate_files_load(eng, data, oracle):
    """The demo's transformer under `model.diffusion_model.` (Krea's names: `blocks.N.attn.wq`, flat `mod.lin`, …)
    is what diffusers' own `convert_krea2_transformer_checkpoint_to_diffusers` turns into the model's state, bit
    for bit. What a ComfyUI user has: the bare transformer in fp8 e4m3 with per-tensor `weight_scale`,
    `qwen3vl_4b.safetensors` in models/text_encoder and `qwen_image_vae.safetensors` in models/VAE: encoder and VAE
    load bit for bit; a block's flat modulation row is its (6, width) table."""
    checkpoint = data / "models/Stable-diffusion" / FILE
    tensors, _configs = kit.all_in_one(checkpoint)
    assert tensors["model.diffusion_model.blocks.1.mod.lin"].dim() == 1  # six vectors in one row, as Krea stores them
    theirs_state = convert_krea2_transformer_checkpoint_to_diffusers(
        {k: v for k, v in tensors.items() if k.startswith("model.diffusion_model.")})
    reference = oracle.transformer.state_dict()
    assert theirs_state.keys() == reference.keys()
    assert all(torch.equal(theirs_state[k], reference[k]) for k in reference)
    pieces = {"qwen3vl_4b.safetensors": ("text_encoders.qwen3vl_4b.transformer.", "text_encoder"),
              "qwen_image_vae.safetensors": ("vae.", "vae")}
    fp8 = kit.load_separate_files(eng, oracle, checkpoint, pieces, "krea-2-fp8.safetensors")
    table = eng.pipeline.transformer.transformer_blocks[1].scale_shift_table
    assert torch.equal(table, fp8["blocks.1.mod.lin"].reshape(6, -1))
    assert eng.generate(params())[0].image.size == (64, 64)


# ------------------------------------------------------------------------------------ LoRA formats
def _trainer_lora(data, transformer, layout: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A LoRA on Krea's module names (alpha 2 at rank 4) written as kohya/musubi or ComfyUI and Krea's trainer
    write it (`kit.trainer_keys`) to models/Lora; its name and the float64 ΔW per diffusers module."""
    layers = {"blocks.0.attn.wq": "transformer_blocks.0.attn.to_q", "blocks.1.mlp.down": "transformer_blocks.1.ff.down",
              "txtfusion.refiner_blocks.0.attn.gate": "text_fusion.refiner_blocks.0.attn.to_gate",
              "tproj.1": "time_mod_proj"}
    state, deltas = {}, {}
    for i, (name, path) in enumerate(layers.items()):
        linear = transformer.get_submodule(path)
        down, up = kit.lora_factors(linear.out_features, linear.in_features, 4, i)
        state |= kit.trainer_keys(name, down, up, comfy=layout == "ComfyUI")
        deltas[path] = (2.0 / 4) * up.double() @ down.double()
    save_file(state, str(data / "models/Lora" / f"krea-{layout.lower()}.safetensors"))
    return f"krea-{layout.lower()}", deltas


@pytest.mark.parametrize("layout", ["diffusers PEFT", "kohya", "ComfyUI"])
def test_lora_formats_fuse_to_the_formula_on_exactly_their_modules_and_come_off(eng, data, oracle, layout):
    """Fused at 0.8, every module the file covers is W0 + 0.8·ΔW in float64 and no other weight changes (Krea's
    names land on diffusers' modules, the text fusion's and the shared modulation's included); removing it gives
    every tensor back bit for bit."""
    eng.load_model(FILE)
    name, deltas = (kit.saved_peft_lora(data, Krea2Pipeline, oracle.transformer, ["to_q", "to_v", "ff.up", "ff.down"],
                                        "krea-peft") if layout == "diffusers PEFT"
                    else _trainer_lora(data, eng.pipeline.transformer, layout))
    kit.fuses_to_the_formula(eng, name, deltas, W)


@pytest.mark.parametrize("weights", ["full", "fp8"])
def test_an_fp32_lora_on_a_bf16_and_an_fp8_stored_model_generates(data, weights):
    """An fp32 kohya LoRA on the model computing in bf16 (weights bf16 with the fp32-pinned norm scales, or fp8
    with bypass forwards) generates with no dtype error, changes the image, zero violations, and comes off leaving
    the stored bytes as they were."""
    name = _trainer_lora(data, build_tiny_pipeline(FAMILY).transformer, "kohya")[0]
    kit.fp32_lora_generates(data, FILE, name, params(), weights)


def test_a_scheduled_lora_runs_its_strength_step_by_step_and_leaves_the_model_exact(eng):
    """`<lora:demo-style-krea-2:1@0,0@0.5>` over 5 steps (strengths 1, .5, 0, 0, 0): before each step the
    attention's query holds W0 + s·ΔW (float64, to a few float32 ulps), the image differs from the constant
    strength 1, and after the job every tensor is bit for bit the resting state."""
    eng.load_model(FILE)
    style = f"demo-style-{FAMILY}"
    q = eng.pipeline.transformer.transformer_blocks[0].attn.to_q
    w0 = q.weight.detach().double().clone()
    eng.set_loras([LoraSpec(style, 1.0)])
    w1, constant = q.weight.detach().double().clone(), kit.ours(eng.generate(params(steps=5)))
    (spec,) = parse_prompt_loras(f"<lora:{style}:1@0,0@0.5>")[1]
    eng.set_loras([spec])
    resting, seen = weights_digest(eng.pipeline), []
    handle = eng.pipeline.transformer.register_forward_pre_hook(lambda *_: seen.append(q.weight.detach().double()))
    try:
        scheduled = kit.ours(eng.generate(params(steps=5)))
    finally:
        handle.remove()
    assert len(seen) == 5
    for step, (weight, s) in enumerate(zip(seen, (1.0, 0.5, 0.0, 0.0, 0.0), strict=True)):
        error = (weight - (w0 + s * (w1 - w0))).abs().max().item()
        assert error <= 4 * torch.finfo(torch.float32).eps * w1.abs().max().item(), (step, error)
    assert not np.array_equal(scheduled, constant)
    assert weights_digest(eng.pipeline) == resting
    eng.set_loras([])
