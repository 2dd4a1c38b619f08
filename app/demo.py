"""Tiny random-weight SD1.5 / SDXL / FLUX.1 pipelines and a demo data folder in the A1111 layout.

Used by tests (session fixtures) and by `launch.py` so a fresh install shows a working app without
downloading anything. The tiny models keep the real architectures' structure (LDM naming, SDXL's
two text encoders and text_time embedding, the real VAE scaling factors and upcast flag; Flux's
double and single blocks, CLIP-L + T5 with the real T5 vocabulary, the 16-channel VAE with its
shift) so every loader path — single file and diffusers folder — is exercised, at a size that runs
on two CPU cores. A Flux single file is written in the ComfyUI/Forge all-in-one layout.
PyTorch's default initialisation already gives structured, prompt-dependent images at this size
(tests check it), so no weight rescaling is applied.

    python -m app.demo DIR     # writes DIR/models/Stable-diffusion, DIR/embeddings
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file

from app.engine.models import CONFIGS_METADATA_KEY
from app.families import FAMILIES, family
from app.settings import Settings
from app.upscalers.demo import write_demo_upscaler

ARCHS = tuple(FAMILIES)
_TIME_EMBED_DIM = 8
# vocab_size and max_position_embeddings stay real so the bundled tokenizer works unchanged.
_CLIP = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=0, eos_token_id=2, pad_token_id=1)
_TEXT_L = dict(
    _CLIP,
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=3,
    hidden_act="quick_gelu",
    projection_dim=32,
)
# SDXL's second encoder must be wider than the first: diffusers' single-file loader tells the two
# apart by the width of their position embeddings and would give both the first one's weights.
_TEXT_G = dict(_TEXT_L, hidden_size=64, intermediate_size=96, hidden_act="gelu")
# Four levels like the real VAE (downscale 8), so the UI's default 512² means a 64² latent, as it
# does for SD1.5: two levels would give a 256² latent whose attention is far too slow on a CPU.
_VAE = dict(
    block_out_channels=(16, 16, 32, 32),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    latent_channels=4,
    layers_per_block=1,
    norm_num_groups=16,
    sample_size=64,
)
_UNET = dict(sample_size=8, block_out_channels=(32, 64), norm_num_groups=32)
# SD1.5 mirrors the real layout (attention on top levels, plain bottom level, layers_per_block 2);
# SDXL uses layers_per_block 1 so the LDM block numbering is exercised for both values.
TINY_CONFIGS = {
    "sd15": {
        "unet": dict(
            _UNET,
            layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=_TEXT_L["hidden_size"],
            attention_head_dim=8,
        ),
        "vae": dict(_VAE, scaling_factor=0.18215),
        "text_encoder": dict(_TEXT_L, num_hidden_layers=5),
    },
    "sdxl": {
        "unet": dict(
            _UNET,
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=_TEXT_L["hidden_size"] + _TEXT_G["hidden_size"],
            attention_head_dim=(2, 4),
            transformer_layers_per_block=(1, 2),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=_TIME_EMBED_DIM,
            projection_class_embeddings_input_dim=6 * _TIME_EMBED_DIM + _TEXT_G["projection_dim"],
        ),
        "vae": dict(_VAE, scaling_factor=0.13025, force_upcast=True),
        "text_encoder": _TEXT_L,
        "text_encoder_2": _TEXT_G,
    },
}
# Flux: two double and two single blocks (so block numbering and `group` offload see lists), heads
# 2 x 8 with rope axes summing to 8, the real 16 latent channels (in_channels = 16 x 2 x 2 patches).
_T5 = dict(vocab_size=32128, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
           relative_attention_num_buckets=32, relative_attention_max_distance=128, is_encoder_decoder=False,
           use_cache=False, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
_FLUX = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=8,
             num_attention_heads=2, joint_attention_dim=_T5["d_model"], pooled_projection_dim=_TEXT_L["hidden_size"],
             axes_dims_rope=(2, 2, 4))
_FLUX_VAE = dict(_VAE, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                 use_post_quant_conv=False, force_upcast=True)
for _name, _dev in (("flux-dev", True), ("flux-schnell", False)):
    TINY_CONFIGS[_name] = {"transformer": dict(_FLUX, guidance_embeds=_dev), "vae": _FLUX_VAE,
                           "text_encoder": _TEXT_L, "text_encoder_2": _T5}
EMBEDDING_VECTORS = 2

LoraWriter = Callable[[Path, object, str], None]


def _trained_norm(encoder):
    """Give a CLIP encoder's final norm a bias, as a trained one has: with bias 0 every output token has
    mean 0, and A1111's emphasis, which rescales by the mean of the output, would divide by ~1e-8."""
    for name, module in encoder.named_modules():
        if name.endswith("final_layer_norm") and getattr(module, "bias", None) is not None:
            with torch.no_grad():
                module.bias.normal_(0.1, 0.1)
    return encoder


def build_tiny_pipeline(arch: str, seed: int = 0, in_channels: int | None = None):
    """A random-weight tiny pipeline on CPU in float32; the same seed gives the same weights.
    `in_channels=9` makes an inpainting checkpoint's UNet (latents + mask + masked-image latents).

    The global RNG is forked so building a pipeline does not disturb the caller's random state.
    """
    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    configs, fam = TINY_CONFIGS[arch], family(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components = {
            fam.denoiser: fam.denoiser_class(**configs[fam.denoiser],
                                              **({} if in_channels is None else {"in_channels": in_channels})),
            "vae": AutoencoderKL(**configs["vae"]),
        }
        for te in fam.text_encoders:
            components[te.component] = _trained_norm(te.model_class(te.config_class(**configs[te.component])))
    index = json.loads((fam.config_dir / "model_index.json").read_text())
    scheduler_cls = getattr(diffusers, index["scheduler"][1])
    components["scheduler"] = scheduler_cls.from_pretrained(fam.config_dir, subfolder="scheduler")
    # Plain diffusers classes, so the written folders load in any diffusers-based tool.
    pipe = fam.plain_pipeline_class(**components, **fam.tokenizers(), **fam.pipeline_kwargs)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    return pipe


def component_configs(pipe, arch: str) -> dict[str, dict]:
    """The model components' configs as JSON objects (what a tiny single file embeds)."""
    names = [*family(arch).components, "vae"]
    configs = {}
    for name in names:
        module = getattr(pipe, name)
        # diffusers models serialise their config themselves; transformers models through `.config`.
        holder = module if isinstance(module, diffusers.ConfigMixin) else module.config
        configs[name] = json.loads(holder.to_json_string())
    return configs


def write_single_file(pipe, arch: str, path: Path) -> None:
    """Save in the family's single-file layout (LDM for SD, the all-in-one for Flux) with the
    component configs embedded in the metadata."""
    metadata = {"format": "pt", CONFIGS_METADATA_KEY: json.dumps(component_configs(pipe, arch))}
    save_file(family(arch).single_file_state(pipe), str(path), metadata=metadata)


def embedding_tensors(pipe, arch: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random textual-inversion embedding in the A1111 layout for `arch`, scaled like the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for te in family(arch).text_encoders:
        key = te.embedding_key
        table = getattr(pipe, te.component).get_input_embeddings().weight.detach()
        vectors = torch.randn(EMBEDDING_VECTORS, table.shape[1], generator=generator)
        tensors[key] = (vectors * table.std()).contiguous()
    return tensors


def write_demo(data_dir: Path, lora_writer: LoraWriter | None = None, seed: int = 0,
               inpainting: bool = False, folders: bool = True) -> dict[str, Path]:
    """Write tiny checkpoints (single file, and with `folders` a diffusers folder) and embeddings
    for every family.

    LoRA files are not written here: `app/adapters` owns their formats, so a caller passes
    `lora_writer(lora_dir, pipe, arch)`, called once per architecture with that tiny pipeline.
    Returns the written paths by name (`sd15_file`, `sd15_folder`, `sd15_embedding`, ... plus
    `checkpoints_dir`, `lora_dir`, `embeddings_dir`, and `upscaler_file`, the tiny upscaler model).
    With `inpainting` also `sd15_inpainting_file`, an
    SD1.5 inpainting checkpoint with a 9-channel UNet. The command line and the tests write both
    extras; the first start of the app writes neither: one checkpoint per family is all a newcomer
    needs, and the four folders cost 1.0 of the 3.3 CPU s (2 cores) that writing everything takes.
    """
    settings = Settings(data_dir=Path(data_dir))
    paths = {
        "checkpoints_dir": settings.checkpoints_dir,
        "lora_dir": settings.lora_dir,
        "embeddings_dir": settings.embeddings_dir,
    }
    for folder in paths.values():
        folder.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        pipe = build_tiny_pipeline(arch, seed)
        paths[f"{arch}_file"] = settings.checkpoints_dir / f"tiny-{arch}.safetensors"
        write_single_file(pipe, arch, paths[f"{arch}_file"])
        if folders:
            paths[f"{arch}_folder"] = settings.checkpoints_dir / f"tiny-{arch}-diffusers"
            pipe.save_pretrained(paths[f"{arch}_folder"], safe_serialization=True)
        paths[f"{arch}_embedding"] = settings.embeddings_dir / f"tiny-{arch}-embedding.safetensors"
        save_file(embedding_tensors(pipe, arch, seed), str(paths[f"{arch}_embedding"]))
        if lora_writer is not None:
            lora_writer(settings.lora_dir, pipe, arch)
    paths["upscaler_file"] = write_demo_upscaler(settings.data_dir / "models", seed)
    if inpainting:
        paths["sd15_inpainting_file"] = settings.checkpoints_dir / "tiny-sd15-inpainting.safetensors"
        write_single_file(build_tiny_pipeline("sd15", seed, in_channels=9), "sd15", paths["sd15_inpainting_file"])
    return paths


def main() -> None:
    from app.adapters.synthetic import write_demo_loras

    parser = argparse.ArgumentParser(description="Write tiny demo models and LoRAs in the A1111 folder layout.")
    parser.add_argument("data_dir", type=Path)
    args = parser.parse_args()
    for name, path in write_demo(args.data_dir, lora_writer=write_demo_loras, inpainting=True).items():
        print(f"{name:16} {path}")


if __name__ == "__main__":
    main()
