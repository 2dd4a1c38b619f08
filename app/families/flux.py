"""FLUX.1 [dev] and [schnell]: a 12B rectified-flow DiT with CLIP-L and T5-XXL, 1024² native size.

Two families on one architecture: dev is guidance-distilled (the guidance value is an input of
the transformer, shown as "Guidance", no negative prompt) and uses a resolution-dependent time
shift; schnell is timestep-distilled for 1–4 steps, has no guidance embedder and reads 256 T5
tokens instead of 512. Adapters made for one fit the other (`adapter_arch = "flux"`).

Files come as a diffusers folder, as Black Forest Labs' transformer file (`double_blocks.*`,
bare or under `model.diffusion_model.`) with the text encoders in `models/text_encoder`
(`clip_l.safetensors`, `t5xxl_fp16.safetensors`, …) and the VAE in `models/VAE` (`ae.safetensors`),
or as the ComfyUI/Forge all-in-one (`model.diffusion_model.`, `text_encoders.clip_l.transformer.`,
`text_encoders.t5xxl.transformer.`, `vae.`). `parts` says how each component is found and named.
LoRAs name the text encoders by those all-in-one prefixes too (ComfyUI), by `lora_te1_`/`lora_te3_`
(sd-scripts) and by position, T5 as `lora_te2_` (OneTrainer): `app.adapters.keys` derives all three
from `_CLIP_L` and `_T5`; the transformer's BFL and xlabs spellings are `lora_aliases` below.
"""

from __future__ import annotations

from types import MappingProxyType

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast

from app.engine.pipelines import SteadyFluxImg2ImgPipeline, SteadyFluxInpaintPipeline, SteadyFluxPipeline
from app.families import ASSETS_DIR, ComponentFile, Family, TextEncoder
from app.families.file_layout import FileTensor, module_parts
from app.families.flux_layout import transformer_layout, xlabs_modules
from app.families.ldm_layout import LYCORIS, clip_layout, vae_layout

T5_TOKENIZER_DIR = ASSETS_DIR / "t5_tokenizer"
KOHYA_BFL = "kohya (BFL block names)"
BFL = "BFL/ComfyUI (diffusion_model.)"
XLABS = "xlabs"

# CLIP-L gives the pooled vector only, from the first 75-token chunk of the A1111-parsed prompt (as
# Forge reads it); T5 the sequence, cut at `max_sequence_length` with a note.
_CLIP_L = TextEncoder("text_encoder", "tokenizer", CLIPTextModel, "text_encoders.clip_l.transformer.", open_clip=False,
                      lora_prefix="lora_te1_", embedding_key="clip_l", reads="pooled")
_T5 = TextEncoder("text_encoder_2", "tokenizer_2", T5EncoderModel, "text_encoders.t5xxl.transformer.", open_clip=False,
                  lora_prefix="lora_te3_", embedding_key="t5", config_class=T5Config,
                  tokenizer_class=T5TokenizerFast, tokenizer_dir=T5_TOKENIZER_DIR, chunked=False)


def _t5_layout(encoder) -> dict[str, FileTensor]:
    """T5 files use transformers' names; the tied `encoder.embed_tokens` is `shared` and is read once."""
    tied = set(getattr(encoder, "_tied_weights_keys", None) or {})
    return {key: FileTensor(key) for key in encoder.state_dict() if key not in tied}


_PARTS = (
    ComponentFile("transformer", "transformer", FluxTransformer2DModel, ("model.diffusion_model.", ""),
                  "double_blocks.0.img_attn.qkv.weight", transformer_layout),
    ComponentFile("text_encoder", "CLIP-L text encoder (clip_l.safetensors)", CLIPTextModel,
                  (_CLIP_L.single_file_prefix, ""), "text_model.encoder.layers.0.self_attn.q_proj.weight",
                  clip_layout, folder="text_encoder_dir", config_class=CLIPTextConfig),
    ComponentFile("text_encoder_2", "T5-XXL text encoder (t5xxl_fp16.safetensors)", T5EncoderModel,
                  (_T5.single_file_prefix, ""), "encoder.block.0.layer.0.SelfAttention.q.weight", _t5_layout,
                  folder="text_encoder_dir", config_class=T5Config),
    ComponentFile("vae", "VAE (ae.safetensors)", AutoencoderKL, ("vae.", "first_stage_model.", ""),
                  "decoder.conv_in.weight", vae_layout, folder="vae_dir"),
)
# Flow-match Euler with each sigma schedule diffusers offers for Flux (the pipeline passes its own
# sigmas and time shift, which only this scheduler family takes). Every entry states all three
# switches: a sampler is built from the previous one's config, which would carry its switch over.
_PLAIN = {"use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False}
SAMPLERS = MappingProxyType({
    "Euler": (FlowMatchEulerDiscreteScheduler, _PLAIN),
    "Euler Karras": (FlowMatchEulerDiscreteScheduler, {**_PLAIN, "use_karras_sigmas": True}),
    "Euler exponential": (FlowMatchEulerDiscreteScheduler, {**_PLAIN, "use_exponential_sigmas": True}),
    "Euler beta": (FlowMatchEulerDiscreteScheduler, {**_PLAIN, "use_beta_sigmas": True}),
})


def lora_aliases(transformer):
    """(key, parts, spelling) for every BFL module as kohya (`lora_unet_double_blocks_0_img_attn_qkv`),
    LyCORIS over BFL names, ComfyUI (`diffusion_model.double_blocks.0.img_attn.qkv`) and xlabs
    (`double_blocks.0.processor.qkv_lora1`) spell it; fused modules list their row slices."""
    parts = {bfl: tuple((("transformer", path), rows) for path, rows in found)
             for bfl, found in module_parts(transformer_layout(transformer)).items()}
    for bfl, targets in parts.items():
        flat = bfl.replace(".", "_")
        yield f"lora_unet_{flat}", targets, KOHYA_BFL
        yield f"lycoris_{flat}", targets, LYCORIS
        yield f"diffusion_model.{bfl}", targets, BFL
    for alias, bfl in xlabs_modules(transformer).items():
        # xlabs' single-block qkv LoRA covers linear1's q, k and v rows, not its MLP rows
        targets = parts[bfl][:3] if bfl.endswith(".linear1") else parts[bfl]
        # `qkv_lora.down.weight` / `proj_lora.down.weight` end like diffusers' legacy
        # `to_q_lora.down.weight`, so the key splitter hands single-block layers over without `_lora`.
        for prefix in ("", "diffusion_model."):
            yield f"{prefix}{alias.removesuffix('_lora')}", targets, XLABS


# No Flux Fill (a 384-channel inpainting transformer) here: inpaint blends the regular model's latents.
_STAGES = MappingProxyType({"img2img": SteadyFluxImg2ImgPipeline, "inpaint": SteadyFluxInpaintPipeline})


def _family(name: str, label: str, dev: bool) -> Family:
    return Family(
        name=name,
        label=label,
        pipeline_class=SteadyFluxPipeline,
        stage_pipelines=_STAGES,
        diffusers_pipeline="FluxPipeline",
        text_encoders=(_CLIP_L, _T5),
        checkpoint_markers=("double_blocks.0.img_attn.qkv.weight", *(("guidance_in.in_layer.weight",) if dev else ())),
        config_dir=ASSETS_DIR / "configs" / name,
        default_sampler="Euler",
        size_multiple=16,  # 8× VAE downscale, then 2×2 patches
        denoiser="transformer",
        denoiser_class=FluxTransformer2DModel,
        conv_components=("vae",),
        marker_prefixes=("", "model.diffusion_model."),
        parts=_PARTS,
        samplers=SAMPLERS,
        default_steps=28 if dev else 4,
        default_guidance=3.5 if dev else 1.0,
        distilled_guidance=dev,
        fp16_ok=False,
        # fp8 storage keeps the embedders, the final layers and T5's `wo` (which the T5 code casts
        # its input to) in the compute dtype, as peers do.
        high_precision=("x_embedder", "context_embedder", "time_text_embed", "norm_out", "proj_out", "wo"),
        negative_prompt=False,
        max_sequence_length=512 if dev else 256,
        adapter_arch="flux",
        folder_config=MappingProxyType({"transformer/config.json": {"guidance_embeds": dev}}),
        native_size=lambda pipe: pipe.vae.config.sample_size,
        native_modules=lora_aliases,
    )


FLUX_DEV = _family("flux-dev", "FLUX.1-dev", dev=True)
FLUX_SCHNELL = _family("flux-schnell", "FLUX.1-schnell", dev=False)
