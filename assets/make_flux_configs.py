"""Write the bundled FLUX.1 [dev] / [schnell] component configs from the libraries' own config classes.

Why this exists: Flux checkpoints are usually single files (a BFL transformer, or a ComfyUI/Forge
all-in-one) that carry no config, and nothing may be fetched from a hub. The full-size
architecture is fixed by the published model cards and by the defaults of diffusers'
`FluxTransformer2DModel` (19 double + 38 single blocks, 24 heads of 128, joint dim 4096, pooled dim
768); the two variants differ only in the guidance embedder (dev is guidance-distilled) and in the
scheduler's time shift (dev: resolution-dependent, schnell: none). The text encoders are CLIP ViT-L/14
and T5 v1.1 XXL (encoder only), the VAE the 16-channel FLUX autoencoder (scale 0.3611, shift 0.1159).
Each config is serialised by its own class (`to_json_string`), so the files hold exactly what those
classes read back; regenerate with

    python assets/make_flux_configs.py
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from transformers import CLIPTextConfig, T5Config

OUT = Path(__file__).resolve().parent / "configs"
CLIP_L = CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                        projection_dim=768, bos_token_id=0, eos_token_id=2, pad_token_id=1)
T5_XXL = T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                  relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
                  layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                  use_cache=False, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
           use_quant_conv=False, use_post_quant_conv=False, force_upcast=True)
SCHEDULERS = {
    "flux-dev": dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                     base_image_seq_len=256, max_image_seq_len=4096),
    "flux-schnell": dict(shift=1.0, use_dynamic_shifting=False, base_shift=0.5, max_shift=1.15,
                         base_image_seq_len=256, max_image_seq_len=4096),
}
MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n")


def _diffusers_config(cls, **kwargs) -> str:
    """A diffusers config as the class registers it (its `__init__` defaults overridden by
    `kwargs`), without building the full-size model; an unknown argument is refused."""
    defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                if name != "self" and p.default is not inspect.Parameter.empty}
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise ValueError(f"{cls.__name__} takes no {sorted(unknown)}")
    return json.dumps({"_class_name": cls.__name__, **defaults, **kwargs})


def write(variant: str) -> Path:
    folder = OUT / variant
    _write(folder / "model_index.json", json.dumps(MODEL_INDEX))
    _write(folder / "transformer" / "config.json",
           _diffusers_config(FluxTransformer2DModel, guidance_embeds=variant == "flux-dev"))
    _write(folder / "vae" / "config.json", _diffusers_config(AutoencoderKL, **VAE))
    _write(folder / "scheduler" / "scheduler_config.json",
           FlowMatchEulerDiscreteScheduler(**SCHEDULERS[variant]).to_json_string())
    _write(folder / "text_encoder" / "config.json", CLIP_L.to_json_string())
    _write(folder / "text_encoder_2" / "config.json", T5_XXL.to_json_string())
    return folder


if __name__ == "__main__":
    for name in SCHEDULERS:
        print(write(name))
