"""FLUX.1 [dev] and [schnell]: a 12B rectified-flow DiT with CLIP-L and T5-XXL, 1024² native size.

Two families on one architecture: dev is guidance-distilled (the guidance value is an input of
the transformer, shown as "Guidance", no negative prompt) and uses a resolution-dependent time
shift; schnell is timestep-distilled for 1–4 steps, has no guidance embedder and reads 256 T5
tokens instead of 512. Adapters made for one fit the other (`Adapters.lora_arch = "flux"`).

Files come as a diffusers folder, as Black Forest Labs' transformer file (`double_blocks.*`,
bare or under `model.diffusion_model.`) with the text encoders in `models/text_encoder`
(`clip_l.safetensors`, `t5xxl_fp16.safetensors`, …) and the VAE in `models/VAE` (`ae.safetensors`),
or as the ComfyUI/Forge all-in-one (`model.diffusion_model.`, `text_encoders.clip_l.transformer.`,
`text_encoders.t5xxl.transformer.`, `vae.`). `Files.parts` says how each component is found and named.
LoRAs name the text encoders by those all-in-one prefixes too (ComfyUI), by `lora_te1_`/`lora_te3_`
(sd-scripts) and by position, T5 as `lora_te2_` (OneTrainer): `app.adapters.keys` derives all three
from `_CLIP_L` and `_T5`; the transformer's BFL and xlabs spellings are `lora_aliases` below.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import torch
from diffusers import (
    FluxControlNetImg2ImgPipeline,
    FluxControlNetPipeline,
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from diffusers.image_processor import VaeImageProcessor
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast

from app.families import ASSETS_DIR, Adapters, BenchSpec, ComponentFile, Family, Files, Precision, TestKit, TextEncoder
from app.families.file_layout import module_parts, own_names
from app.families.flow_dit import DIT_PREFIXES, DIT_SHARED, FLOW_SAMPLING, FLUX_LATENTS, FLUX_VAE_PART, TINY_FLUX_VAE
from app.families.flux_controlnet import flux_controlnet_kit
from app.families.flux_layout import bfl_aliases, transformer_layout, xlabs_modules
from app.families.ldm_layout import clip_layout
from app.families.pipelines import PackedPatches, StrengthSteps, VariedNoise
from app.families.tiny_parts import TINY_CLIP_L


class SteadyFluxPipeline(PackedPatches, VariedNoise, FluxPipeline):
    """FLUX.1 pipeline whose execution device is set by the engine."""


def _fresh(generators: list[torch.Generator]) -> list[torch.Generator]:
    """Generators at their seeds' first draw, whatever was drawn from them since."""
    return [torch.Generator(g.device).manual_seed(g.initial_seed()) for g in generators]


class _FluxControl(PackedPatches):
    """What FLUX.1's control pipelines change in diffusers', so a ControlNet steers the image the seed draws
    without it:

    * the noise is drawn from the generators' seeds as if fresh: diffusers draws the control image's VAE
      sample from the same generators first, so adding a ControlNet (even at weight 0, or from step 0.9) would
      change the noise, the whole composition. The control image's sample is drawn from the seed too, as the
      engine encodes every image (`stages.encode`: image i's generator seeded `seed + i`);
    * the control image is prepared in its consumer's compute dtype (the VAE's for InstantX, which encodes it;
      the ControlNet's for XLabs, whose hint encoder reads pixels), not in the VAE's resting dtype."""

    def prepare_image(self, image, width, height, batch_size, num_images_per_prompt, device, dtype,
                      do_classifier_free_guidance=False, guess_mode=False):
        nets = getattr(self.controlnet, "nets", [self.controlnet])
        reader = "vae" if nets[0].input_hint_block is None else "controlnet"
        dtype = self.compute_dtypes.get(reader, dtype)
        return super().prepare_image(image, width, height, batch_size, num_images_per_prompt, device, dtype,
                                     do_classifier_free_guidance, guess_mode)


class SteadyFluxControlNetPipeline(_FluxControl, VariedNoise, FluxControlNetPipeline):
    """FLUX.1 txt2img steered by ControlNets (InstantX/Shakker, XLabs; the units' stack is diffusers'
    `FluxMultiControlNetModel`)."""

    def prepare_latents(self, batch_size, num_channels_latents, height, width, dtype, device, generator,
                        latents=None):
        return super().prepare_latents(batch_size, num_channels_latents, height, width, dtype, device,
                                       _fresh(generator), latents)


class SteadyFluxControlNetImg2ImgPipeline(_FluxControl, StrengthSteps, FluxControlNetImg2ImgPipeline):
    """FLUX.1 img2img (and the hires pass) steered by ControlNets. As the engine's other stage pipelines it takes
    latents the engine encoded (`FluxImg2ImgPipeline`'s latent path, which diffusers' control variant lacks:
    it VAE-encodes whatever it is given) and runs int(steps × strength) steps (`StrengthSteps`)."""

    def __init__(self, scheduler, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, transformer,
                 controlnet) -> None:
        super().__init__(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
                         controlnet=controlnet)
        self.latent_channels = self.vae.config.latent_channels
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2,
                                                 vae_latent_channels=self.latent_channels)

    def prepare_latents(self, image, timestep, batch_size, num_channels_latents, height, width, dtype, device,
                        generator, latents=None):
        return FluxImg2ImgPipeline.prepare_latents(self, image, timestep, batch_size, num_channels_latents, height,
                                                   width, dtype, device, _fresh(generator), latents)


class SteadyFluxImg2ImgPipeline(PackedPatches, StrengthSteps, FluxImg2ImgPipeline):
    """FLUX.1 img2img (and hires fix second pass) stage pipeline."""


class SteadyFluxInpaintPipeline(PackedPatches, StrengthSteps, FluxInpaintPipeline):
    """FLUX.1 inpaint stage pipeline (the regular transformer: the mask blends latents each step)."""


T5_TOKENIZER_DIR = ASSETS_DIR / "t5_tokenizer"
XLABS = "xlabs"

# CLIP-L gives the pooled vector only, from the first 75-token chunk of the A1111-parsed prompt (as
# Forge reads it); T5 the sequence, cut at `max_sequence_length` with a note.
_CLIP_L = TextEncoder("text_encoder", "tokenizer", CLIPTextModel, "text_encoders.clip_l.transformer.", open_clip=False,
                      lora_prefix="lora_te1_", embedding_key="clip_l", reads="pooled")
_T5 = TextEncoder("text_encoder_2", "tokenizer_2", T5EncoderModel, "text_encoders.t5xxl.transformer.", open_clip=False,
                  lora_prefix="lora_te3_", embedding_key="t5", config_class=T5Config,
                  tokenizer_class=T5TokenizerFast, tokenizer_dir=T5_TOKENIZER_DIR, chunked=False)


# llama.cpp's names for a T5 encoder in a `.gguf` (city96's t5-v1_1-xxl-encoder files)
T5_GGUF_NAMES = (
    (r"token_embd\.weight", "shared.weight"), (r"enc\.output_norm\.weight", "encoder.final_layer_norm.weight"),
    *((rf"enc\.blk\.(\d+)\.{theirs}\.weight", rf"encoder.block.\1.layer.{ours}.weight") for theirs, ours in (
        ("attn_norm", "0.layer_norm"), ("attn_q", "0.SelfAttention.q"), ("attn_k", "0.SelfAttention.k"),
        ("attn_v", "0.SelfAttention.v"), ("attn_o", "0.SelfAttention.o"),
        ("attn_rel_b", "0.SelfAttention.relative_attention_bias"), ("ffn_norm", "1.layer_norm"),
        ("ffn_gate", "1.DenseReluDense.wi_0"), ("ffn_up", "1.DenseReluDense.wi_1"),
        ("ffn_down", "1.DenseReluDense.wo"))),
)
_PARTS = (
    ComponentFile("transformer", "transformer", FluxTransformer2DModel, ("model.diffusion_model.", ""),
                  "double_blocks.0.img_attn.qkv.weight", transformer_layout),
    ComponentFile("text_encoder", "CLIP-L text encoder (clip_l.safetensors)", CLIPTextModel,
                  (_CLIP_L.single_file_prefix, ""), "text_model.encoder.layers.0.self_attn.q_proj.weight",
                  clip_layout, folder="text_encoder_dir", config_class=CLIPTextConfig),
    ComponentFile("text_encoder_2", "T5-XXL text encoder (t5xxl_fp16.safetensors)", T5EncoderModel,
                  (_T5.single_file_prefix, ""), "encoder.block.0.layer.0.SelfAttention.q.weight", own_names,
                  folder="text_encoder_dir", config_class=T5Config, gguf_names=T5_GGUF_NAMES),
    FLUX_VAE_PART,
)


def lora_aliases(transformer):
    """(key, parts, spelling) for every BFL module (`bfl_aliases`: kohya, LyCORIS, ComfyUI) and as
    xlabs spells it (`double_blocks.0.processor.qkv_lora1`); fused modules list their row slices."""
    layout = transformer_layout(transformer)
    yield from bfl_aliases(transformer, layout)
    parts = {bfl: tuple((("transformer", path), rows) for path, rows in found)
             for bfl, found in module_parts(layout).items()}
    for alias, bfl in xlabs_modules(transformer).items():
        # xlabs' single-block qkv LoRA covers linear1's q, k and v rows, not its MLP rows
        targets = parts[bfl][:3] if bfl.endswith(".linear1") else parts[bfl]
        # `qkv_lora.down.weight` / `proj_lora.down.weight` end like diffusers' legacy
        # `to_q_lora.down.weight`, so the key splitter hands single-block layers over without `_lora`.
        for prefix in ("", "diffusion_model."):
            yield f"{prefix}{alias.removesuffix('_lora')}", targets, XLABS


# Tiny: two double and two single blocks (so block numbering and `group` offload see lists), heads
# 2 x 8 with rope axes summing to 8, the real 16 latent channels (in_channels = 16 x 2 x 2 patches),
# T5 with the real vocabulary (the bundled tokenizer).
_TINY_T5 = dict(vocab_size=32128, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
                is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
_TINY_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=8,
                         num_attention_heads=2, joint_attention_dim=_TINY_T5["d_model"],
                         pooled_projection_dim=TINY_CLIP_L["hidden_size"], axes_dims_rope=(2, 2, 4))
# The same spread of layer kinds as SD's test LoRAs, on Flux's transformer (diffusers names):
# attention q and output, the single blocks' MLP input and output projection, a modulation and an
# embedder, and CLIP-L.
_LORA_TARGETS = (
    "transformer.transformer_blocks.0.attn.to_q", "transformer.transformer_blocks.*.attn.to_out.0",
    "transformer.transformer_blocks.1.ff.net.2", "transformer.single_transformer_blocks.0.proj_mlp",
    "transformer.single_transformer_blocks.*.proj_out", "transformer.transformer_blocks.0.norm1.linear",
    "transformer.context_embedder",
    "text_encoder.*layers.0.self_attn.q_proj", "text_encoder.*layers.0.mlp.fc1", "text_encoder.*layers.0.layer_norm1",
)
_DEMO_LORA_TARGETS = (
    ("transformer.*attn.to_[qkv]", "transformer.*attn.to_out.0", "transformer.*attn.add_[qkv]_proj",
     "text_encoder*.self_attn.*_proj", "text_encoder*.mlp.fc[12]"),
    ("transformer.*ff.net.*", "transformer.*ff_context.net.*", "transformer.*proj_mlp"),
)

# No Flux Fill (a 384-channel inpainting transformer) here: inpaint blends the regular model's latents.
_STAGES = MappingProxyType({"img2img": SteadyFluxImg2ImgPipeline, "inpaint": SteadyFluxInpaintPipeline})
# With ControlNet units: txt2img, and img2img (the hires pass too); no inpaint yet
_CONTROL_PIPELINES = MappingProxyType({"txt2img": SteadyFluxControlNetPipeline,
                                       "img2img": SteadyFluxControlNetImg2ImgPipeline})


def _call_inputs(fam, cfg, rows: int, latent_side: int, empty) -> dict:
    """One transformer call for the bench's op counts: 2×2 latent patches as a sequence, T5 states,
    CLIP's pooled vector, 3 position axes, and dev's distilled guidance value."""
    tokens, text = (latent_side // 2) ** 2, fam.sampling.max_sequence_length
    guidance = {"guidance": empty(rows)} if cfg.guidance_embeds else {}
    return {"hidden_states": empty(rows, tokens, cfg.in_channels),
            "encoder_hidden_states": empty(rows, text, cfg.joint_attention_dim), "timestep": empty(rows),
            "pooled_projections": empty(rows, cfg.pooled_projection_dim), "img_ids": empty(tokens, 3),
            "txt_ids": empty(text, 3), "return_dict": False, **guidance}


# The bench LoRAs' layers: both streams' attention projections and feed-forwards, the single blocks' MLP and output.
_BENCH_LORA_LAYERS = (r"\.(attn\.(to_q|to_k|to_v|to_out\.0|add_[qkv]_proj|to_add_out)|ff(_context)?\.net\.(0\.proj|2)"
                      r"|proj_mlp)$|^single_transformer_blocks\.\d+\.proj_out$")
_BENCH = BenchSpec(1024, _call_inputs, _BENCH_LORA_LAYERS,
                   check=("--sections", "throughput,fp8", "--batches", "1", "--loras", "0,3", "--repeats", "2",
                          "--steps", "8"),
                   check_s=210, check_order=2,
                   check_title="FLUX.1-dev 1024² bf16 vs FluxPipeline (none, 3 fused LoRAs, PEFT), then fp8 storage "
                               "with none and 3 LoRAs as bypass; resting VRAM")


def _family(name: str, label: str, dev: bool) -> Family:
    return Family(
        name=name,
        label=label,
        pipeline_class=SteadyFluxPipeline,
        stage_pipelines=_STAGES,
        diffusers_pipeline="FluxPipeline",
        text_encoders=(_CLIP_L, _T5),
        files=Files(
            config_dir=ASSETS_DIR / "configs" / name,
            checkpoint_markers=("double_blocks.0.img_attn.qkv.weight",
                                *(("guidance_in.in_layer.weight",) if dev else ())),
            marker_prefixes=DIT_PREFIXES,
            parts=_PARTS,
            folder_config=MappingProxyType({"transformer/config.json": {"guidance_embeds": dev}})),
        denoiser_class=FluxTransformer2DModel,
        **DIT_SHARED,
        latent_format=FLUX_LATENTS,
        first_block="transformer_blocks.0",
        controlnet=flux_controlnet_kit(_CONTROL_PIPELINES, ASSETS_DIR / "configs" / name,
                                       dict(_TINY_TRANSFORMER, guidance_embeds=dev)),
        precision=Precision(
            fp16_ok=False,
            # fp8 storage keeps the embedders, the final layers and T5's `wo` (which the T5 code casts
            # its input to) in the compute dtype, as peers do.
            high_precision=("x_embedder", "context_embedder", "time_text_embed", "norm_out", "proj_out", "wo")),
        adapters=Adapters(
            lora_arch="flux",
            native_modules=lora_aliases,
            label="Flux",
            markers=("flux1", f"flux-1-{'dev' if dev else 'schnell'}", "flux")),
        test_kit=TestKit(
            tiny_configs=MappingProxyType({"transformer": dict(_TINY_TRANSFORMER, guidance_embeds=dev),
                                           "vae": TINY_FLUX_VAE, "text_encoder": TINY_CLIP_L,
                                           "text_encoder_2": _TINY_T5}),
            lora_targets=_LORA_TARGETS,
            demo_lora_targets=_DEMO_LORA_TARGETS,
            bench=_BENCH if dev else None,  # schnell is dev's architecture without the guidance embedder
        ),
        sampling=dataclasses.replace(FLOW_SAMPLING,
            default_steps=28 if dev else 4,
            default_guidance=3.5 if dev else 1.0,
            distilled_guidance=dev,
            step_distilled=lambda pipe: not dev,  # schnell runs 1-4 timestep-distilled steps; dev distils guidance only
            negative_prompt=False,
            max_sequence_length=512 if dev else 256,
            guidance_label="Distilled CFG Scale" if dev else "CFG scale"),
    )


FLUX_DEV = _family("flux-dev", "FLUX.1-dev", dev=True)
FLUX_SCHNELL = _family("flux-schnell", "FLUX.1-schnell", dev=False)
FAMILIES = (FLUX_DEV, FLUX_SCHNELL)
