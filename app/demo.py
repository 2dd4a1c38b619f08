"""Tiny random-weight pipelines of every family and a demo data folder in the A1111 layout.

Used by tests (session fixtures) and by `launch.py` so a fresh install shows a working app without
downloading anything. The tiny models keep the real architectures' structure (LDM naming, SDXL's
two text encoders and text_time embedding, the real VAE scaling factors and upcast flag; Flux's
double and single blocks, CLIP-L + T5 with the real T5 vocabulary, the 16-channel VAE with its
shift) so every loader path — single file and diffusers folder — is exercised, at a size that runs
on two CPU cores. A Flux single file is written in the ComfyUI/Forge all-in-one layout. Each family
states its tiny configs and component classes (`TestKit.tiny_configs`, app/families/).
PyTorch's default initialisation already gives structured, prompt-dependent images at this size
(tests check it), so no weight rescaling is applied.

    python -m app.demo DIR     # writes DIR/models/Stable-diffusion (with an SD1.5 inpainting checkpoint),
                               # DIR/models/Lora, DIR/embeddings, DIR/models/RealESRGAN

Every checkpoint it writes is marked as a demo (`DEMO_METADATA_KEY`, `DEMO_NOTE_FILE`), so the page can
say that its noise is the weights', not a broken app.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import diffusers
import torch
from safetensors.torch import save_file

from app.engine.models import CONFIGS_METADATA_KEY
from app.families import DEMO_SIDE, FAMILIES, FamilyContractError, family
from app.safetensors_files import read_header
from app.settings import Settings
from app.upscalers.demo import write_demo_upscaler

EMBEDDING_VECTORS = 2
# How a demo checkpoint says it is one (the page shows a banner while one is loaded: `is_demo_checkpoint`):
# a single file in its safetensors metadata, a diffusers folder by a note file beside model_index.json.
DEMO_METADATA_KEY = "steady_diffusion.demo"
DEMO_NOTE_FILE = "STEADY-DIFFUSION-DEMO.txt"
DEMO_NOTE = ("Random weights written by `python -m app.demo` (or the first start of the app): the images are "
             "noise. Real checkpoints go in models/Stable-diffusion/.")

LoraWriter = Callable[[Path, object, str], None]


def _trained_norm(encoder):
    """Give a CLIP encoder's final norm a bias, as a trained one has: with bias 0 every output token has
    mean 0, and A1111's emphasis, which rescales by the mean of the output, would divide by ~1e-8."""
    for name, module in encoder.named_modules():
        if name.endswith("final_layer_norm") and getattr(module, "bias", None) is not None:
            with torch.no_grad():
                module.bias.normal_(0.1, 0.1)
    return encoder


def build_tiny_pipeline(family_name: str, seed: int = 0, in_channels: int | None = None):
    """A random-weight tiny pipeline on CPU in float32; the same seed gives the same weights.
    `in_channels=9` makes an inpainting checkpoint's UNet (latents + mask + masked-image latents).

    The global RNG is forked so building a pipeline does not disturb the caller's random state.
    """
    fam = family(family_name)  # registered: its tiny_configs state every component (`check_contract`)
    pipe = _tiny_pipeline(fam, fam.test_kit.tiny_configs, seed, in_channels)
    if fam.native_size(pipe) != DEMO_SIDE:
        raise FamilyContractError(f"model family {fam.name!r} breaks the family contract: its tiny model's native "
                                  f"size is {fam.native_size(pipe)}, the demo's rule is {DEMO_SIDE} (DEMO_SIDE)")
    return pipe


def _tiny_pipeline(fam, configs, seed: int, in_channels: int | None):
    """The family's plain diffusers pipeline of random-weight components built from `configs`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components = {
            fam.denoiser: fam.denoiser_class(**configs[fam.denoiser],
                                              **({} if in_channels is None else {"in_channels": in_channels})),
            "vae": fam.vae_class(**configs["vae"]),
        }
        for te in fam.text_encoders:
            components[te.component] = _trained_norm(te.model_class(te.config_class(**configs[te.component])))
    index = json.loads((fam.files.config_dir / "model_index.json").read_text())
    scheduler_cls = getattr(diffusers, index["scheduler"][1])
    components["scheduler"] = scheduler_cls.from_pretrained(fam.files.config_dir, subfolder="scheduler")
    # Plain diffusers classes, so the written folders load in any diffusers-based tool.
    pipe = fam.plain_pipeline_class(**components, **fam.tokenizers(), **fam.pipeline_kwargs)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    with torch.no_grad():
        fam.test_kit.tiny_trained(pipe)
    return pipe


def component_configs(pipe, family_name: str) -> dict[str, dict]:
    """The model components' configs as JSON objects (what a tiny single file embeds)."""
    names = [*family(family_name).components, "vae"]
    configs = {}
    for name in names:
        module = getattr(pipe, name)
        # diffusers models serialise their config themselves; transformers models through `.config`.
        holder = module if isinstance(module, diffusers.ConfigMixin) else module.config
        configs[name] = json.loads(holder.to_json_string())
    return configs


def write_single_file(pipe, family_name: str, path: Path) -> None:
    """Save in the family's single-file layout (LDM for SD, the all-in-one for Flux) with the
    component configs embedded in the metadata."""
    metadata = {"format": "pt", CONFIGS_METADATA_KEY: json.dumps(component_configs(pipe, family_name)),
                DEMO_METADATA_KEY: DEMO_NOTE}
    save_file(family(family_name).single_file_state(pipe), str(path), metadata=metadata)


def is_demo_checkpoint(path: Path) -> bool:
    """Whether the checkpoint at `path` (a file or a diffusers folder) is one the demo wrote (random weights)."""
    if path.is_dir():
        return (path / DEMO_NOTE_FILE).is_file()
    try:
        return DEMO_METADATA_KEY in read_header(path)[1]
    except (OSError, ValueError):  # unreadable: the load names why; this is only the banner
        return False


def embedding_tensors(pipe, family_name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random textual-inversion embedding in the A1111 layout for `family_name`, scaled like the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for te in family(family_name).text_encoders:
        key = te.embedding_key
        table = getattr(pipe, te.component).get_input_embeddings().weight.detach()
        vectors = torch.randn(EMBEDDING_VECTORS, table.shape[1], generator=generator)
        tensors[key] = (vectors * table.std()).contiguous()
    return tensors


def build_tiny_controlnet(family_name: str, seed: int = 0,
                          config: Mapping[str, object] | None = None) -> torch.nn.Module:
    """A tiny random-weight ControlNet of `family_name`'s (its kit's `tiny_config`, or `config`: another layout the
    kit reads). The layers a ControlNet is trained from zero (its zero convolutions, the hint embedding's last
    conv) are drawn too: left at zero the ControlNet would add nothing, and no test could tell one control
    image from another."""
    kit = family(family_name).controlnet
    torch.manual_seed(seed)
    model = kit.model_classes[0].from_config(dict(kit.tiny_config if config is None else config))
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.05)
    return model.eval()


def write_demo_controlnets(settings: Settings, seed: int = 0) -> dict[str, Path]:
    """For each family taking ControlNets, a tiny one as a diffusers folder in `models/ControlNet/`
    (`tiny-<family>-controlnet`), and in the users' single-file layout where the family has one
    (`tiny-<family>-controlnet-single.safetensors`: LDM names for SD1.5)."""
    paths = {}
    for family_name, fam in FAMILIES.items():
        if fam.controlnet is None:
            continue
        model = build_tiny_controlnet(family_name, seed)
        paths[f"{family_name}_controlnet"] = settings.controlnet_dir / f"tiny-{family_name}-controlnet"
        model.save_pretrained(paths[f"{family_name}_controlnet"], safe_serialization=True)
        if fam.controlnet.to_single_file is not None:
            single = f"tiny-{family_name}-controlnet-single.safetensors"
            paths[f"{family_name}_controlnet_file"] = settings.controlnet_dir / single
            state = fam.controlnet.to_single_file(model.state_dict(), model.config)
            save_file({k: v.contiguous() for k, v in state.items()}, str(paths[f"{family_name}_controlnet_file"]))
    return paths


def write_demo(data_dir: Path, lora_writer: LoraWriter | None = None, seed: int = 0,
               inpainting: bool = False, folders: bool = True) -> dict[str, Path]:
    """Write tiny checkpoints (single file, and with `folders` a diffusers folder) and embeddings
    for every registered family (embeddings where the family takes them).

    LoRA files are not written here: `app/adapters` owns their formats, so a caller passes
    `lora_writer(lora_dir, pipe, family_name)`, called once per family with that tiny pipeline.
    Returns the written paths by name (`sd15_file`, `sd15_folder`, `sd15_embedding`, ... plus
    `checkpoints_dir`, `lora_dir`, `embeddings_dir`, and `upscaler_file`, the tiny upscaler model). With
    `inpainting` also `<family>_inpainting_file`, an inpainting checkpoint (a 9-channel UNet) of each family
    stating `tiny_inpainting_channels`. The command line and the tests write both
    extras; the first start of the app writes the inpainting checkpoints (so the Inpaint sub-tab can be
    tried at once) but no folders: one checkpoint per family is all a newcomer needs (a folder for a
    family that loads no single file), and the folders cost 1.0 of the 3.3 CPU s (2 cores) that writing
    everything takes.
    """
    settings = Settings(data_dir=Path(data_dir))
    paths = {
        "checkpoints_dir": settings.checkpoints_dir,
        "lora_dir": settings.lora_dir,
        "embeddings_dir": settings.embeddings_dir,
    }
    for folder in paths.values():
        folder.mkdir(parents=True, exist_ok=True)
    for family_name in FAMILIES:
        pipe = build_tiny_pipeline(family_name, seed)
        if "file" in family(family_name).files.layouts:
            paths[f"{family_name}_file"] = settings.checkpoints_dir / f"tiny-{family_name}.safetensors"
            write_single_file(pipe, family_name, paths[f"{family_name}_file"])
        layouts = family(family_name).files.layouts
        if "folder" in layouts and (folders or "file" not in layouts):
            paths[f"{family_name}_folder"] = settings.checkpoints_dir / f"tiny-{family_name}-diffusers"
            pipe.save_pretrained(paths[f"{family_name}_folder"], safe_serialization=True)
            (paths[f"{family_name}_folder"] / DEMO_NOTE_FILE).write_text(DEMO_NOTE + "\n", encoding="utf-8")
        if family(family_name).files.takes_embeddings:
            paths[f"{family_name}_embedding"] = settings.embeddings_dir / f"tiny-{family_name}-embedding.safetensors"
            save_file(embedding_tensors(pipe, family_name, seed), str(paths[f"{family_name}_embedding"]))
        if lora_writer is not None:
            lora_writer(settings.lora_dir, pipe, family_name)
        channels = family(family_name).test_kit.tiny_inpainting_channels
        if inpainting and channels is not None:
            inpainting_file = settings.checkpoints_dir / f"tiny-{family_name}-inpainting.safetensors"
            paths[f"{family_name}_inpainting_file"] = inpainting_file
            write_single_file(build_tiny_pipeline(family_name, seed, in_channels=channels), family_name,
                              paths[f"{family_name}_inpainting_file"])
    paths["upscaler_file"] = write_demo_upscaler(settings.data_dir / "models", seed)
    paths.update(write_demo_controlnets(settings, seed))
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
