"""FLUX.1's native formats, offline: BFL's transformer file with separate parts gives the diffusers
folder's bits, half and fp8 T5 files load, a missing or ambiguous part is named, its samplers and
sequence lengths, and the full-size bundled configs describe the published models. What every
family must do (layouts, seeds, LoRAs, offload, fp8, stages) is the conformance suite's (tests/families/)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from app.engine import checkpoint_files, models, part_choices
from app.engine.checkpoint_files import ModelLoadError
from app.engine.checkpoint_shapes import CheckpointShapeError
from app.engine.component_files import CONFIGS_METADATA_KEY
from app.engine.generate import GenerateParams
from app.engine.part_choices import PartFiles
from app.engine.worker import Engine
from app.families import ASSETS_DIR, family
from app.settings import Settings

DEV, SCHNELL = "flux-dev", "flux-schnell"
FAST_FLUX = dict(steps=2, width=64, height=64, cfg=3.5, sampler="Euler")


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def split_all_in_one(all_in_one: Path, data: Path, t5_dtype: torch.dtype = torch.float32) -> Path:
    """What a Forge/ComfyUI user has: BFL's bare transformer file in the checkpoint folder,
    `clip_l.safetensors` and a T5 file in models/text_encoder, `ae.safetensors` in models/VAE (each
    carrying its tiny config, as real ones get the bundled full-size one). Returns the transformer."""
    tensors, metadata = _read(all_in_one)
    configs = json.loads(metadata[CONFIGS_METADATA_KEY])
    settings = Settings(data_dir=data)
    pieces = {
        settings.checkpoints_dir / "flux1-tiny.safetensors": ("model.diffusion_model.", "transformer", None),
        settings.text_encoder_dir / "clip_l.safetensors": ("text_encoders.clip_l.transformer.", "text_encoder", None),
        settings.text_encoder_dir / "t5xxl.safetensors": ("text_encoders.t5xxl.transformer.", "text_encoder_2",
                                                          t5_dtype),
        settings.vae_dir / "ae.safetensors": ("vae.", "vae", None),
    }
    for path, (prefix, component, dtype) in pieces.items():
        part = {k.removeprefix(prefix): v if dtype is None else v.to(dtype) for k, v in tensors.items()
                if k.startswith(prefix)}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(part, str(path), metadata={CONFIGS_METADATA_KEY: json.dumps({component: configs[component]})})
    return settings.checkpoints_dir / "flux1-tiny.safetensors"


def _load(path: Path, dtype=torch.float32, parts: PartFiles | None = None):
    kind = "folder" if path.is_dir() else "file"
    return models.load_pipeline(checkpoint_files.CheckpointInfo(path.name, path, kind, 0), dtype, parts).pipe


def assert_same_weights(a, b) -> None:
    for component in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        mine, theirs = getattr(a, component).state_dict(), getattr(b, component).state_dict()
        assert mine.keys() == theirs.keys(), component
        for key in mine:
            assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), f"{component}.{key}"


@pytest.fixture(scope="module")
def folder_pipe(demo_paths):
    return _load(demo_paths[f"{DEV}_folder"])


def test_bfl_transformer_with_separate_parts_equals_folder(demo_paths, folder_pipe, tmp_path):
    """BFL's bare `double_blocks.*` file plus models/text_encoder (CLIP-L, T5) and models/VAE."""
    transformer = split_all_in_one(demo_paths[f"{DEV}_file"], tmp_path)
    settings = Settings(data_dir=tmp_path)
    pipe = _load(transformer, parts=part_choices.part_files(settings, transformer.name))
    assert_same_weights(pipe, folder_pipe)
    assert pipe.text_encoder_2.encoder.embed_tokens.weight is pipe.text_encoder_2.shared.weight  # tied, as loaded


@pytest.mark.parametrize("t5_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_half_and_fp8_t5_files_load_as_their_values(demo_paths, tmp_path, t5_dtype):
    """A bf16 or fp8 T5 file loads as exactly its stored values, widened to the load dtype; the other
    parts equal the folder's load in that dtype."""
    transformer = split_all_in_one(demo_paths[f"{DEV}_file"], tmp_path, t5_dtype)
    parts = part_choices.part_files(Settings(data_dir=tmp_path), transformer.name)
    dtype = torch.bfloat16
    pipe, folder = _load(transformer, dtype, parts), _load(demo_paths[f"{DEV}_folder"], torch.float32)
    for key, value in folder.text_encoder_2.state_dict().items():
        want = value.to(t5_dtype).to(dtype)  # what was stored, widened
        assert torch.equal(pipe.text_encoder_2.state_dict()[key], want), key
    assert torch.equal(pipe.transformer.x_embedder.weight, folder.transformer.x_embedder.weight.to(dtype))


def test_missing_or_ambiguous_part_is_named(demo_paths, tmp_path):
    transformer = split_all_in_one(demo_paths[f"{DEV}_file"], tmp_path)
    settings = Settings(data_dir=tmp_path)
    t5 = settings.text_encoder_dir / "t5xxl.safetensors"
    shutil.move(t5, tmp_path / "t5-elsewhere.safetensors")
    with pytest.raises(ModelLoadError, match=r"no T5-XXL text encoder .* none was found in .*text_encoder"):
        _load(transformer, parts=part_choices.part_files(settings, transformer.name))
    for name in ("t5xxl_fp16.safetensors", "t5xxl_other.safetensors"):
        os.link(tmp_path / "t5-elsewhere.safetensors", settings.text_encoder_dir / name)
    with pytest.raises(ModelLoadError, match=r"several files hold one \(t5xxl_fp16.safetensors, t5xxl_other"):
        _load(transformer, parts=part_choices.part_files(settings, transformer.name))
    part_choices.choose(settings, DEV, transformer.name, {"text_encoder_2": "t5xxl_other.safetensors"})
    assert _load(transformer, parts=part_choices.part_files(settings, transformer.name)) is not None
    with pytest.raises(ValueError, match="no file 'nope.safetensors'"):
        part_choices.choose(settings, DEV, transformer.name, {"vae": "nope.safetensors"})
    with pytest.raises(ModelLoadError, match=r"clip_l.safetensors holds no T5-XXL"):
        part_choices.choose(settings, DEV, transformer.name, {"text_encoder_2": "clip_l.safetensors"})
        _load(transformer, parts=part_choices.part_files(settings, transformer.name))


def test_wrong_shapes_are_refused_before_building(demo_paths, tmp_path):
    """A VAE of another family (SD's 4 latent channels) in models/VAE is refused by name."""
    transformer = split_all_in_one(demo_paths[f"{DEV}_file"], tmp_path)
    settings = Settings(data_dir=tmp_path)
    vae, metadata = _read(settings.vae_dir / "ae.safetensors")
    vae["decoder.conv_in.weight"] = vae["decoder.conv_in.weight"][:, :4].contiguous()
    save_file(vae, str(settings.vae_dir / "ae.safetensors"), metadata=metadata)
    with pytest.raises(ModelLoadError, match=r"VAE .* \(decoder.conv_in.weight: \[32, 4, 3, 3\], expected "
                                              r"\[32, 16, 3, 3\]"):
        _load(transformer, parts=part_choices.part_files(settings, transformer.name))
    assert issubclass(CheckpointShapeError, ValueError)


def test_bundled_configs_describe_the_published_models():
    """Parameter counts of the full-size architecture, built on the meta device (no memory)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    counts = {}
    with torch.device("meta"):
        for name in (DEV, SCHNELL):
            folder = family(name).files.config_dir
            config = FluxTransformer2DModel.load_config(folder / "transformer")
            counts[name] = FluxTransformer2DModel.from_config(config)
        folder = family(DEV).files.config_dir
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae"))
        clip = CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder"))
        t5 = T5EncoderModel(T5Config.from_pretrained(folder / "text_encoder_2"))

    def millions(m):
        return round(sum(p.numel() for p in m.parameters()) / 1e6, 2)
    assert millions(counts[DEV]) == 11901.41 and millions(counts[SCHNELL]) == 11891.18  # no guidance embedder
    assert (millions(vae), millions(clip), millions(t5)) == (83.82, 123.06, 4762.31)


def test_t5_tokenizer_is_the_extracted_one():
    """assets/t5_tokenizer holds exactly what ORIGIN.txt records, and tokenizes as T5 v1.1 does."""
    folder = ASSETS_DIR / "t5_tokenizer"
    recorded = dict(line.split() for line in (folder / "ORIGIN.txt").read_text().splitlines() if line.startswith("  "))
    for name, digest in recorded.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    tokenizer = family(DEV).tokenizers()["tokenizer_2"]
    assert tokenizer("a photo of a cat").input_ids == [3, 9, 1202, 13, 3, 9, 1712, 1]
    assert len(tokenizer) == 32100


def test_flux_samplers_sizes_and_sequence_length(module_engine):
    module_engine.load_model(f"tiny-{SCHNELL}.safetensors")
    fam = family(SCHNELL)
    assert (fam.sampling.default_steps, fam.sampling.max_sequence_length,
            family(DEV).sampling.max_sequence_length) == (4, 256, 512)
    assert fam.call_arguments(3.5) == {"guidance_scale": 3.5, "max_sequence_length": 256}
    for sampler in fam.sampling.samplers:
        images = module_engine.generate(GenerateParams("a cat", seed=1, **{**FAST_FLUX, "sampler": sampler}))
        assert images[0].image.size == (64, 64) and f"Sampler: {sampler}" in images[0].infotext
    with pytest.raises(ValueError, match="multiples of 16"):
        module_engine.generate(GenerateParams("a cat", seed=1, **{**FAST_FLUX, "width": 72}))
    with pytest.raises(ValueError, match="has no sampler 'DDIM'"):
        module_engine.generate(GenerateParams("a cat", seed=1, **{**FAST_FLUX, "sampler": "DDIM"}))


def test_fp16_is_refused_for_flux_with_the_reason(demo_paths):
    """Flux's activations overflow fp16: a load in fp16 (a GPU's request) is refused naming why and
    what to use, before anything is built."""
    info = checkpoint_files.resolve_checkpoint(f"tiny-{DEV}.safetensors", demo_paths["checkpoints_dir"])
    with pytest.raises(ModelLoadError, match=r"overflows in fp16 .*use bf16"):
        models.load_pipeline(info, torch.float16)


def test_choosing_model_parts_through_the_engine_reloads_and_a_bad_choice_is_undone(demo_paths, tmp_path):
    """`Engine.set_model_parts` on a loaded BFL transformer: choosing the bf16 T5 of two reloads with
    it (remembered for that checkpoint), and a choice that cannot load (CLIP-L as T5) fails the
    command, keeps the model as it was and forgets that choice."""
    transformer = split_all_in_one(demo_paths[f"{DEV}_file"], tmp_path)
    settings = Settings(data_dir=tmp_path, device="cpu")
    t5 = settings.text_encoder_dir / "t5xxl.safetensors"
    tensors, metadata = _read(t5)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(t5.with_name("t5xxl_bf16.safetensors")),
              metadata=metadata)
    engine = Engine(settings)
    try:
        part_choices.choose(settings, DEV, transformer.name, {"text_encoder_2": "t5xxl.safetensors"})
        engine.load_model(transformer.name)
        snap = engine.set_model_parts({"text_encoder_2": "t5xxl_bf16.safetensors"})
        assert snap.history[-1].outcome == "ok" and snap.history[-1].command == "set_model_parts"
        weight = engine.pipeline.text_encoder_2.shared.weight
        assert torch.equal(weight, next(v for k, v in tensors.items() if k.endswith("shared.weight")).to(
            torch.bfloat16).float())
        assert part_choices.chosen(settings, transformer.name) == {"text_encoder_2": "t5xxl_bf16.safetensors"}
        with pytest.raises(ModelLoadError, match="holds no T5-XXL"):
            engine.set_model_parts({"text_encoder_2": "clip_l.safetensors"})
        assert engine.pipeline.text_encoder_2.shared.weight is weight
        assert part_choices.chosen(settings, transformer.name) == {"text_encoder_2": "t5xxl_bf16.safetensors"}
        assert part_choices.available(settings, DEV)["text_encoder_2"] == ["clip_l.safetensors", "t5xxl.safetensors",
                                                                            "t5xxl_bf16.safetensors"]
    finally:
        engine.close()
