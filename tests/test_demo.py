"""Tiny demo pipelines and the demo data folder that tests and first-run users rely on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from app import demo
from app.engine import checkpoint_files, models
from app.families import DEMO_MIN_CHANGE, DEMO_MIN_STD, DEMO_SIDE, FAMILIES, family, family_of


def _weights(pipe) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{k}": v
        for name in ("unet", "vae", "text_encoder")
        for k, v in getattr(pipe, name).state_dict().items()
    }


def _image(pipe, prompt: str) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    size = family_of(pipe).native_size(pipe)  # DEMO_SIDE for every tiny model (the demo builder checks it)
    image = pipe(prompt=prompt, num_inference_steps=2, generator=generator, output_type="np", height=size,
                 width=size).images[0]
    return image[..., :3]  # the RGB the engine keeps (an RGBA VAE's alpha is left out at decode)


def test_tiny_pipeline_is_deterministic_per_seed_and_leaves_global_rng_alone():
    """Fixtures rebuild the saved pipelines from the seed, so the same seed must give the same weights;
    building one must not shift the caller's random stream."""
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = _weights(demo.build_tiny_pipeline("sd15", seed=7))
    assert torch.equal(torch.rand(3), expected_next)
    again = _weights(demo.build_tiny_pipeline("sd15", seed=7))
    other = _weights(demo.build_tiny_pipeline("sd15", seed=8))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["unet.conv_in.weight"], other["unet.conv_in.weight"])


def test_tiny_pipeline_rejects_unknown_family():
    """Only registered families have tiny versions; the error lists them."""
    with pytest.raises(ValueError, match="sd15"):
        demo.build_tiny_pipeline("sd3")


@pytest.mark.parametrize("family_name", list(FAMILIES))
def test_tiny_pipeline_draws_a_prompt_dependent_image(family_name):
    """Random weights still give images with structure that change with the prompt, so tests that
    compare images (LoRA on/off, seeds, batches) can see a difference."""
    pipe = demo.build_tiny_pipeline(family_name)
    cat, dog = _image(pipe, "a photo of a cat"), _image(pipe, "a painting of a dog")
    assert cat.shape == (DEMO_SIDE, DEMO_SIDE, 3)
    assert cat.std() > DEMO_MIN_STD
    assert np.abs(cat - dog).max() > DEMO_MIN_CHANGE


def test_tiny_sdxl_keeps_the_real_structure_that_loaders_and_adapters_rely_on():
    """SDXL tiny: two encoders of different widths, text_time embedding, real VAE scaling and upcast."""
    pipe = demo.build_tiny_pipeline("sdxl")
    assert pipe.unet.config.addition_embed_type == "text_time"
    assert pipe.unet.config.cross_attention_dim == pipe.text_encoder.config.hidden_size + (
        pipe.text_encoder_2.config.hidden_size
    )
    assert pipe.text_encoder.config.hidden_size != pipe.text_encoder_2.config.hidden_size
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.force_upcast) == (0.13025, True)
    assert pipe.text_encoder.config.vocab_size == 49408 == len(pipe.tokenizer)


def test_write_demo_creates_the_a1111_layout(demo_dir, demo_paths):
    """The demo folder has every registered family in each layout it declares, a single file and a
    diffusers folder (Flux as the ComfyUI/Forge all-in-one file; Z-Image Base as a folder only), an
    inpainting checkpoint of each family that states one (SD1.5), and one embedding per family that
    takes embeddings."""
    checkpoints = demo_dir / "models" / "Stable-diffusion"
    names = [info.name for info in checkpoint_files.discover_checkpoints(checkpoints)]
    layouts = {"folder": "tiny-{}-diffusers", "file": "tiny-{}.safetensors"}
    expected = [name for family_name, fam in FAMILIES.items()
                for name in (*(layouts[layout].format(family_name) for layout in fam.files.layouts),
                             *([f"tiny-{family_name}-inpainting.safetensors"]
                               if fam.test_kit.tiny_inpainting_channels else []))]
    assert names == sorted(expected)
    assert "tiny-sd15-inpainting.safetensors" in names
    assert (demo_dir / "models" / "Lora").is_dir()
    assert demo_paths["lora_dir"] == demo_dir / "models" / "Lora"
    assert sorted(p.name for p in (demo_dir / "embeddings").iterdir()) == sorted(
        f"tiny-{name}-embedding.safetensors" for name, fam in FAMILIES.items() if fam.files.takes_embeddings)


@pytest.mark.parametrize("family_name", [name for name, fam in FAMILIES.items() if "file" in fam.files.layouts])
def test_demo_single_file_is_the_family_layout_with_embedded_configs(demo_paths, family_name):
    """Single files look like real checkpoints (the family's markers: LDM keys for SD, the all-in-one
    layout for Flux) and carry the tiny configs they were built from."""
    fam = family(family_name)
    with safe_open(str(demo_paths[f"{family_name}_file"]), "pt") as handle:
        keys, metadata = set(handle.keys()), handle.metadata()
    assert checkpoint_files.detect_family(keys) == family_name
    configs = json.loads(metadata[models.CONFIGS_METADATA_KEY])
    assert set(configs) == {*fam.components, "vae"} == set(fam.test_kit.tiny_configs)
    tiny = json.loads(json.dumps(fam.test_kit.tiny_configs[fam.denoiser]))  # tuples as JSON lists
    assert all(configs[fam.denoiser][k] == v for k, v in tiny.items())


def test_demo_embeddings_use_the_a1111_layouts(demo_paths):
    """SD1.5 embeddings hold `emb_params`; SDXL ones `clip_l` and `clip_g`, sized to each encoder."""
    sd15 = load_file(str(demo_paths["sd15_embedding"]))
    sdxl = load_file(str(demo_paths["sdxl_embedding"]))
    assert {k: tuple(v.shape) for k, v in sd15.items()} == {"emb_params": (2, 32)}
    assert {k: tuple(v.shape) for k, v in sdxl.items()} == {"clip_l": (2, 32), "clip_g": (2, 64)}


def test_write_demo_calls_the_lora_writer_once_per_family(tmp_path):
    """LoRA files come from app/adapters through this hook, given the Lora folder and each tiny pipeline."""
    calls = []
    demo.write_demo(
        tmp_path, lora_writer=lambda folder, pipe, family_name: calls.append((folder, type(pipe).__name__, family_name))
    )
    lora_dir = tmp_path.resolve() / "models" / "Lora"
    assert calls == [(lora_dir, fam.plain_pipeline_class.__name__, name) for name, fam in FAMILIES.items()]


def test_cli_writes_into_the_given_folder(tmp_path, monkeypatch, capsys):
    """`python -m app.demo DIR` passes DIR (the demo LoRA writer, the inpainting checkpoint) to write_demo and
    prints what it wrote."""
    from app.adapters.synthetic import write_demo_loras

    seen = []

    def fake_write_demo(path, lora_writer=None, inpainting=False):
        seen.append((path, lora_writer, inpainting))
        return {"sd15_file": path / "x"}

    monkeypatch.setattr(demo, "write_demo", fake_write_demo)
    monkeypatch.setattr("sys.argv", ["app.demo", str(tmp_path)])
    demo.main()
    assert seen == [(tmp_path, write_demo_loras, True)]  # the command line writes the inpainting checkpoint too
    assert str(tmp_path / "x") in capsys.readouterr().out
