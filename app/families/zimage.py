"""Z-Image Turbo and Z-Image (Base): a 6B single-stream DiT with the Qwen3-4B text encoder and the
FLUX autoencoder, 1024² native size (Tongyi-MAI, Apache-2.0).

Two families on one architecture, as their model cards run them: Turbo is distilled for 8 steps
without classifier-free guidance (`guidance_scale=0` in diffusers); Base is the undistilled model,
run with CFG and a negative prompt over 28–50 steps. The two share every tensor name; a diffusers
folder says which it is by its scheduler's static time shift (Turbo 3.0, Base 6.0). A single file
cannot say, so it loads as Turbo (listed first); its steps and CFG are the user's to change.

CFG: Z-Image's pipelines compute `pos + g·(pos − neg)` and run no unconditional pass at `g = 0`;
A1111, Forge and ComfyUI compute `neg + s·(pos − neg)`, no CFG at `s = 1`. The CFG field keeps
their meaning (`guidance_call`: g = s − 1), so an infotext or a ComfyUI workflow's "cfg 5" means the
same image here (diffusers' 4.0, Base's card value).

Files come as a diffusers folder, or as the ComfyUI transformer (`z_image_turbo_bf16.safetensors`,
original names with fused `attention.qkv`, bf16, fp8 or fp8 "scaled") with the text encoder in
`models/text_encoder` (`qwen_3_4b.safetensors`) and the VAE in `models/VAE` (`ae.safetensors`),
as FLUX.1 does; `Files.parts` says how each is found. LoRAs: diffusers/PEFT and musubi-tuner
(`lora_unet_layers_0_attention_to_q`) name diffusers' modules and need nothing here; ai-toolkit
writes them under `diffusion_model.`; kohya-style converted files and ComfyUI name the original
modules, fused `qkv` cut into `to_q`/`to_k`/`to_v` by rows (`lora_aliases`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import torch
from diffusers import (
    ZImageControlNetPipeline,
    ZImageImg2ImgPipeline,
    ZImageInpaintPipeline,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from diffusers.image_processor import VaeImageProcessor

from app.families import ASSETS_DIR, Adapters, BenchSpec, ComponentFile, Family, Files, Precision, TestKit
from app.families.file_layout import file_name_aliases
from app.families.flow_dit import DIT_PREFIXES, DIT_SHARED, FLOW_SAMPLING, FLUX_LATENTS, FLUX_VAE_PART, TINY_FLUX_VAE
from app.families.ldm_layout import LYCORIS
from app.families.pipelines import EnginePipeline, StrengthSteps, VariedNoise
from app.families.qwen3 import QWEN3, QWEN3_PART, QWEN3_PINNED
from app.families.zimage_controlnet import zimage_controlnet_kit
from app.families.zimage_layout import transformer_layout

KOHYA_ORIGINAL = "kohya (original Z-Image names)"
COMFY = "ComfyUI (diffusion_model., original names)"
AI_TOOLKIT = "ai-toolkit (diffusion_model., diffusers names)"


class SteadyZImagePipeline(EnginePipeline, VariedNoise, ZImagePipeline):
    """Z-Image pipeline whose execution device is set by the engine, with A1111's variation seeds."""


class SteadyZImageControlNetPipeline(EnginePipeline, VariedNoise, ZImageControlNetPipeline):
    """Z-Image txt2img steered by union ControlNets, held by `zimage_controlnet.ZImageControlNetStack` (which
    borrows the transformer's embedders and refiners without owning them). Its control image is a list, one map
    per unit, VAE-encoded image-major and unit-minor (the stack's layout), in the VAE's compute dtype (diffusers
    reads the VAE's resting one). The control latents are the VAE's mean, drawing nothing from the generators:
    the first noise is the one the seed draws without a ControlNet."""

    def __call__(self, *args, num_inference_steps: int = 50, **kwargs):
        self.controlnet.begin(num_inference_steps)
        return super().__call__(*args, num_inference_steps=num_inference_steps, **kwargs)

    def prepare_image(self, image, width, height, batch_size, num_images_per_prompt, device, dtype,
                      do_classifier_free_guidance=False, guess_mode=False):
        dtype = self.compute_dtypes.get("vae", dtype)
        maps = [super(SteadyZImageControlNetPipeline, self).prepare_image(
            one, width, height, batch_size, num_images_per_prompt, device, dtype, do_classifier_free_guidance,
            guess_mode) for one in (image if isinstance(image, list) else [image])]
        return torch.stack(maps, dim=1).flatten(0, 1)


class _ZImageStage(EnginePipeline, StrengthSteps):
    """The engine hands a stage pipeline latents it encoded itself (`app/engine/stages.py`).

    diffusers' Z-Image stage pipelines read them only if their image processor knows latents have 16
    channels (it is built with SD's 4); they run int(steps × strength) steps (`StrengthSteps`)."""

    def __init__(self, scheduler, vae, text_encoder, tokenizer, transformer) -> None:
        # diffusers builds a pipeline from the names its __init__ states: both stage classes take these
        super().__init__(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2,
                                                 vae_latent_channels=self.vae.config.latent_channels)


class SteadyZImageImg2ImgPipeline(_ZImageStage, ZImageImg2ImgPipeline):
    """Z-Image img2img (and hires fix second pass) stage pipeline."""


class SteadyZImageInpaintPipeline(_ZImageStage, ZImageInpaintPipeline):
    """Z-Image inpaint stage pipeline: the regular transformer, the mask blends latents each step."""

    def prepare_mask_latents(self, mask, masked_image, batch_size, height, width, dtype, device, generator):
        """The mask at latent size; no masked-image latents. diffusers' version VAE-encodes the masked
        pixels for a tensor the transformer never reads (only the blend reads the init latents), and
        the engine hands latents, not pixels."""
        size = (2 * (int(height) // (self.vae_scale_factor * 2)), 2 * (int(width) // (self.vae_scale_factor * 2)))
        mask = torch.nn.functional.interpolate(mask, size=size, mode="nearest").to(device=device, dtype=dtype)
        return mask.repeat(batch_size // mask.shape[0], 1, 1, 1), None


def lora_aliases(transformer):
    """(key, parts, spelling) for each original module as kohya (`lora_unet_layers_0_attention_qkv`),
    LyCORIS over original names and ComfyUI (`diffusion_model.layers.0.attention.qkv`) spell it,
    `qkv` listing its three row slices; and ai-toolkit's `diffusion_model.` + diffusers path."""
    yield from file_name_aliases(transformer_layout(transformer), "transformer", KOHYA_ORIGINAL, LYCORIS, COMFY)
    for path, module in transformer.named_modules():
        if path and getattr(module, "weight", None) is not None:
            yield f"diffusion_model.{path}", ((("transformer", path), None),), AI_TOOLKIT


_PARTS: tuple[ComponentFile, ...] = (
    ComponentFile("transformer", "transformer", ZImageTransformer2DModel, ("model.diffusion_model.", ""),
                  "layers.0.attention.qkv.weight", transformer_layout),
    QWEN3_PART,
    FLUX_VAE_PART,
)
# Tiny: one refiner block per stream and two main blocks (lists for `group` offload to stream),
# 2 heads of 16 with rope axes 4/6/6, the real axis lengths and 16 latent channels; Qwen3 with the
# real vocabulary (the bundled tokenizer) and three layers (the pipeline reads the next-to-last).
_TINY_QWEN3 = dict(vocab_size=151936, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=40960,
                   rope_theta=1000000.0, tie_word_embeddings=False)
_TINY_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                         n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=_TINY_QWEN3["hidden_size"],
                         axes_dims=(4, 6, 6), axes_lens=(1536, 512, 512))
# The same spread of layer kinds as the other families' test LoRAs: attention projections (q, out),
# the feed-forward, a modulation, an embedder and the refiners, and Qwen3.
_LORA_TARGETS = (
    "transformer.layers.0.attention.to_q", "transformer.layers.*.attention.to_out.0",
    "transformer.layers.1.feed_forward.w2", "transformer.layers.0.adaLN_modulation.0",
    "transformer.noise_refiner.0.attention.to_k", "transformer.context_refiner.0.feed_forward.w1",
    "transformer.cap_embedder.1",
    "text_encoder.layers.0.self_attn.q_proj", "text_encoder.layers.0.mlp.up_proj",
)
_DEMO_LORA_TARGETS = (
    ("transformer.*attention.to_[qkv]", "transformer.*attention.to_out.0", "text_encoder.*self_attn.*_proj"),
    ("transformer.*feed_forward.w[123]", "text_encoder.*mlp.*_proj"),
)
_STAGES = MappingProxyType({"img2img": SteadyZImageImg2ImgPipeline, "inpaint": SteadyZImageInpaintPipeline})


def _caption_length(args: tuple, _kwargs: dict) -> int | None:
    """The transformer takes its captions third, as a list of (tokens, features) tensors, one per image."""
    captions = args[2] if len(args) > 2 else None
    return max(len(c) for c in captions) if isinstance(captions, list) and captions else None


# The bench prompt in Qwen3's chat template is 19 tokens, which the transformer pads to its 32-token multiple.
_BENCH_CAPTION_TOKENS = 19


def _call_inputs(_fam, cfg, rows: int, latent_side: int, empty) -> dict:
    """One transformer call for the bench's op counts: lists, one (channels, 1, h, w) latent and one
    caption's Qwen3 states per image (Turbo runs the batch once: no CFG)."""
    return {"x": [empty(cfg.in_channels, 1, latent_side, latent_side) for _ in range(rows)], "t": empty(rows),
            "cap_feats": [empty(_BENCH_CAPTION_TOKENS, cfg.cap_feat_dim) for _ in range(rows)], "return_dict": False}


# The bench LoRAs' layers: attention projections and the SwiGLU feed-forward in every block, refiners included.
_BENCH = BenchSpec(1024, _call_inputs, r"\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123])$",
                   check=("--sections", "throughput,fp8", "--batches", "1", "--loras", "0,3", "--repeats", "2",
                          "--steps", "8"),
                   check_s=150, check_order=4, offload_check_s=380,
                   check_title="Z-Image Turbo 1024² bf16, 8 steps, no CFG, vs ZImagePipeline (none, 3 fused LoRAs, "
                               "PEFT), fp8 storage with none and 3 LoRAs as bypass; resting VRAM")


def _family(name: str, label: str, turbo: bool) -> Family:
    return Family(
        name=name,
        label=label,
        pipeline_class=SteadyZImagePipeline,
        stage_pipelines=_STAGES,
        diffusers_pipeline="ZImagePipeline",
        prompt_length=_caption_length,
        text_encoders=(QWEN3,),
        files=Files(
            config_dir=ASSETS_DIR / "configs" / name,
            layouts=("file", "folder") if turbo else ("folder",),
            checkpoint_markers=("layers.0.attention.qkv.weight", "cap_embedder.1.weight", "x_pad_token",
                                "noise_refiner.0.adaLN_modulation.0.weight"),
            marker_prefixes=DIT_PREFIXES,
            parts=_PARTS,
            # Turbo first: `family_of_pipeline` takes the first family whose `folder_config` fits, so a
            # folder with another shift is Base.
            folder_config=MappingProxyType({"scheduler/scheduler_config.json": {"shift": 3.0}} if turbo else {}),
            takes_embeddings=False),  # A1111 embeddings are CLIP vectors; Qwen3 has none
        denoiser_class=ZImageTransformer2DModel,
        **DIT_SHARED,
        latent_format=FLUX_LATENTS,
        first_block="layers.0",  # the first joint block (the refiners before it run on each stream alone)
        controlnet=zimage_controlnet_kit({"txt2img": SteadyZImageControlNetPipeline}, ASSETS_DIR / "configs" / name,
                                         _TINY_TRANSFORMER),
        precision=Precision(
            fp16_ok=False,
            # fp8 storage keeps the embedders and the final layer in the compute dtype, as peers' files do
            high_precision=("all_x_embedder", "cap_embedder", "t_embedder", "all_final_layer"),
            pinned_dtypes=QWEN3_PINNED),
        adapters=Adapters(
            lora_arch="zimage",
            label="Z-Image",
            markers=("z_image", "z-image", "zimage"),
            native_modules=lora_aliases),
        test_kit=TestKit(
            tiny_configs=MappingProxyType({"transformer": _TINY_TRANSFORMER, "vae": TINY_FLUX_VAE,
                                           "text_encoder": _TINY_QWEN3}),
            lora_targets=_LORA_TARGETS,
            demo_lora_targets=_DEMO_LORA_TARGETS,
            bench=_BENCH if turbo else None,  # Base is Turbo's architecture
        ),
        sampling=dataclasses.replace(FLOW_SAMPLING,
            default_steps=8 if turbo else 50,
            default_guidance=1.0 if turbo else 5.0,
            guidance_call=lambda cfg: {"guidance_scale": cfg - 1.0},
            step_distilled=lambda pipe: turbo,  # Turbo: 8 distilled steps
            max_sequence_length=512),
    )


ZIMAGE_TURBO = _family("zimage-turbo", "Z-Image Turbo", turbo=True)
ZIMAGE_BASE = _family("zimage-base", "Z-Image", turbo=False)
FAMILIES = (ZIMAGE_TURBO, ZIMAGE_BASE)
