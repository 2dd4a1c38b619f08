"""SDXL base: CLIP ViT-L/14 plus OpenCLIP ViT-bigG/14 (with projection), 1024² native size."""

from __future__ import annotations

from types import MappingProxyType

from transformers import CLIPTextModel, CLIPTextModelWithProjection

from app.engine.pipelines import SteadySDXLImg2ImgPipeline, SteadySDXLInpaintPipeline, SteadySDXLPipeline
from app.families import ASSETS_DIR, Family, TextEncoder
from app.families.ldm_layout import UNET_PREFIX, lora_aliases

_CLIP_L = TextEncoder("text_encoder", "tokenizer", CLIPTextModel,
                      "conditioner.embedders.0.transformer.text_model.", open_clip=False,
                      lora_prefix="lora_te1_", embedding_key="clip_l", layer="penultimate")
_CLIP_G = TextEncoder("text_encoder_2", "tokenizer_2", CLIPTextModelWithProjection, "conditioner.embedders.1.model.",
                      open_clip=True, lora_prefix="lora_te2_", embedding_key="clip_g", pad_token="!",
                      reads="both", layer="penultimate")

SDXL = Family(
    name="sdxl",
    label="SDXL",
    pipeline_class=SteadySDXLPipeline,
    stage_pipelines=MappingProxyType({"img2img": SteadySDXLImg2ImgPipeline, "inpaint": SteadySDXLInpaintPipeline}),
    diffusers_pipeline="StableDiffusionXLPipeline",
    text_encoders=(_CLIP_L, _CLIP_G),
    checkpoint_markers=(UNET_PREFIX + "label_emb.0.0.weight",
                        _CLIP_L.single_file_prefix + "embeddings.token_embedding.weight",
                        _CLIP_G.single_file_prefix + "token_embedding.weight"),
    high_precision=("conv_in", "conv_out", "time_embedding", "add_embedding", "text_projection"),
    vae_upcast_in_fp16=True,
    config_dir=ASSETS_DIR / "configs" / "sdxl",
    native_modules=lora_aliases,
    refiner_families=("sdxl",),
)
