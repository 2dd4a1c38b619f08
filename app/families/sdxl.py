"""SDXL base: CLIP ViT-L/14 plus OpenCLIP ViT-bigG/14 (with projection), 1024² native size."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from diffusers import (
    StableDiffusionXLControlNetImg2ImgPipeline,
    StableDiffusionXLControlNetPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
)
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from app.families import ASSETS_DIR, Family, Files, LatentFormat, Precision, TextEncoder
from app.families.ldm_layout import UNET_PREFIX
from app.families.pipelines import EnginePipeline, VariedNoise
from app.families.sd_controlnet import sd_controlnet_kit
from app.families.tiny_parts import SD_ADAPTERS, SD_SHARED, SD_TEST_KIT, TINY_CLIP_L, TINY_UNET, TINY_VAE, sd_bench


class SteadySDXLPipeline(EnginePipeline, VariedNoise, StableDiffusionXLPipeline):
    """SDXL pipeline whose execution device is set by the engine."""


class SteadySDXLImg2ImgPipeline(EnginePipeline, StableDiffusionXLImg2ImgPipeline):
    """SDXL img2img (and hires fix second pass) stage pipeline."""


class SteadySDXLInpaintPipeline(EnginePipeline, StableDiffusionXLInpaintPipeline):
    """SDXL inpaint stage pipeline (4- or 9-channel UNet)."""


class SteadySDXLControlNetPipeline(EnginePipeline, VariedNoise, StableDiffusionXLControlNetPipeline):
    """SDXL txt2img with ControlNet units (a stage pipeline on the loaded components)."""


class SteadySDXLControlNetImg2ImgPipeline(EnginePipeline, StableDiffusionXLControlNetImg2ImgPipeline):
    """img2img and the hires pass with ControlNet units."""


_TIME_EMBED_DIM = 8
# The second encoder must be wider than the first: diffusers' single-file loader tells the two
# apart by the width of their position embeddings and would give both the first one's weights.
_TINY_CLIP_G = dict(TINY_CLIP_L, hidden_size=64, intermediate_size=96, hidden_act="gelu")

_CLIP_L = TextEncoder("text_encoder", "tokenizer", CLIPTextModel,
                      "conditioner.embedders.0.transformer.text_model.", open_clip=False,
                      lora_prefix="lora_te1_", embedding_key="clip_l", layer="penultimate")
_CLIP_G = TextEncoder("text_encoder_2", "tokenizer_2", CLIPTextModelWithProjection, "conditioner.embedders.1.model.",
                      open_clip=True, lora_prefix="lora_te2_", embedding_key="clip_g", pad_token="!",
                      reads="both", layer="penultimate")

_TINY_UNET = dict(TINY_UNET, layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                  cross_attention_dim=TINY_CLIP_L["hidden_size"] + _TINY_CLIP_G["hidden_size"],
                  attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), use_linear_projection=True,
                  addition_embed_type="text_time", addition_time_embed_dim=_TIME_EMBED_DIM,
                  projection_class_embeddings_input_dim=6 * _TIME_EMBED_DIM + _TINY_CLIP_G["projection_dim"])
_CONTROLNET = sd_controlnet_kit(
    {"txt2img": SteadySDXLControlNetPipeline, "img2img": SteadySDXLControlNetImg2ImgPipeline},
    text_time=True, widths=(2048, TINY_CLIP_L["hidden_size"] + _TINY_CLIP_G["hidden_size"]),
    config_dir=ASSETS_DIR / "configs" / "sdxl", tiny_unet=_TINY_UNET, ldm_files=False)

SDXL = Family(
    name="sdxl",
    label="SDXL",
    pipeline_class=SteadySDXLPipeline,
    stage_pipelines=MappingProxyType({"img2img": SteadySDXLImg2ImgPipeline, "inpaint": SteadySDXLInpaintPipeline}),
    diffusers_pipeline="StableDiffusionXLPipeline",
    text_encoders=(_CLIP_L, _CLIP_G),
    files=Files(ASSETS_DIR / "configs" / "sdxl", checkpoint_markers=(
        UNET_PREFIX + "label_emb.0.0.weight", _CLIP_L.single_file_prefix + "embeddings.token_embedding.weight",
        _CLIP_G.single_file_prefix + "token_embedding.weight")),
    precision=Precision(high_precision=("conv_in", "conv_out", "time_embedding", "add_embedding", "text_projection"),
                        vae_upcast_in_fp16=True),
    refiner_families=("sdxl",),
    **SD_SHARED,
    # ComfyUI's published latent-preview fit (comfy/latent_formats.py, SDXL)
    latent_format=LatentFormat(preview_rgb=(
        ((0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362),
         (-0.3165, -0.2492, -0.2188)), (0.1084, -0.0175, -0.0011))),
    adapters=dataclasses.replace(SD_ADAPTERS, kohya_ldm_names=True, markers=(
        "sdxl_base_v1-0", "stable-diffusion-xl-v1-base", "sdxl", "stable-diffusion-xl", "xl")),
    # benched beside SD1.5 in the compile and channels_last sections; no device-check section of its own
    controlnet=_CONTROLNET,
    test_kit=dataclasses.replace(
        SD_TEST_KIT,
        # layers_per_block 1 (SD1.5's tiny UNet has 2), so the LDM block numbering is exercised for both values
        tiny_configs=MappingProxyType({
            "unet": _TINY_UNET,
            "vae": dict(TINY_VAE, scaling_factor=0.13025, force_upcast=True),
            "text_encoder": TINY_CLIP_L,
            "text_encoder_2": _TINY_CLIP_G,
        }),
        bench=sd_bench(1024)),
)
FAMILIES = (SDXL,)
