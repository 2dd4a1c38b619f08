"""Write the bundled Qwen-Image 2.1 component configs from the libraries' own classes.

Why this exists: Qwen-Image 2.1 ships as ComfyUI single files (a transformer, `qwen3vl_8b.safetensors`, a VAE)
that carry no config, and nothing may be fetched from a hub. The transformer's and the VAE's values are
diffusers 0.42.1's defaults for `QwenImage21Transformer2DModel` (32 single-stream blocks, 32 heads of 128, rope
axes 16/56/56, Qwen3-VL width 4096, 64 latent channels) and `AutoencoderKLQwenImage21` (RGBA in and out,
64-channel latents at 1/16, their per-channel mean and std); the text encoder is Qwen3-VL-8B (36 layers, width
4096, 32 query and 8 key/value heads of 128, interleaved M-RoPE 24/20/20 at theta 5·10^6; a 27-block vision
tower of width 1152, 16-pixel patches merged 2×2, DeepStack layers 8/16/24), its `lm_head` tied to the
embedding (never read). The scheduler is flow-match Euler with the resolution-dependent shift the pipeline
falls back to (0.5 at 256 tokens to 1.15 at 4096). Regenerate with

    python assets/make_qwen_image_configs.py
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
from make_flux_configs import _diffusers_config, _write
from transformers import Qwen3VLConfig

OUT = Path(__file__).resolve().parent / "configs" / "qwen-image-2.1"
QWEN3_VL_8B = Qwen3VLConfig(
    text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                     rms_norm_eps=1e-6, attention_bias=False, bos_token_id=151643, eos_token_id=151645,
                     rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                          mrope_interleaved=True)),
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh", in_channels=3),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=True, architectures=["Qwen3VLForConditionalGeneration"])
MODEL_INDEX = {
    "_class_name": "QwenImage21Pipeline",
    "sample_sigmas": None,
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage21"],
}


def write() -> Path:
    _write(OUT / "model_index.json", json.dumps(MODEL_INDEX))
    _write(OUT / "transformer" / "config.json", _diffusers_config(QwenImage21Transformer2DModel))
    _write(OUT / "vae" / "config.json", _diffusers_config(AutoencoderKLQwenImage21))
    _write(OUT / "scheduler" / "scheduler_config.json",
           FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096).to_json_string())
    _write(OUT / "text_encoder" / "config.json", QWEN3_VL_8B.to_json_string())
    return OUT


if __name__ == "__main__":
    print(write())
