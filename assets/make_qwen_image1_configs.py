"""Write the bundled Qwen-Image (1.0) component configs from the libraries' own classes.

Why this exists: Qwen-Image ships as ComfyUI single files (a transformer, `qwen_2.5_vl_7b.safetensors`,
`qwen_image_vae.safetensors`) that carry no config, and nothing may be fetched from a hub. The transformer's and
the VAE's values are diffusers 0.42.1's defaults for `QwenImageTransformer2DModel` (60 dual-stream blocks, 24
heads of 128, rope axes 16/56/56, Qwen2.5-VL width 3584, 2×2 patches of 16 latent channels) and
`AutoencoderKLQwenImage` (16 channels at 1/8, its per-channel mean and std); the text encoder is
Qwen2.5-VL-7B-Instruct (28 layers, width 3584, 28 query and 4 key/value heads of 128, M-RoPE 16/24/24 at theta
10^6; a 32-block windowed vision tower of width 1280, 14-pixel patches merged 2×2), its `lm_head` tied to the
embedding here (the pipeline reads hidden states; ComfyUI's file has no head). The scheduler is Qwen/Qwen-Image's
published one: flow-match Euler with the exponential resolution-dependent shift (0.5 at 256 tokens to 0.9 at
8192) and a terminal sigma of 0.02. Regenerate with

    python assets/make_qwen_image1_configs.py
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
from make_flux_configs import _diffusers_config, _write
from transformers import Qwen2_5_VLConfig

OUT = Path(__file__).resolve().parent / "configs" / "qwen-image"
QWEN25_VL_7B = Qwen2_5_VLConfig(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                     rms_norm_eps=1e-6, sliding_window=32768, max_window_layers=28, bos_token_id=151643,
                     eos_token_id=151645, rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                                               mrope_section=[16, 24, 24])),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, in_channels=3),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=True, architectures=["Qwen2_5_VLForConditionalGeneration"])
MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}


def write() -> Path:
    _write(OUT / "model_index.json", json.dumps(MODEL_INDEX))
    _write(OUT / "transformer" / "config.json", _diffusers_config(QwenImageTransformer2DModel))
    _write(OUT / "vae" / "config.json", _diffusers_config(AutoencoderKLQwenImage))
    _write(OUT / "scheduler" / "scheduler_config.json",
           FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                           base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                           time_shift_type="exponential").to_json_string())
    _write(OUT / "text_encoder" / "config.json", QWEN25_VL_7B.to_json_string())
    return OUT


if __name__ == "__main__":
    print(write())
