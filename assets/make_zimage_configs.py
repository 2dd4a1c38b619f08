"""Write the bundled Z-Image Turbo / Z-Image (Base) component configs from the libraries' own classes.

Why this exists: Z-Image ships as ComfyUI single files (a transformer, `qwen_3_4b.safetensors`,
`ae.safetensors`) that carry no config, and nothing may be fetched from a hub. The values are those
of the published `Tongyi-MAI/Z-Image-Turbo` and `Tongyi-MAI/Z-Image` folders: the S3-DiT
transformer (30 main + 2 noise-refiner + 2 context-refiner blocks, width 3840, 30 heads of 128, rope
axes 32/48/48 over lengths 1536/512/512, caption width 2560), the Qwen3-4B text encoder (36 layers,
width 2560, 32 query and 8 key/value heads of 128, vocabulary 151,936, rope theta 10^6), the
16-channel FLUX autoencoder (the same file as FLUX.1's, `make_flux_configs.VAE`) and flow-match
Euler with a static time shift: 3.0 for Turbo, 6.0 for Base (the two folders differ only there).
`tests/test_zimage.py` rebuilds them on the meta device and checks the published parameter counts.
Regenerate with

    python assets/make_zimage_configs.py
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
from make_flux_configs import VAE, _diffusers_config, _write
from transformers import Qwen3Config

OUT = Path(__file__).resolve().parent / "configs"
QWEN3_4B = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                       hidden_act="silu", bos_token_id=151643, eos_token_id=151645)
TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                   n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                   rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512))
SHIFTS = {"zimage-turbo": 3.0, "zimage-base": 6.0}
MODEL_INDEX = {
    "_class_name": "ZImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3Model"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "ZImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def write(variant: str) -> Path:
    folder = OUT / variant
    _write(folder / "model_index.json", json.dumps(MODEL_INDEX))
    _write(folder / "transformer" / "config.json", _diffusers_config(ZImageTransformer2DModel, **TRANSFORMER))
    _write(folder / "vae" / "config.json", _diffusers_config(AutoencoderKL, **VAE))
    _write(folder / "scheduler" / "scheduler_config.json",
           FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFTS[variant],
                                           use_dynamic_shifting=False).to_json_string())
    _write(folder / "text_encoder" / "config.json", QWEN3_4B.to_json_string())
    return folder


if __name__ == "__main__":
    for name in SHIFTS:
        print(write(name))
