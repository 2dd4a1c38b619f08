"""The Qwen3-VL text encoder as a part of a family (Qwen-Image 2.1's Qwen3-VL-8B): processor, names, file.

Why here: Qwen3-VL reads the prompt and the reference pictures together (each picture fills the vision
slots the chat template reserves for it), so its pipeline attribute is a `Qwen3VLProcessor`, not a
tokenizer. What the processor needs is bundled, nothing downloaded:

* the tokenizer is the Qwen3 one in `assets/qwen3_tokenizer/` (Qwen3-VL ships the same byte-level BPE
  and special tokens: `<|vision_start|>`, `<|image_pad|>`, …; `app/families/qwen3.py` expands it);
* the image processor's settings are Qwen3-VL's published `preprocessor_config.json` (16-pixel patches
  merged 2×2, mean and std 0.5, up to 4096² pixels), stated below rather than shipped as a file, but for its
  smallest picture, 32² instead of 256²: the published one enlarges a smaller picture for the vision tower and
  not for the VAE, so a reference below 256² would fill more vision slots than it has latents (diffusers'
  pipeline then fails); from 256² up both give the same pixels;
* the chat template renders only what the pipelines ask of it (system and user turns of text and
  pictures, as Qwen3-VL's own template renders them): Qwen-Image 2.1 formats its prompts with its own
  template string and reads the template only to count the system turn's tokens.

A separate file (ComfyUI's `models/text_encoders/qwen3vl_8b*.safetensors`) holds transformers' own names
(`model.language_model.…`, `model.visual.…`); its `lm_head` is never read (the pipeline takes hidden states,
and the bundled configs tie it to the embedding). transformers keeps the rotary `inv_freq` in fp32 whatever
the model's dtype, so a family pins it (`QWEN3_VL_PINNED`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import MappingProxyType

import torch
from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from app.families import ComponentFile, TextEncoder
from app.families.file_layout import own_names
from app.families.qwen3 import QWEN3_TOKENIZER_DIR, BundledQwen3Tokenizer

_IMAGES = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
               image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 32 * 32, "longest_edge": 4096 * 4096})
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class BundledQwen3VLProcessor:
    """`from_pretrained(folder)` for the bundled processor (`TextEncoder.tokenizer_class`); `folder` is the
    Qwen3 tokenizer's. One processor per process: the app never changes it."""

    @staticmethod
    @functools.cache
    def _load(folder: Path) -> Qwen3VLProcessor:
        return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**_IMAGES),
                                tokenizer=BundledQwen3Tokenizer.from_pretrained(folder),
                                video_processor=Qwen3VLVideoProcessor(), chat_template=_CHAT_TEMPLATE)

    @classmethod
    def from_pretrained(cls, folder: Path, **kwargs) -> Qwen3VLProcessor:
        if kwargs:
            raise TypeError(f"the bundled Qwen3-VL processor takes no options, got {sorted(kwargs)}")
        return cls._load(Path(folder))


QWEN3_VL_PINNED = {"text_encoder.*rotary*inv_freq": torch.float32}  # the text's and the vision tower's


# The pipeline reads the prompt as text, through its own template, at any length (`reads="text"`); in a ComfyUI
# all-in-one the encoder sits under `text_encoders.qwen3vl_8b.transformer.`, alone in `models/text_encoder`.
QWEN3_VL = TextEncoder("text_encoder", "processor", Qwen3VLForConditionalGeneration,
                       single_file_prefix="text_encoders.qwen3vl_8b.transformer.", config_class=Qwen3VLConfig,
                       tokenizer_class=BundledQwen3VLProcessor, tokenizer_dir=QWEN3_TOKENIZER_DIR, reads="text",
                       chunked=False)
QWEN3_VL_PART = ComponentFile("text_encoder", "Qwen3-VL text encoder (qwen3vl_8b.safetensors)",
                              Qwen3VLForConditionalGeneration, (QWEN3_VL.single_file_prefix, ""),
                              "model.language_model.layers.0.self_attn.q_proj.weight", own_names,
                              folder="text_encoder_dir", config_class=Qwen3VLConfig)
# Tiny (tests, the demo): the real vocabulary (the bundled tokenizer), 2 text layers with interleaved M-RoPE, and a
# 2-block vision tower whose 16-pixel patches and 2×2 merge are the real ones (a picture's vision slots are then
# a quarter of its 16× VAE latents, as the pipelines need).
TINY_QWEN3_VL = MappingProxyType(dict(
    text_config=dict(vocab_size=151936, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                     rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[2, 1, 1],
                                          mrope_interleaved=True)),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=37, num_heads=2, out_hidden_size=32,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                       deepstack_visual_indexes=[1]),
    tie_word_embeddings=True))
