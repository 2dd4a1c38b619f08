"""FLUX.2 [klein] 4B and 9B: rectified-flow DiTs with a Qwen3 text encoder (4B / 8B), 1024² native size,
that generate from a prompt and edit from one or more reference images with the same weights.

The released checkpoints are step-distilled: 4 steps, guidance ignored (`is_distilled` in a diffusers
folder's model_index.json); the "base" checkpoints (`FLUX.2-klein-base-4B`, …) are not, and run CFG
with an empty unconditional prompt (the model cards: 50 steps, guidance 4). A single file says which
by its name, as BFL and ComfyUI name them (`flux-2-klein-base-4b…`): `_distilled_flag`.

Files: a diffusers folder; BFL's and ComfyUI's transformer file (bare `double_blocks.*` or under
`model.diffusion_model.`, bf16 or fp8 with ComfyUI's `weight_scale`) with the Qwen3 encoder in
`models/text_encoder` (`qwen_3_4b.safetensors`, `qwen_3_8b*.safetensors`) and the VAE in `models/VAE`
(`flux2-vae.safetensors`), chosen per checkpoint as for FLUX.1; or an all-in-one under ComfyUI's
prefixes. Names: `app/families/klein_layout.py`. 4B and 9B differ in depth and width only: the 9B's
eighth double block is its marker (a file holding the 4B's markers and that one is the 9B).

Reference editing: the txt2img pipeline takes reference images (`image=[…]`): each is encoded (its
latents' mode) and its tokens join the image tokens with their own time offset. Inpaint (and img2img,
as inpaint with the whole picture masked) runs diffusers' Klein inpaint pipeline, which also reads the
init image as a reference, as Klein was trained to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch
from diffusers import (
    AutoencoderKLFlux2,
    Flux2KleinInpaintPipeline,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)
from transformers import Qwen3Config, Qwen3ForCausalLM

from app.families import (
    ASSETS_DIR,
    Adapters,
    BenchSpec,
    ComponentFile,
    Family,
    Files,
    LatentFormat,
    LatentStats,
    Precision,
    TestKit,
    TextEncoder,
)
from app.families.file_layout import own_names
from app.families.flow_dit import DIT_PREFIXES, DIT_SHARED, FLOW_SAMPLING
from app.families.flux_layout import bfl_aliases
from app.families.klein_layout import transformer_layout, vae_layout
from app.families.pipelines import EnginePipeline, StrengthSteps, VariedNoise
from app.families.qwen3 import QWEN3_TOKENIZER_DIR, BundledQwen3Tokenizer
from app.families.tiny_parts import TINY_VAE


class _KleinLatents(EnginePipeline):
    """Klein denoises the VAE's latents cut into 2×2 patches (128 channels at 1/16 of the image side),
    normalised by the VAE's batch-norm statistics and packed into a sequence. The engine's spatial
    latents are the VAE's own (32 channels at 1/8): what the pipeline returns as "latent" and decodes."""

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of the patch grid the noise is drawn on (Flux2KleinPipeline's rule)."""
        patch = self.vae_scale_factor * 2
        return int(height) // patch, int(width) // patch

    def _batch_norm(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latent (mean, std) per patch channel, read onto `like`'s device and dtype (no move)."""
        bn = self.vae.bn
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        return bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype), std.to(like.device, like.dtype)

    def spatial_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The VAE's latents: the pipeline's output as it is; a step's packed, normalised patches
        (batch, rows·columns, 128) unpacked, de-normalised and un-patchified as the pipeline does at the end."""
        if latents.dim() == 4:
            return latents
        rows, columns = self.latent_grid(height, width)
        patches = latents.transpose(1, 2).reshape(latents.shape[0], -1, rows, columns)
        mean, std = self._batch_norm(patches)
        return self._unpatchify_latents(patches * std + mean)

    def _encode_vae_image(self, image: torch.Tensor, generator):
        """Reference and init images are encoded on the execution device in the VAE's compute dtype:
        diffusers places them by the VAE's resting device and dtype (the CPU, under offload)."""
        dtype = self.compute_dtypes.get("vae") or image.dtype
        return super()._encode_vae_image(image.to(self._execution_device, dtype), generator)


class SteadyKleinPipeline(_KleinLatents, VariedNoise, Flux2KleinPipeline):
    """FLUX.2 Klein txt2img and reference editing (`image=[…]`); step-distilled unless told otherwise."""

    def __init__(self, scheduler, vae, text_encoder, tokenizer, transformer, is_distilled: bool = True) -> None:
        super().__init__(scheduler, vae, text_encoder, tokenizer, transformer, is_distilled)

    def prepare_latents(self, batch_size, num_latents_channels, height, width, dtype, device, generator,
                        latents=None):
        """Klein draws its first noise as 2×2 patches (4× the channels on the patch grid): a variation
        seed is mixed in at that shape (`VariedNoise`), then the pipeline packs it."""
        if latents is None and self.variation is not None:
            shape = (batch_size, num_latents_channels * 4, *self.latent_grid(height, width))
            latents = self.variation.noise(shape, self.latent_grid, dtype, device, generator)
        return Flux2KleinPipeline.prepare_latents(self, batch_size, num_latents_channels, height, width, dtype,
                                                  device, generator, latents)


class SteadyKleinStagePipeline(_KleinLatents, StrengthSteps, Flux2KleinInpaintPipeline):
    """Klein's img2img and inpaint (diffusers' Klein inpaint pipeline): the engine hands it the VAE's
    latents, patchified here; img2img is inpaint with the whole picture masked. It runs
    int(steps × strength) steps, as the engine announces (`StrengthSteps`)."""

    def __call__(self, *, image: torch.Tensor, mask_image: torch.Tensor | None = None, masked_image_latents=None,
                 **kwargs):
        """`masked_image_latents` is for 9-channel UNets; Klein reads the init latents themselves."""
        if mask_image is None:
            mask_image = torch.ones(1, 1, *image.shape[-2:], device=image.device)
        return super().__call__(image=self._patchify_latents(image), mask_image=mask_image, **kwargs)


def _defaults(pipe) -> tuple[int, float]:
    """The model cards' settings: 4 steps without guidance (distilled), 50 steps at guidance 4 (base)."""
    return (4, 1.0) if pipe.config.is_distilled else (50, 4.0)


def _distilled_flag(path: Path) -> Mapping[str, object]:
    """BFL and ComfyUI name the undistilled checkpoints "…klein-base…"; every other Klein file is distilled."""
    return {"is_distilled": "base" not in path.name.lower()}


def _qwen3(name: str) -> TextEncoder:
    """Klein's Qwen3 encoder: prompts go to it as text, through its chat template, and the pipeline reads
    hidden layers 9, 18 and 27 (`reads="text"`); one sequence of up to 512 tokens."""
    return TextEncoder("text_encoder", "tokenizer", Qwen3ForCausalLM, f"text_encoders.{name}.transformer.",
                       open_clip=False, lora_prefix="lora_te_", embedding_key=name, config_class=Qwen3Config,
                       tokenizer_class=BundledQwen3Tokenizer, tokenizer_dir=QWEN3_TOKENIZER_DIR, reads="text",
                       chunked=False, chat_template=MappingProxyType({"enable_thinking": False}))


def _parts(encoder: TextEncoder, file_hint: str) -> tuple[ComponentFile, ...]:
    return (
        ComponentFile("transformer", "transformer", Flux2Transformer2DModel, ("model.diffusion_model.", ""),
                      "double_stream_modulation_img.lin.weight", transformer_layout),
        ComponentFile("text_encoder", f"Qwen3 text encoder ({file_hint})", Qwen3ForCausalLM,
                      (encoder.single_file_prefix, ""), "model.layers.0.self_attn.q_norm.weight", own_names,
                      folder="text_encoder_dir", config_class=Qwen3Config),
        ComponentFile("vae", "VAE (flux2-vae.safetensors)", AutoencoderKLFlux2, ("vae.", ""),
                      "bn.running_mean", vae_layout, folder="vae_dir"),
    )


def lora_aliases(transformer):
    """Every BFL module as kohya, LyCORIS and ComfyUI spell it (double-block q/k/v cut by rows)."""
    return bfl_aliases(transformer, transformer_layout(transformer))


# Tiny: the real 32-channel VAE latents (128 patch channels), heads 2 x 8 with four rope axes of 2,
# Qwen3 with the real vocabulary (the bundled tokenizer) and 28 layers (the pipeline reads 9, 18, 27).
_TINY_QWEN3 = dict(vocab_size=151936, hidden_size=32, intermediate_size=37, num_hidden_layers=28,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                   rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643,
                   eos_token_id=151645)
_TINY_TRANSFORMER = dict(patch_size=1, in_channels=128, num_single_layers=2, attention_head_dim=8,
                         num_attention_heads=2, joint_attention_dim=3 * _TINY_QWEN3["hidden_size"],
                         timestep_guidance_channels=32, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False)
_TINY_VAE = dict(TINY_VAE, latent_channels=32)
# ComfyUI's published latent-preview fit for FLUX.2 (comfy/latent_formats.py, Flux2), per VAE channel
_PREVIEW = (((0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644),
             (0.2144, 0.3009, 0.3652), (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160),
             (-0.0398, 0.0902, -0.0235), (-0.0052, 0.0095, 0.0109), (-0.3527, -0.2712, -0.1666),
             (-0.0301, -0.0356, -0.0180), (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941),
             (0.0156, 0.0169, 0.0070), (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080),
             (-0.0939, -0.0008, 0.0186), (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127),
             (-0.0024, -0.0022, -0.0030), (0.1207, -0.0026, 0.0065), (0.0128, 0.0101, 0.0142),
             (0.0137, -0.0072, -0.0007), (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049),
             (-0.0465, -0.0204, -0.0312), (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025),
             (0.0220, 0.0169, -0.0048), (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609),
             (-0.0076, 0.0003, -0.0043), (-0.0111, -0.0460, -0.0614)), (-0.0329, -0.0718, -0.0851))
# The VAE's own statistics normalise the latents inside the pipeline (its `bn`): the engine's are the VAE's own.
_LATENTS = LatentFormat(stats=lambda config: LatentStats(1.0), preview_rgb=_PREVIEW)
# Every layer kind: double-block attention (q and output), both MLPs, a single block's fused
# projection and output, a shared modulation, the embedders, and Qwen3's attention and MLP.
_LORA_TARGETS = (
    "transformer.transformer_blocks.0.attn.to_q", "transformer.transformer_blocks.*.attn.to_out.0",
    "transformer.transformer_blocks.1.ff.linear_in", "transformer.transformer_blocks.0.ff_context.linear_out",
    "transformer.single_transformer_blocks.*.attn.to_qkv_mlp_proj",
    "transformer.single_transformer_blocks.0.attn.to_out",
    "transformer.double_stream_modulation_img.linear", "transformer.context_embedder",
    "text_encoder.model.layers.9.self_attn.q_proj", "text_encoder.model.layers.17.mlp.down_proj",
)
_DEMO_LORA_TARGETS = (
    ("transformer.*attn.to_[qkv]", "transformer.*attn.to_out.0", "transformer.*attn.add_[qkv]_proj",
     "transformer.*attn.to_qkv_mlp_proj", "text_encoder.*self_attn.[qkvo]_proj"),
    ("transformer.*ff.linear_*", "transformer.*ff_context.linear_*", "text_encoder.*mlp.*_proj"),
)
# FLUX.1's per-block modulations, GELU MLPs, single-block q/k/v/MLP split and pooled-text embedder, in
# every spelling (BFL, kohya, diffusers): FLUX.2 has none, and a FLUX.1 LoRA's attention layers fit the
# 4B's by shape (both 3072 wide), so such a file is refused by name instead of applied in part.
_FLUX1_LAYERS = ("img_mod", "txt_mod", "modulation_lin", ".modulation.lin", "norm1.linear", "norm1_linear",
                 "norm1_context", "ff.net.", "ff_net_", "ff_context.net.", "proj_mlp", "time_text_embed",
                 "vector_in", "single_transformer_blocks.0.attn.to_q", "single_transformer_blocks_0_attn_to_q")
_STAGES = MappingProxyType({"img2img": SteadyKleinStagePipeline, "inpaint": SteadyKleinStagePipeline})


def _call_inputs(fam, cfg, rows: int, latent_side: int, empty) -> dict:
    """One transformer call for the bench's op counts: 2×2 latent patches as a sequence, Qwen3 states,
    4 position axes with a batch dimension, no pooled vector."""
    tokens, text, axes = (latent_side // 2) ** 2, fam.sampling.max_sequence_length, len(cfg.axes_dims_rope)
    guidance = {"guidance": empty(rows)} if cfg.guidance_embeds else {}
    return {"hidden_states": empty(rows, tokens, cfg.in_channels),
            "encoder_hidden_states": empty(rows, text, cfg.joint_attention_dim), "timestep": empty(rows),
            "img_ids": empty(rows, tokens, axes), "txt_ids": empty(rows, text, axes), "return_dict": False,
            **guidance}


# The bench LoRAs' layers: both streams' attention projections and feed-forwards, and the single blocks'
# fused QKV+MLP input and output.
_BENCH_LORA_LAYERS = (r"\.(attn\.(to_q|to_k|to_v|to_out\.0|add_[qkv]_proj|to_add_out|to_qkv_mlp_proj|to_out)"
                      r"|ff(_context)?\.linear_(in|out))$")
_BENCH = BenchSpec(1024, _call_inputs, _BENCH_LORA_LAYERS,
                   check=("--sections", "throughput,fp8", "--batches", "1", "--loras", "0,3", "--repeats", "2",
                          "--steps", "4"),
                   check_s=100, check_order=3, offload_check_s=380,
                   check_title="FLUX.2 Klein 4B 1024² bf16 vs Flux2KleinPipeline (none, 3 fused LoRAs, PEFT), fp8 "
                               "storage with none and 3 LoRAs as bypass; resting VRAM")


def _family(size: str, encoder_name: str, encoder_file: str, double_blocks: int) -> Family:
    encoder = _qwen3(encoder_name)
    markers = ("double_blocks.0.img_attn.qkv.weight", "double_stream_modulation_img.lin.weight")
    return Family(
        name=f"flux2-klein-{size}",
        label=f"FLUX.2 Klein {size.upper()}",
        pipeline_class=SteadyKleinPipeline,
        stage_pipelines=_STAGES,
        diffusers_pipeline="Flux2KleinPipeline",
        text_encoders=(encoder,),
        files=Files(
            config_dir=ASSETS_DIR / "configs" / f"flux2-klein-{size}",
            # the 9B's eighth double block tells it from the 4B (five double blocks)
            checkpoint_markers=(*markers, *((f"double_blocks.{double_blocks - 1}.img_attn.qkv.weight",)
                                            if size == "9b" else ())),
            marker_prefixes=DIT_PREFIXES,
            parts=_parts(encoder, encoder_file),
            pipeline_kwargs=_distilled_flag,
            # a folder is the 9B's when it has the 9B's eight double blocks, else the 4B's (FAMILIES lists the 9B
            # first)
            folder_config=MappingProxyType({"transformer/config.json": {"num_layers": double_blocks}}
                                           if size == "9b" else {}),
            takes_embeddings=False),  # A1111 embeddings are CLIP vectors; Qwen3 has no such files
        **DIT_SHARED,  # its double and single blocks compile as diffusers declares them
        denoiser_class=Flux2Transformer2DModel,
        vae_class=AutoencoderKLFlux2,
        first_block="transformer_blocks.0",
        reference_images=4,  # each adds up to 4,096 tokens (1024² / 16²) to every attention
        latent_format=_LATENTS,
        precision=Precision(
            fp16_ok=False,
            # fp8 storage keeps the embedders (the first floating parameter says the transformer's dtype to
            # diffusers) and the final layers in the compute dtype, as peers do.
            high_precision=("x_embedder", "context_embedder", "time_guidance_embed", "norm_out", "proj_out", "lm_head"),
            pinned_dtypes=MappingProxyType({"text_encoder.*rotary_emb.*inv_freq": torch.float32})),
        adapters=Adapters(
            native_modules=lora_aliases,
            lora_arch=f"flux2-klein-{size}",
            foreign_layers=(("FLUX.1", _FLUX1_LAYERS),),
            label=f"Klein {size.upper()}",
            markers=(f"flux2_klein_{size}", f"flux-2-klein-{size}", f"klein-{size}", f"klein_{size}")),
        test_kit=TestKit(
            tiny_configs=MappingProxyType({"transformer": dict(_TINY_TRANSFORMER,
                                                               num_layers=double_blocks if size == "9b" else 2),
                                           "vae": _TINY_VAE, "text_encoder": _TINY_QWEN3}),
            lora_targets=_LORA_TARGETS,
            demo_lora_targets=_DEMO_LORA_TARGETS,
            bench=_BENCH if size == "4b" else None,  # the 9B is the 4B's architecture, deeper and wider
        ),
        sampling=dataclasses.replace(FLOW_SAMPLING,
            default_steps=4,
            default_guidance=1.0,
            loaded_defaults=_defaults,
            step_distilled=lambda pipe: pipe.config.is_distilled,  # the released 4-step checkpoints; "base" is not
            negative_prompt=False,
            max_sequence_length=512),
    )


KLEIN_4B = _family("4b", "qwen3_4b", "qwen_3_4b.safetensors", double_blocks=5)
KLEIN_9B = _family("9b", "qwen3_8b", "qwen_3_8b.safetensors", double_blocks=8)
FAMILIES = (KLEIN_9B, KLEIN_4B)  # the 9B first: its folders are told apart by depth
