"""Write the bundled FLUX.2 [klein] 4B / 9B component configs from the libraries' own config classes.

Why this exists: Klein ships as single files (BFL's and ComfyUI's transformer, `qwen_3_4b.safetensors`,
`flux2-vae.safetensors`) that carry no config, and nothing may be fetched from a hub. The full-size
architecture is fixed by the published model cards and diffusers' `Flux2Transformer2DModel`: 4B = 5
double + 20 single blocks, 24 heads of 128 (3072 wide), context 7680 = 3 × Qwen3-4B's 2560; 9B = 8 + 24
blocks, 32 heads (4096 wide), context 12288 = 3 × Qwen3-8B's 4096; no guidance embedder (guidance is
CFG on the base models, absent on the distilled ones); the VAE is FLUX.2's 32-channel autoencoder with
its latent batch norm; the text encoders Qwen3-4B and Qwen3-8B (36 layers, 8 KV heads of 128; vocabulary
151,936; RoPE theta 1e6). Two choices are ours, both for single files only (a diffusers folder brings
its own configs):

* `tie_word_embeddings: true` on both encoders: the pipeline reads hidden states, never the `lm_head`,
  so it is tied to the embedding rather than read (InvokeAI does the same); Qwen3-8B's untied 1.2 GB
  head in bf16 is not loaded;
* `is_distilled: true` in model_index.json: the released Klein files are distilled; a "base" file
  is told apart by its name (`app/families/klein.py`).

The scheduler is FLUX.2's flow-match Euler with dynamic shifting (the pipeline passes `mu`). Regenerate with

    python assets/make_klein_configs.py
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
from make_flux_configs import OUT, SCHEDULERS, _diffusers_config, _write
from transformers import Qwen3Config

QWEN3 = dict(vocab_size=151936, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
             attention_bias=False, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
VARIANTS = {
    "flux2-klein-4b": (dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680),
                       dict(QWEN3, hidden_size=2560, intermediate_size=9728)),
    "flux2-klein-9b": (dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288),
                       dict(QWEN3, hidden_size=4096, intermediate_size=12288)),
}
TRANSFORMER = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256,
                   mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False)
MODEL_INDEX = {
    "_class_name": "Flux2KleinPipeline",
    "is_distilled": True,
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3ForCausalLM"],
    "tokenizer": ["transformers", "Qwen2TokenizerFast"],
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}


def write(variant: str) -> Path:
    transformer, qwen3 = VARIANTS[variant]
    folder = OUT / variant
    _write(folder / "model_index.json", json.dumps(MODEL_INDEX))
    _write(folder / "transformer" / "config.json", _diffusers_config(Flux2Transformer2DModel, **TRANSFORMER,
                                                                    **transformer))
    _write(folder / "vae" / "config.json", _diffusers_config(AutoencoderKLFlux2))  # its defaults are FLUX.2's VAE
    _write(folder / "scheduler" / "scheduler_config.json",
           FlowMatchEulerDiscreteScheduler(**SCHEDULERS["flux-dev"]).to_json_string())
    _write(folder / "text_encoder" / "config.json", Qwen3Config(**qwen3).to_json_string())
    return folder


if __name__ == "__main__":
    for name in VARIANTS:
        print(write(name))
