"""Stable Diffusion 1.x: one CLIP ViT-L/14 text encoder, 512² native size."""

from __future__ import annotations

from types import MappingProxyType

from transformers import CLIPTextModel

from app.engine.pipelines import SteadySDImg2ImgPipeline, SteadySDInpaintPipeline, SteadySDPipeline
from app.families import ASSETS_DIR, Family, TextEncoder
from app.families.ldm_layout import UNET_PREFIX, lora_aliases

_CLIP = TextEncoder("text_encoder", "tokenizer", CLIPTextModel, "cond_stage_model.transformer.text_model.",
                    open_clip=False, lora_prefix="lora_te_", embedding_key="emb_params")

SD15 = Family(
    name="sd15",
    label="SD1.5",
    pipeline_class=SteadySDPipeline,
    stage_pipelines=MappingProxyType({"img2img": SteadySDImg2ImgPipeline, "inpaint": SteadySDInpaintPipeline}),
    diffusers_pipeline="StableDiffusionPipeline",
    text_encoders=(_CLIP,),
    checkpoint_markers=(UNET_PREFIX + "input_blocks.0.0.weight",
                        _CLIP.single_file_prefix + "embeddings.token_embedding.weight"),
    high_precision=("conv_in", "conv_out", "time_embedding"),
    config_dir=ASSETS_DIR / "configs" / "sd15",
    native_modules=lora_aliases,
    # The safety checker is never loaded (nothing to download, nothing to run).
    pipeline_kwargs=MappingProxyType({"safety_checker": None, "feature_extractor": None,
                                      "requires_safety_checker": False}),
)
