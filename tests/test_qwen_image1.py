"""Qwen-Image (1.0)'s own behaviour, on the tiny model: our images equal diffusers' `QwenImagePipeline`'s, and its
img2img and inpaint stages `QwenImageImg2ImgPipeline`'s and `QwenImageInpaintPipeline`'s, on the same weights, seed
and settings, bit for bit on the CPU in fp32 (without and with true CFG); ComfyUI's separate files under their own
names (the encoder's original checkpoint names, Wan's VAE names, an fp8 transformer with `weight_scale`); the
Qwen2.5 tokenizer made from the bundled Qwen3 one, and prompt notes counted as the pipeline cuts; a PEFT LoRA saved by
diffusers, kohya and ComfyUI LoRAs fuse to the float64 formula on exactly their modules and come off bit for bit; an
fp32 LoRA on bf16 and fp8 generates. What every family must do (offload modes, fp8, strict forwards, stages in every
mode) is the conformance suite's."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImagePipeline,
)
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from PIL import Image
from safetensors.torch import save_file
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping

from app.demo import build_tiny_pipeline
from app.engine.generate import GenerateParams
from app.families import family
from app.families.qwen3 import QWEN3_TOKENIZER_DIR, BundledQwen3Tokenizer
from app.families.qwen_vae import wan_layout
from tests import family_files as kit

FAMILY = "qwen-image"
FILE, FOLDER = f"tiny-{FAMILY}.safetensors", f"tiny-{FAMILY}-diffusers"
W = 0.8  # LoRA strength
data, eng, oracle = kit.data, kit.eng, kit.oracle  # the module's fixtures (tests/family_files.py)


def _call(pipe, p: GenerateParams, **inputs) -> np.ndarray:
    """A pipeline's pictures for the page's settings: CFG is `true_cfg_scale` (1: no unconditional pass)."""
    guidance = {"negative_prompt": p.negative_prompt} if p.cfg > 1 else {}
    out = pipe(prompt=p.prompt, num_inference_steps=p.steps, height=p.height, width=p.width, output_type="np",
               true_cfg_scale=p.cfg, num_images_per_prompt=p.batch, **guidance, **inputs,
               generator=[torch.Generator().manual_seed(p.seed + i) for i in range(p.batch)]).images
    return (out * 255).round().astype(np.uint8)


def _picture() -> Image.Image:
    ramp = np.linspace(0, 255, 64 * 64, dtype=np.float32).reshape(64, 64)
    return Image.fromarray(np.stack([ramp, ramp.T, 255 - ramp], -1).astype(np.uint8))


def _init_latents(pipe, picture: Image.Image, p: GenerateParams) -> torch.Tensor:
    """The picture's latents for batch item i by diffusers' own encode (`_encode_vae_image`: the VAE's sample drawn
    from a generator seeded seed + i, normalised), from A1111's pixels (x / 127.5 − 1); (batch, 16, h, w)."""
    pixels = torch.from_numpy(np.asarray(picture, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
    batch = pixels[None, :, None].repeat(p.batch, 1, 1, 1, 1)
    generators = [torch.Generator().manual_seed(p.seed + i) for i in range(p.batch)]
    return pipe._encode_vae_image(batch, generators)[:, :, 0]


def test_txt2img_equals_qwen_image_pipeline_without_and_with_cfg(eng, oracle):
    """The file at CFG 1 (no unconditional pass) and the folder at CFG 3 with a negative prompt (true CFG:
    `neg + 3·(cond − neg)`, then the pipeline's rescale to the conditional norm) give diffusers' pixels exactly; the
    negative prompt changes the image. The page fills in the model card's 50 steps at CFG 4."""
    assert eng.load_model(FILE).defaults == (50, 4.0)
    kit.equals_oracle_without_and_with_cfg(eng, oracle, _call, FILE, FOLDER)


def test_one_step_is_refused_by_name_and_the_model_stays(eng):
    """One step of Qwen-Image's terminal-stretched schedule is NaN in diffusers: txt2img and img2img refuse it with
    the reason (not the NaN check's "values out of range"), and the next job runs on the same model."""
    eng.load_model(FILE)
    for job in (lambda p: eng.generate(p), lambda p: eng.img2img(p, [_picture()], denoising_strength=1.0)):
        with pytest.raises(ValueError, match="terminal sigma .* takes 2 steps or more; got 1"):
            job(kit.params(steps=1))
    assert eng.generate(kit.params())[0].image.size == (64, 64)


def test_img2img_equals_qwen_image_img2img_pipeline(eng, oracle):
    """img2img at strength 0.5 over 4 steps (2 run; diffusers' and A1111's step rules agree there), CFG 3, batch 2:
    given the latents its own encode makes, `QwenImageImg2ImgPipeline` draws our pixels exactly."""
    eng.load_model(FOLDER)
    p = kit.params(steps=4, cfg=3.0, negative_prompt="blurry", batch=2)
    made = kit.ours(eng.img2img(p, [_picture()], denoising_strength=0.5))
    stage = QwenImageImg2ImgPipeline(**oracle.components)
    stage.set_progress_bar_config(disable=True)
    assert np.array_equal(made, _call(stage, p, image=_init_latents(stage, _picture(), p), strength=0.5))


def test_inpaint_equals_qwen_image_inpaint_pipeline(eng, oracle):
    """Inpaint of the left half (no blur), strength 0.75 over 4 steps (3 run): `QwenImageInpaintPipeline`, given the
    same latents and the latent mask, repaints the left half as we do, and we keep the right half's pixels."""
    eng.load_model(FILE)
    p, mask = kit.params(steps=4), np.zeros((64, 64), dtype=bool)
    mask[:, :32] = True
    made = kit.ours(eng.inpaint(p, _picture(), Image.fromarray(mask), denoising_strength=0.75, mask_blur=0))
    stage = QwenImageInpaintPipeline(**oracle.components)
    stage.set_progress_bar_config(disable=True)
    latents = _init_latents(stage, _picture(), p)
    small = torch.zeros(1, 1, 8, 8)
    small[..., :4] = 1
    theirs = _call(stage, p, image=latents, mask_image=small, masked_image_latents=latents, strength=0.75)
    assert np.array_equal(made, np.where(mask[None, ..., None], theirs, np.asarray(_picture())[None]))
    assert not np.array_equal(made[:, :, :32], np.asarray(_picture())[None, :, :32])


def test_file_names_are_comfyuis_read_as_the_libraries_read_them():
    """The VAE file's names are Wan's: diffusers' `convert_wan_vae_to_diffusers` maps each of ours back to our
    tensor, on the full-size VAE (three resnets and an upsampler per decoder stage); the encoder file's are the
    original checkpoint's, which transformers' own renaming rules for Qwen2.5-VL map to ours."""
    config = {k: v for k, v in AutoencoderKLQwenImage.load_config(family(FAMILY).files.config_dir / "vae").items()
              if not k.startswith("_")}
    with torch.device("meta"):
        vae = AutoencoderKLQwenImage(**config)
    theirs = {where.key: name for name, where in wan_layout(vae).items()}
    assert "decoder.middle.0.residual.0.gamma" in theirs and len(theirs) == len(vae.state_dict())
    assert convert_wan_vae_to_diffusers({k: k for k in theirs}) == {name: k for k, name in theirs.items()}
    encoder = build_tiny_pipeline(FAMILY).text_encoder
    legacy = ("^visual", r"^model(?!\.(language_model|visual))")  # transformers' rules for the original names
    rules = [(t.source_patterns[0], t.target_patterns[0]) for t in get_model_conversion_mapping(encoder)
             if isinstance(t, WeightRenaming) and t.source_patterns[0] in legacy]
    part = family(FAMILY).files.parts[1]
    assert part.model_class is Qwen2_5_VLForConditionalGeneration and len(rules) == 2
    for name, where in part.layout(encoder).items():
        assert re.sub(rules[1][0], rules[1][1], re.sub(rules[0][0], rules[0][1], where.key)) == name, where.key
    assert part.layout(encoder)["model.language_model.layers.0.self_attn.q_proj.bias"].key == \
        "model.layers.0.self_attn.q_proj.bias"


def test_a_text_encoder_folder_with_qwen3_and_qwen25_files_offers_each_its_own():
    """ComfyUI's `qwen_3_4b.safetensors` (Z-Image's) and `qwen_2.5_vl_7b.safetensors` both name their layers
    `model.layers.…`: each part's marker is found in its own file only (Qwen3's is a query norm Qwen2.5 has not), so
    neither family is asked to choose between them."""
    from transformers import Qwen3Config, Qwen3Model

    from app.families.qwen3 import QWEN3_PART

    with torch.device("meta"):
        qwen3 = Qwen3Model(Qwen3Config(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64))
    files = {"qwen3": {"model." + w.key for w in QWEN3_PART.layout(qwen3).values()},
             "qwen25": {w.key for w in family(FAMILY).files.parts[1].layout(build_tiny_pipeline(FAMILY).text_encoder)
                        .values()}}
    for part, own in ((QWEN3_PART, "qwen3"), (family(FAMILY).files.parts[1], "qwen25")):
        assert [name for name, keys in files.items() if any(p + part.marker in keys for p in part.prefixes)] == [own]


def test_comfyui_separate_files_fp8_included(eng, data, oracle):
    """What a ComfyUI user has: the bare transformer (here in fp8 e4m3 with ComfyUI's per-tensor `weight_scale`) in
    the checkpoint folder, `qwen_2.5_vl_7b.safetensors` in models/text_encoder and `qwen_image_vae.safetensors`
    (Wan's names) in models/VAE. Encoder and VAE load bit for bit; each fp8 weight is its bytes times its scale."""
    pieces = {"qwen_2.5_vl_7b.safetensors": ("text_encoders.qwen25_7b.transformer.", "text_encoder"),
              "qwen_image_vae.safetensors": ("vae.", "vae")}
    fp8 = kit.load_separate_files(eng, oracle, data / "models/Stable-diffusion" / FILE, pieces,
                                  "qwen-image-fp8.safetensors")
    q = eng.pipeline.transformer.transformer_blocks[1].attn.add_q_proj
    key = "transformer_blocks.1.attn.add_q_proj.weight"
    assert torch.equal(q.weight, fp8[key].float() * fp8[key.replace(".weight", ".weight_scale")])
    assert eng.generate(kit.params())[0].image.size == (64, 64)


def test_the_qwen25_tokenizer_and_prompt_notes_count_as_the_pipeline_cuts(oracle):
    """The Qwen2.5 tokenizer is the bundled Qwen3 one without Qwen3's four added tokens (151,665 tokens, `<think>`
    read as text), every other text tokenized alike; a prompt the pipeline cuts at 512 tokens gets a note whose
    count is what the pipeline keeps of its templated prompt (it drops the template's first 34 tokens)."""
    from app.prompts.notes import prompt_notes

    tokenizer, qwen3 = oracle.tokenizer, BundledQwen3Tokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)
    assert len(tokenizer) == 151665 and len(qwen3) == 151669
    assert len(tokenizer("<think>")["input_ids"]) > 1 and len(qwen3("<think>")["input_ids"]) == 1
    text = "<|im_start|>user\na red cube, 東京 <|vision_start|><|image_pad|> 123<|im_end|>"
    assert tokenizer(text)["input_ids"] == qwen3(text)["input_ids"]
    long = ", ".join(["a red cube on a table"] * 90)
    templated = tokenizer(oracle.prompt_template_encode.format(long))["input_ids"]
    kept = len(templated) - oracle.prompt_template_encode_start_idx
    notes = prompt_notes(family(FAMILY), long, "")
    assert kept > 512 and any(f"is {kept} tokens long" in n and "reads 512" in n for n in notes), notes
    assert prompt_notes(family(FAMILY), "a red cube", "") == []


# ------------------------------------------------------------------------------------ LoRA formats
def _trainer_lora(transformer, layout: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA on diffusers' module names (alpha 2 at rank 4) as kohya/musubi write it (`lora_unet_…`), as ComfyUI
    does (`diffusion_model.…`) or bare with kohya's suffixes (Qwen-Image-Lightning's files), and the float64 ΔW per
    module."""
    state, deltas = {}, {}
    for i, name in enumerate(("transformer_blocks.0.attn.to_q", "transformer_blocks.1.txt_mlp.net.2",
                              "transformer_blocks.0.img_mod.1", "img_in")):
        module = transformer.get_submodule(name)
        down, up = kit.lora_factors(module.out_features, module.in_features, 4, i)
        keys = kit.trainer_keys(name, down, up, layout == "ComfyUI")
        if layout == "bare":  # kohya's suffixes on the module's own name
            keys = {k.replace("lora_unet_" + name.replace(".", "_"), name): v for k, v in keys.items()}
        state |= keys
        deltas[name] = (2.0 / 4) * up.double() @ down.double()
    return state, deltas


@pytest.mark.parametrize("layout", ["diffusers PEFT", "kohya", "ComfyUI", "bare"])
def test_lora_formats_fuse_to_the_formula_on_exactly_their_modules_and_come_off(eng, data, oracle, layout):
    """Fused at 0.8, every module the file covers is W0 + 0.8·ΔW in float64 and no other weight changes; removing
    it gives every tensor back bit for bit."""
    eng.load_model(FILE)
    if layout == "diffusers PEFT":
        name, deltas = kit.saved_peft_lora(data, QwenImagePipeline, oracle.transformer,
                                           ["to_q", "add_k_proj", "to_add_out", "img_mlp.net.0.proj"], "qwen1-peft")
    else:
        state, deltas = _trainer_lora(eng.pipeline.transformer, layout)
        name = f"qwen1-{layout.lower()}"
        save_file(state, str(data / "models/Lora" / f"{name}.safetensors"))
    kit.fuses_to_the_formula(eng, name, deltas, W)


@pytest.mark.parametrize("weights", ["full", "fp8"])
def test_an_fp32_lora_on_a_bf16_and_an_fp8_stored_model_generates(data, weights):
    """An fp32 kohya LoRA on the model computing in bf16 (weights bf16, or fp8 with bypass forwards) generates with
    no dtype error, changes the image, zero violations, and comes off leaving the stored bytes as they were."""
    lora = _trainer_lora(build_tiny_pipeline(FAMILY).transformer, "kohya")[0]
    save_file(lora, str(data / "models/Lora" / "qwen1-fp32.safetensors"))
    kit.fp32_lora_generates(data, FILE, "qwen1-fp32", kit.params(), weights)
