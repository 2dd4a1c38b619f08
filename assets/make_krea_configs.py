"""Write the bundled Krea 2 component configs from the libraries' own classes.

Why this exists: Krea 2 ships as single files (a transformer, the Qwen3-VL-4B encoder, Qwen-Image's VAE) that
carry no config, and nothing may be fetched from a hub. The transformer's and the VAE's values are diffusers
0.42.1's defaults for `Krea2Transformer2DModel` (28 blocks, 48 query and 12 key/value heads of 128, rope axes
32/48/48, 12 tapped layers of width 2560, two text-fusion blocks of each kind) and `AutoencoderKLQwenImage`
(Qwen-Image's: 16 channels at 1/8, its per-channel mean and std); the text encoder is Qwen3-VL-4B-Instruct
(36 layers, width 2560, 32 query and 8 key/value heads of 128, interleaved M-RoPE 24/20/20 at theta 5·10^6; a
24-block vision tower of width 1024, DeepStack layers 5/11/17), read as `Qwen3VLModel`. The scheduler is
flow-match Euler with the resolution-aware exponential shift the pipeline's docstring asks for (0.5 at 256
tokens to 1.15 at 6400); the pipeline's own defaults (the twelve taps 2, 5, …, 35; base, not distilled) are in
model_index.json. Regenerate with

    python assets/make_krea_configs.py
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel
from make_flux_configs import _diffusers_config, _write
from make_qwen_image_configs import QWEN3_VL_8B
from transformers import Qwen3VLConfig

OUT = Path(__file__).resolve().parent / "configs" / "krea-2"
# Qwen3-VL-8B's (Qwen-Image 2.1's) but for its widths, vision depth and DeepStack layers
QWEN3_VL_4B = Qwen3VLConfig(**{
    **QWEN3_VL_8B.to_dict(), "architectures": ["Qwen3VLModel"],
    "text_config": {**QWEN3_VL_8B.text_config.to_dict(), "hidden_size": 2560, "intermediate_size": 9728},
    "vision_config": {**QWEN3_VL_8B.vision_config.to_dict(), "depth": 24, "hidden_size": 1024,
                      "intermediate_size": 4096, "out_hidden_size": 2560, "deepstack_visual_indexes": [5, 11, 17]}})
MODEL_INDEX = {
    "_class_name": "Krea2Pipeline",
    "text_encoder_select_layers": list(range(2, 36, 3)),
    "is_distilled": False,
    "patch_size": 2,
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3VLModel"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "Krea2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}


def write() -> Path:
    _write(OUT / "model_index.json", json.dumps(MODEL_INDEX))
    _write(OUT / "transformer" / "config.json", _diffusers_config(Krea2Transformer2DModel))
    _write(OUT / "vae" / "config.json", _diffusers_config(AutoencoderKLQwenImage))
    _write(OUT / "scheduler" / "scheduler_config.json",
           FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=6400,
                                           time_shift_type="exponential").to_json_string())
    _write(OUT / "text_encoder" / "config.json", QWEN3_VL_4B.to_json_string())
    return OUT


if __name__ == "__main__":
    print(write())
