"""Parts the families share: tiny component configs, LoRA target globs, what SD1.5 and SDXL state alike
(their bench's UNet call and LoRA layers too).

Why here: SD1.5, SDXL and FLUX.1 use the same CLIP-L text encoder and the same VAE structure, so
their tiny demo configs (what `app/demo.py` writes and the tests build) start from the same
dicts; each family file states the rest. Sizes: vocab_size and max_position_embeddings stay real
so the bundled tokenizers work unchanged; four VAE levels like the real VAE (downscale 8), so a
512² image is a 64² latent (two levels would give 256², whose attention is far too slow on a CPU).
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from app.families import Adapters, BenchSpec, TestKit
from app.families.ldm_layout import lora_aliases

TINY_CLIP_L = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=0, eos_token_id=2, pad_token_id=1,
                   hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=3,
                   hidden_act="quick_gelu", projection_dim=32)
TINY_VAE = dict(block_out_channels=(16, 16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, layers_per_block=1,
                norm_num_groups=16, sample_size=64)
TINY_UNET = dict(sample_size=8, block_out_channels=(32, 64), norm_num_groups=32)

# A spread of layer kinds for test LoRAs: linear with and without bias, 1×1 and 3×3 convs with
# bias, the cross-attention key (its input width tells SD1.5 from SDXL), norms, text encoders.
SD_LORA_TARGETS = (
    "unet.*attentions.0.proj_in",
    "unet.*attentions.0.transformer_blocks.0.attn1.to_q",
    "unet.*attentions.0.transformer_blocks.0.attn1.to_out.0",
    "unet.*attentions.0.transformer_blocks.0.attn2.to_k",
    "unet.*attentions.0.transformer_blocks.0.norm1",
    "unet.*resnets.0.norm1",
    "unet.*resnets.0.conv1",
    "unet.*resnets.0.conv_shortcut",
    "unet.*resnets.0.time_emb_proj",
    "text_encoder*.layers.0.self_attn.q_proj",
    "text_encoder*.layers.0.mlp.fc1",
    "text_encoder*.layers.0.layer_norm1",
)
# The demo's two LoRAs on a UNet: a style LoRA on attention and the text encoders, a detail LoCon on the resnets.
DEMO_LORA_TARGETS = (
    ("unet.*attn[12].to_[qkv]", "unet.*attn[12].to_out.0", "unet.*attentions.*.proj_[io]*",
     "text_encoder*.self_attn.*_proj", "text_encoder*.mlp.fc[12]"),
    ("unet.*resnets.*.conv[12]", "unet.*resnets.*.time_emb_proj", "unet.*samplers.0.conv"),
)


def unet_inpainting(pipe) -> bool:
    """An SD inpainting checkpoint: its UNet also reads the mask and the masked-image latents (9 channels)."""
    return pipe.unet.config.in_channels != pipe.vae.config.latent_channels


# The bench LoRAs' layers on a UNet: attention projections and feed-forward linears; the LoCon adds resnet 3×3 convs.
_BENCH_LORA_LAYERS = r"\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$"
_BENCH_LORA_CONVS = r"resnets\.\d+\.conv[12]$"
_CLIP_TOKENS = 77  # CLIP's sequence length


def unet_call_inputs(_fam, cfg, rows: int, latent_side: int, empty) -> dict:
    """One UNet call for the bench's op counts: a spatial latent and CLIP states, plus SDXL's pooled
    text and size ids (`text_time`); rows are the CFG-doubled batch."""
    inputs = {"sample": empty(rows, cfg.in_channels, latent_side, latent_side),
              "timestep": torch.tensor(500.0, device="meta"),
              "encoder_hidden_states": empty(rows, _CLIP_TOKENS, cfg.cross_attention_dim), "return_dict": False}
    if cfg.addition_embed_type == "text_time":
        text_dim = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {"text_embeds": empty(rows, text_dim), "time_ids": empty(rows, 6)}
    return inputs


def sd_bench(side: int, **check) -> BenchSpec:
    """An SD family's `TestKit.bench`: its rows' side, the UNet call and LoRA layers above, and `check`
    (the device-check section's fields of `BenchSpec`, where it has one)."""
    return BenchSpec(side, unet_call_inputs, _BENCH_LORA_LAYERS, _BENCH_LORA_CONVS, **check)


# What SD1.5 and SDXL state alike (`Family(..., **SD_SHARED)`), and the records they state theirs from
# (`dataclasses.replace(SD_ADAPTERS, markers=…)`).
SD_SHARED = MappingProxyType(dict(inpainting=unet_inpainting))
SD_ADAPTERS = Adapters(native_modules=lora_aliases)
SD_TEST_KIT = TestKit(lora_targets=SD_LORA_TARGETS, demo_lora_targets=DEMO_LORA_TARGETS)
