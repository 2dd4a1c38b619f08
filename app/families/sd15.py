"""Stable Diffusion 1.x: one CLIP ViT-L/14 text encoder, 512² native size."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from diffusers import (
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
)
from transformers import CLIPTextModel

from app.families import ASSETS_DIR, Family, Files, LatentFormat, Precision, TextEncoder
from app.families.ldm_layout import UNET_PREFIX
from app.families.pipelines import EnginePipeline, VariedNoise
from app.families.sd_controlnet import sd_controlnet_kit
from app.families.tiny_parts import SD_ADAPTERS, SD_SHARED, SD_TEST_KIT, TINY_CLIP_L, TINY_UNET, TINY_VAE, sd_bench


class SteadySDPipeline(EnginePipeline, VariedNoise, StableDiffusionPipeline):
    """SD1.5 pipeline whose execution device is set by the engine."""


class SteadySDImg2ImgPipeline(EnginePipeline, StableDiffusionImg2ImgPipeline):
    """SD1.5 img2img (and hires fix second pass) stage pipeline."""


class SteadySDInpaintPipeline(EnginePipeline, StableDiffusionInpaintPipeline):
    """SD1.5 inpaint stage pipeline (4- or 9-channel UNet)."""


class SteadySDControlNetPipeline(EnginePipeline, VariedNoise, StableDiffusionControlNetPipeline):
    """SD1.5 txt2img with ControlNet units (a stage pipeline on the loaded components)."""


class SteadySDControlNetImg2ImgPipeline(EnginePipeline, StableDiffusionControlNetImg2ImgPipeline):
    """img2img and the hires pass with ControlNet units."""


_CLIP = TextEncoder("text_encoder", "tokenizer", CLIPTextModel, "cond_stage_model.transformer.text_model.",
                    open_clip=False, lora_prefix="lora_te_", embedding_key="emb_params")

_TINY_UNET = dict(TINY_UNET, layers_per_block=2, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                  cross_attention_dim=TINY_CLIP_L["hidden_size"], attention_head_dim=8)
_CONTROLNET = sd_controlnet_kit(
    {"txt2img": SteadySDControlNetPipeline, "img2img": SteadySDControlNetImg2ImgPipeline},
    text_time=False, widths=(768, TINY_CLIP_L["hidden_size"]), config_dir=ASSETS_DIR / "configs" / "sd15",
    tiny_unet=_TINY_UNET, ldm_files=True)

SD15 = Family(
    name="sd15",
    label="SD1.5",
    pipeline_class=SteadySDPipeline,
    stage_pipelines=MappingProxyType({"img2img": SteadySDImg2ImgPipeline, "inpaint": SteadySDInpaintPipeline}),
    diffusers_pipeline="StableDiffusionPipeline",
    text_encoders=(_CLIP,),
    files=Files(ASSETS_DIR / "configs" / "sd15", checkpoint_markers=(
        UNET_PREFIX + "input_blocks.0.0.weight", _CLIP.single_file_prefix + "embeddings.token_embedding.weight")),
    precision=Precision(high_precision=("conv_in", "conv_out", "time_embedding")),
    **SD_SHARED,
    # ComfyUI's published latent-preview fit (comfy/latent_formats.py, SD15)
    latent_format=LatentFormat(preview_rgb=(
        ((0.3512, 0.2297, 0.3227), (0.3250, 0.4974, 0.2350), (-0.2829, 0.1762, 0.2721),
         (-0.2120, -0.2616, -0.7177)), (0.0, 0.0, 0.0))),
    adapters=dataclasses.replace(SD_ADAPTERS, label="SD1.5",
                                 markers=("sd_v1", "stable-diffusion-v1", "sd1", "sd_1", "sd 1", "v1")),
    # The safety checker is never loaded (nothing to download, nothing to run).
    pipeline_kwargs=MappingProxyType({"safety_checker": None, "feature_extractor": None,
                                      "requires_safety_checker": False}),
    controlnet=_CONTROLNET,
    test_kit=dataclasses.replace(
        SD_TEST_KIT,
        tiny_inpainting_channels=9,  # latents + mask + masked-image latents
        # SD1.5 mirrors the real layout (attention on top levels, plain bottom level, layers_per_block 2).
        tiny_configs=MappingProxyType({
            "unet": _TINY_UNET,
            "vae": dict(TINY_VAE, scaling_factor=0.18215),
            "text_encoder": dict(TINY_CLIP_L, num_hidden_layers=5),
        }),
        bench=sd_bench(512, check=("--sections", "throughput,latency", "--batches", "1", "--loras", "0,3",
                                   "--no-channels-last", "--repeats", "4"),
                       check_s=85, check_order=1,
                       check_title="SD1.5 512²: ours vs diffusers eager, 3 fused LoRAs vs none and vs PEFT, LoRA "
                                   "add/re-weight/remove ms, peak VRAM; ABBA with control")),
)
FAMILIES = (SD15,)
