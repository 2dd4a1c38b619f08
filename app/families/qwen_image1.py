"""Qwen-Image (1.0): a 20B dual-stream DiT over 2×2 patches of its own 16-channel VAE latents (Wan 2.1's VAE), with
the Qwen2.5-VL-7B encoder, 1024² native size (Qwen, Apache-2.0; diffusers' `QwenImagePipeline`, and its img2img
and inpaint pipelines as stages).

Sampled with true CFG (the model card's 50 steps at 4.0): diffusers combines `neg + s·(cond − neg)`, A1111's
CFG at s, then rescales it to the conditional prediction's norm; CFG 1 runs no unconditional pass. The prompt goes
as text into the pipeline's own template (a system turn it drops after encoding), cut at 512 tokens.

Files: a diffusers folder; or ComfyUI's transformer (diffusers' names, bare or under `model.diffusion_model.`,
bf16 or fp8 with `weight_scale`) with `qwen_2.5_vl_7b.safetensors` in `models/text_encoder` (the original
checkpoint's names: `model.layers.…`, `visual.…`) and `qwen_image_vae.safetensors` in `models/VAE` (Wan's names,
`qwen_vae.py`), or an all-in-one under ComfyUI's prefixes. LoRAs: diffusers/PEFT, kohya/musubi-tuner
(`lora_unet_transformer_blocks_0_attn_to_q`) and ComfyUI (`diffusion_model.…`) over diffusers' names.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from pathlib import Path
from types import MappingProxyType

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from app.families import ASSETS_DIR, Adapters, ComponentFile, Family, Files, Precision, TestKit, TextEncoder
from app.families.file_layout import FileTensor, file_name_aliases, own_names
from app.families.flow_dit import DIT_PREFIXES, DIT_SHARED
from app.families.ldm_layout import LYCORIS
from app.families.pipelines import PackedPatches, StrengthSteps, VariedNoise
from app.families.qwen3 import QWEN3_TOKENIZER_DIR, BundledQwen3Tokenizer, expand_into
from app.families.qwen_dit import QWEN_SAMPLING, TrueCfg, native_size
from app.families.qwen_vae import QWEN_IMAGE_LATENTS, QWEN_IMAGE_VAE_PART, TINY_QWEN_IMAGE_VAE


class _Latents(PackedPatches):
    """Qwen-Image's pipelines pack 2×2 patches as FLUX.1's do; their unpacking adds the VAE's frame axis, which the
    engine's spatial latents leave out."""

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return latents if latents.dim() == 4 else super().spatial_latents(latents, height, width)[:, :, 0]


class _TerminalSigma:
    """Qwen-Image's published schedule is stretched to end at a terminal sigma (`shift_terminal` 0.02), which
    diffusers computes as 0 / 0 for a single step: its image would be NaN, so one step is refused by name."""

    def __call__(self, *args, num_inference_steps: int = 50, **kwargs):
        terminal = self.scheduler.config.get("shift_terminal")
        if terminal and num_inference_steps < 2:
            raise ValueError(f"Qwen-Image's schedule ends at a terminal sigma ({terminal:g}), which takes 2 steps or "
                             f"more; got {num_inference_steps}")
        return super().__call__(*args, num_inference_steps=num_inference_steps, **kwargs)


class SteadyQwenImagePipeline(_Latents, _TerminalSigma, TrueCfg, VariedNoise, QwenImagePipeline):
    """Qwen-Image txt2img."""


class SteadyQwenImageImg2ImgPipeline(_Latents, _TerminalSigma, TrueCfg, StrengthSteps, QwenImageImg2ImgPipeline):
    """Qwen-Image img2img (and the hires pass): it reads the latents the engine encoded (16 channels)."""


class SteadyQwenImageInpaintPipeline(_Latents, _TerminalSigma, TrueCfg, StrengthSteps, QwenImageInpaintPipeline):
    """Qwen-Image inpaint: the regular transformer, the latent mask blends the init latents in each step."""


_QWEN3_ONLY = 151665  # Qwen3's tokens from this id on (`<tool_response>`, `</tool_response>`, `<think>`, `</think>`)
# What the pipeline keeps of its templated prompt (it drops the system turn and `<|im_start|>user\n`): the prompt and
# the turn's end, so a prompt's length is counted as the pipeline cuts it (`Sampling.max_sequence_length`).
_KEPT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _without_qwen3_tokens(added):
    """Added tokens (tokenizer.json's list, or tokenizer_config.json's map by id) without Qwen3's own four."""
    if isinstance(added, list):
        return [token for token in added if token["id"] < _QWEN3_ONLY]
    return {i: token for i, token in added.items() if int(i) < _QWEN3_ONLY}


class BundledQwen25Tokenizer(BundledQwen3Tokenizer):
    """`from_pretrained(folder)` for Qwen2.5-VL's tokenizer, made from the bundled Qwen3 one (`folder`): the same
    byte-level BPE vocabulary and merges and the same 22 special tokens; Qwen3 adds four after them, which Qwen2.5
    reads as plain text, so they are left out. One tokenizer per process."""

    @staticmethod
    @functools.cache
    def _load(folder: Path) -> Qwen2Tokenizer:
        with tempfile.TemporaryDirectory(prefix="qwen25-tokenizer-") as tmp:
            expand_into(folder, Path(tmp))
            for name, key in (("tokenizer.json", "added_tokens"), ("tokenizer_config.json", "added_tokens_decoder")):
                spec = json.loads((Path(tmp) / name).read_text())
                spec[key] = _without_qwen3_tokens(spec[key])
                if name == "tokenizer_config.json":
                    spec["chat_template"] = _KEPT_TEMPLATE
                (Path(tmp) / name).write_text(json.dumps(spec))
            return Qwen2Tokenizer.from_pretrained(tmp, local_files_only=True)


# transformers' names -> the original checkpoint's (ComfyUI's file): the language model and the vision tower at the top
_ORIGINAL = (("model.language_model.", "model."), ("model.visual.", "visual."))


def _encoder_layout(model) -> dict[str, FileTensor]:
    return {name: FileTensor(next((theirs + name[len(ours):] for ours, theirs in _ORIGINAL if name.startswith(ours)),
                                  name)) for name in own_names(model)}


QWEN25_VL = TextEncoder("text_encoder", "tokenizer", Qwen2_5_VLForConditionalGeneration,
                        single_file_prefix="text_encoders.qwen25_7b.transformer.", config_class=Qwen2_5_VLConfig,
                        tokenizer_class=BundledQwen25Tokenizer, tokenizer_dir=QWEN3_TOKENIZER_DIR, reads="text",
                        chunked=False)
_PARTS = (
    ComponentFile("transformer", "transformer", QwenImageTransformer2DModel, ("model.diffusion_model.", ""),
                  "transformer_blocks.0.txt_mod.1.weight", own_names),
    ComponentFile("text_encoder", "Qwen2.5-VL text encoder (qwen_2.5_vl_7b.safetensors)",
                  Qwen2_5_VLForConditionalGeneration, (QWEN25_VL.single_file_prefix, ""), "visual.merger.ln_q.weight",
                  _encoder_layout, folder="text_encoder_dir", config_class=Qwen2_5_VLConfig),
    QWEN_IMAGE_VAE_PART,
)
# Tiny: the real 64 patch channels, 2 blocks of 2 heads × 8 with rope axes 2/2/4; Qwen2.5-VL with the real
# vocabulary, 2 layers with M-RoPE and a 2-block windowed vision tower of the real 14-pixel patches.
_TINY = MappingProxyType({
    "transformer": dict(in_channels=64, out_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                        joint_attention_dim=32, axes_dims_rope=(2, 2, 4)),
    "vae": TINY_QWEN_IMAGE_VAE,
    "text_encoder": dict(
        text_config=dict(vocab_size=152064, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
                             rope_type="default", rope_theta=1000000.0, mrope_section=[2, 1, 1])),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=37, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1]),
        tie_word_embeddings=True),
})
# Every layer kind: both streams' attention projections and outputs, both MLPs, both modulations, the embedders, the
# final layers, and Qwen2.5-VL's attention, MLP and vision tower.
_LORA_TARGETS = tuple(f"transformer.{m}" for m in (
    "transformer_blocks.0.attn.to_q", "transformer_blocks.*.attn.to_out.0", "transformer_blocks.1.attn.add_k_proj",
    "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.img_mlp.net.0.proj",
    "transformer_blocks.1.txt_mlp.net.2", "transformer_blocks.0.img_mod.1", "transformer_blocks.1.txt_mod.1", "txt_in",
    "img_in", "norm_out.linear", "proj_out")) + tuple(f"text_encoder.model.{m}" for m in (
    "language_model.layers.0.self_attn.q_proj", "language_model.layers.1.mlp.down_proj", "visual.blocks.0.attn.qkv"))
_DEMO_LORA_TARGETS = (
    ("transformer.*attn.to_[qkv]", "transformer.*attn.to_out.0", "text_encoder.*self_attn.[qkvo]_proj"),
    ("transformer.*_mlp.*", "text_encoder.*language_model*mlp.*_proj"),
)


def lora_aliases(transformer):
    """(key, parts, spelling) for each module under diffusers' names as kohya/musubi-tuner (`lora_unet_…`), LyCORIS
    and ComfyUI (`diffusion_model.…`, bare or under that prefix) write them."""
    yield from file_name_aliases(own_names(transformer), "transformer", "kohya", LYCORIS, "ComfyUI (diffusion_model.)")


QWEN_IMAGE = Family(
    name="qwen-image",
    label="Qwen-Image",
    pipeline_class=SteadyQwenImagePipeline,
    stage_pipelines=MappingProxyType({"img2img": SteadyQwenImageImg2ImgPipeline,
                                      "inpaint": SteadyQwenImageInpaintPipeline}),
    diffusers_pipeline="QwenImagePipeline",
    text_encoders=(QWEN25_VL,),
    files=Files(ASSETS_DIR / "configs" / "qwen-image", marker_prefixes=DIT_PREFIXES, parts=_PARTS,
                checkpoint_markers=("txt_norm.weight", "transformer_blocks.0.txt_mod.1.weight",
                                    "transformer_blocks.0.img_mlp.net.0.proj.weight"),
                takes_embeddings=False),  # A1111 embeddings are CLIP vectors; Qwen2.5-VL has none
    denoiser_class=QwenImageTransformer2DModel,
    vae_class=AutoencoderKLQwenImage,
    **{**DIT_SHARED, "native_size": native_size},
    latent_format=QWEN_IMAGE_LATENTS,
    first_block="transformer_blocks.0",
    # the model card's 50 steps at CFG 4; the pipeline cuts the templated prompt at 512 tokens
    sampling=dataclasses.replace(QWEN_SAMPLING, default_steps=50, default_guidance=4.0, max_sequence_length=512),
    precision=Precision(
        fp16_ok=False,
        # fp8 storage keeps the embedders, the text norm and the final layers in the compute dtype
        high_precision=("img_in", "txt_in", "txt_norm", "time_text_embed", "norm_out", "proj_out", "lm_head"),
        pinned_dtypes={"text_encoder.*rotary*inv_freq": torch.float32}),  # transformers keeps them fp32
    adapters=Adapters(markers=("qwen_image", "qwen-image", "qwenimage"), native_modules=lora_aliases),
    test_kit=TestKit(tiny_configs=_TINY, lora_targets=_LORA_TARGETS,
                     demo_lora_targets=_DEMO_LORA_TARGETS))
FAMILIES = (QWEN_IMAGE,)
