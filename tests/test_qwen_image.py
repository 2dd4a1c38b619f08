"""Qwen-Image 2.1's own behaviour, on the tiny model: our images equal diffusers' `QwenImage21Pipeline`'s on the
same weights, seed and settings, bit for bit on the CPU in fp32 (txt2img without and with CFG, Turbo's authored
sigmas, reference editing with one and two pictures); ComfyUI's separate files (fused `gate_up`, fp8 with
`weight_scale`); a PEFT LoRA saved by diffusers, kohya and ComfyUI LoRAs (fused `gate_up` cut by rows) and a
Qwen3-VL LoRA fuse to the float64 formula and come off bit for bit; an fp32 LoRA on bf16 and fp8 generates.
The engine's pictures are the pipeline's RGB channels (its RGBA VAE's alpha is left out at decode). What every
family must do (offload modes, fp8, strict forwards) is the conformance suite's."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline
from app.engine.generate import GenerateParams
from tests import family_files as kit

FAMILY = "qwen-image-2.1"
FILE, FOLDER = f"tiny-{FAMILY}.safetensors", f"tiny-{FAMILY}-diffusers"
W = 0.8  # LoRA strength
data, eng, oracle = kit.data, kit.eng, kit.oracle  # the module's fixtures (tests/family_files.py)
params = kit.params


def theirs(pipe, p: GenerateParams, **inputs) -> np.ndarray:
    """The pipeline's pictures, RGB channels; references at the image's area, as the engine hands them over."""
    guidance = {"negative_prompt": p.negative_prompt, "true_cfg_scale": p.cfg} if p.cfg > 1 else {}
    out = pipe(prompt=p.prompt, num_inference_steps=p.steps, height=p.height, width=p.width, output_type="np",
               num_images_per_prompt=p.batch, output_resolution=round((p.width * p.height) ** 0.5), **guidance,
               generator=[torch.Generator().manual_seed(p.seed + i) for i in range(p.batch)], **inputs).images
    return (out[..., :3] * 255).round().astype(np.uint8)


def test_txt2img_equals_qwen_image21_pipeline_without_and_with_cfg(eng, oracle):
    """The file at CFG 1 (no unconditional pass: the pipeline's default) and the folder at CFG 3 with a negative
    prompt (true CFG, A1111's formula) give diffusers' pixels exactly; the negative prompt changes the image."""
    kit.equals_oracle_without_and_with_cfg(eng, oracle, theirs, FILE, FOLDER)


def test_turbo_runs_its_authored_sigmas_at_their_step_count(eng, oracle, data):
    """A folder whose model_index states `sample_sigmas` (Turbo) fills in their count and no guidance, and at
    that count draws the pipeline's own image (its authored schedule); at another count, the linear one."""
    turbo = data / "models/Stable-diffusion" / "tiny-qwen-image-2.1-turbo-diffusers"
    shutil.copytree(data / "models/Stable-diffusion" / FOLDER, turbo, copy_function=os.link)
    index = json.loads((turbo / "model_index.json").read_text())
    (turbo / "model_index.json").unlink()
    (turbo / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": [1.0, 0.7, 0.3]}))
    assert eng.load_model(turbo.name).defaults == (3, 1.0)
    oracle.register_to_config(sample_sigmas=[1.0, 0.7, 0.3])
    try:
        authored = kit.ours(eng.generate(params(steps=3)))
        assert np.array_equal(authored, theirs(oracle, params(steps=3)))
    finally:
        oracle.register_to_config(sample_sigmas=None)
    assert np.array_equal(kit.ours(eng.generate(params(steps=2))), theirs(oracle, params(steps=2)))
    eng.load_model(FOLDER)
    assert not np.array_equal(kit.ours(eng.generate(params(steps=3))), authored)


def test_reference_editing_equals_qwen_image21_pipeline(eng, oracle):
    """One and two reference pictures (other sizes than the output), batch 2: our `edit` gives diffusers'
    pixels exactly and the infotext says how many pictures it read; more than four are refused by name."""
    eng.load_model(FILE)
    pictures = kit.references()
    for refs in (pictures[:1], pictures):
        made = eng.edit(params(batch=2, height=96), refs)
        assert np.array_equal(kit.ours(made), theirs(oracle, params(batch=2, height=96), image=refs)), len(refs)
        assert f"Reference images: {len(refs)}" in made[0].infotext
    assert not np.array_equal(kit.ours(eng.edit(params(), pictures[:1])), kit.ours(eng.generate(params())))
    with pytest.raises(ValueError, match="Qwen-Image 2.1 takes 1 to 4 reference images"):
        eng.edit(params(), pictures * 3)


def test_comfyui_separate_files_fp8_included(eng, data, oracle):
    """What a ComfyUI user has: the bare transformer (fused `img_mlp.gate_up`, here in fp8 e4m3 with ComfyUI's
    per-tensor `weight_scale`) in the checkpoint folder, `qwen3vl_8b.safetensors` in models/text_encoder and the
    VAE in models/VAE. Encoder and VAE load bit for bit; `gate_up`'s rows are the gate, then the up projection."""
    pieces = {"qwen3vl_8b.safetensors": ("text_encoders.qwen3vl_8b.transformer.", "text_encoder"),
              "qwen_image_2.1_vae.safetensors": ("vae.", "vae")}
    fp8 = kit.load_separate_files(eng, oracle, data / "models/Stable-diffusion" / FILE, pieces,
                                  "qwen-image-2.1-fp8.safetensors")
    pipe = eng.pipeline
    mlp = pipe.transformer.transformer_blocks[1].img_mlp
    fused = (fp8["transformer_blocks.1.img_mlp.gate_up.weight"].float()
             * fp8["transformer_blocks.1.img_mlp.gate_up.weight_scale"])
    assert torch.equal(torch.cat([mlp.gate_layer.weight, mlp.proj.weight]), fused)
    assert eng.generate(params())[0].image.size == (64, 64)


# ------------------------------------------------------------------------------------ LoRA formats
def _kohya(transformer, comfy: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA on ComfyUI's module names, fused `gate_up` included (alpha 2 at rank 4), as kohya/musubi write
    it (`lora_unet_…`, lora_down/up, alpha) or as ComfyUI does (`diffusion_model.…`, lora_A/B, alpha folded
    into the down factor); and the float64 ΔW per diffusers module."""
    block = transformer.transformer_blocks[0]
    inner, hidden = block.attn.to_q.in_features, block.img_mlp.proj.out_features
    layers = {"transformer_blocks.0.img_mlp.gate_up": (("img_mlp.gate_layer", "img_mlp.proj"), 2 * hidden, inner),
              "transformer_blocks.1.attn.to_q": (("attn.to_q",), inner, inner),
              "txt_in.in_layer": (("txt_in.in_layer",), inner, transformer.txt_in.in_layer.in_features)}
    state, deltas = {}, {}
    for i, (name, (modules, out_f, in_f)) in enumerate(layers.items()):
        down, up = kit.lora_factors(out_f, in_f, 4, i)
        state |= kit.trainer_keys(name, down, up, comfy)
        delta = (2.0 / 4) * up.double() @ down.double()
        block_path = name.rpartition(".img_mlp")[0] if "img_mlp" in name else ""
        for j, module in enumerate(modules):
            path = f"{block_path}.{module}" if block_path else name
            deltas[path] = delta[j * (out_f // len(modules)):(j + 1) * (out_f // len(modules))]
    return state, deltas


@pytest.mark.parametrize("layout", ["diffusers PEFT", "kohya", "ComfyUI"])
def test_lora_formats_fuse_to_the_formula_on_exactly_their_modules_and_come_off(eng, data, oracle, layout):
    """Fused at 0.8, every module the file covers is W0 + 0.8·ΔW in float64 (a fused `gate_up` cut by rows
    into the gate and the up projection) and no other weight changes; removing it gives every tensor back bit
    for bit."""
    eng.load_model(FILE)
    transformer = eng.pipeline.transformer
    if layout == "diffusers PEFT":
        from diffusers import QwenImage21Pipeline

        name, deltas = kit.saved_peft_lora(data, QwenImage21Pipeline, oracle.transformer,
                                           ["to_q", "to_v", "img_mlp.proj", "img_mlp.out"], "qwen-peft")
    else:
        state, deltas = _kohya(transformer, comfy=layout == "ComfyUI")
        name = f"qwen-{layout.lower()}"
        save_file(state, str(data / "models/Lora" / f"{name}.safetensors"))
    kit.fuses_to_the_formula(eng, name, deltas, W)


def test_a_qwen3_vl_lora_fuses_to_the_formula(eng, data):
    """A kohya LoRA on the Qwen3-VL text encoder (`lora_te_model_language_model_layers_1_self_attn_q_proj`)
    fuses to W0 + 0.8·(α/r)·B·A, changes the image and comes off bit for bit."""
    eng.load_model(FILE)
    q = eng.pipeline.text_encoder.model.language_model.layers[1].self_attn.q_proj
    down, up = kit.lora_factors(q.out_features, q.in_features, 4, 3)
    key = "lora_te_model_language_model_layers_1_self_attn_q_proj"
    save_file({f"{key}.lora_down.weight": down * 10, f"{key}.lora_up.weight": up * 10,
               f"{key}.alpha": torch.tensor(4.0)}, str(data / "models/Lora" / "qwen-te.safetensors"))
    w0, plain = q.weight.detach().clone(), kit.ours(eng.generate(params()))
    eng.set_loras([LoraSpec("qwen-te", W)])
    expected = (w0.double() + W * (up.double() * 10) @ (down.double() * 10)).float()
    torch.testing.assert_close(q.weight.detach(), expected, rtol=2e-6, atol=2e-7)
    assert not np.array_equal(kit.ours(eng.generate(params())), plain)
    eng.set_loras([])
    assert torch.equal(q.weight.detach(), w0)


@pytest.mark.parametrize("weights", ["full", "fp8"])
def test_an_fp32_lora_on_a_bf16_and_an_fp8_stored_model_generates(data, weights):
    """An fp32 kohya LoRA (fused `gate_up` included) on the model computing in bf16 (weights bf16, or fp8 with
    bypass forwards) generates with no dtype error, changes the image, zero violations, and comes off leaving
    the stored bytes as they were."""
    lora = _kohya(build_tiny_pipeline(FAMILY).transformer, comfy=False)[0]
    save_file(lora, str(data / "models/Lora" / "qwen-fp32.safetensors"))
    kit.fp32_lora_generates(data, FILE, "qwen-fp32", params(), weights)


def test_prompt_notes_and_the_memory_estimate_read_its_encoder_and_video_vae():
    """Before a job: the prompt notes of a family whose encoder's "tokenizer" is a Qwen3-VL processor say the
    emphasis is dropped (no length count: the pipeline reads any length), and the memory estimate reads the
    Wan-style VAE's widths (`base_dim` × `dim_mult`, four 2× steps: 16×) from the bundled full-size configs."""
    from app.engine.job_memory import model_shape
    from app.families import family
    from app.prompts.notes import prompt_notes

    fam = family(FAMILY)
    notes = prompt_notes(fam, "a (red:1.3) cube", "")
    assert len(notes) == 1 and "emphasis weights and BREAK have no effect" in notes[0]
    shape = model_shape(fam)
    assert (shape.vae_width, shape.vae_scale) == (144, 16)
