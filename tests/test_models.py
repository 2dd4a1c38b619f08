"""Checkpoint discovery, validation and offline loading; bundled configs and tokenizer; LDM naming."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers.loaders import single_file_utils as sfu
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from app.demo import build_tiny_pipeline, write_single_file
from app.engine import checkpoint_files, models
from app.engine.checkpoint_files import (
    CheckpointNotFoundError,
    ModelLoadError,
    UnknownFamilyError,
    UnsafeCheckpointPathError,
    UnsupportedCheckpointFormatError,
)
from app.engine.checkpoint_shapes import meta_components
from app.families import family
from app.families.ldm_layout import ldm_plan, to_ldm_state_dict, unet_module_to_ldm

CONFIGS = {family_name: family(family_name).files.config_dir for family_name in ('sd15', 'sdxl')}


@pytest.fixture(scope="module")
def meta_pipes() -> dict[str, SimpleNamespace]:
    """Full-size components on the meta device: real names and shapes, no memory."""
    return {family_name: meta_components(family_name, CONFIGS[family_name]) for family_name in ("sd15", "sdxl")}


def _millions(module: torch.nn.Module) -> float:
    return round(sum(p.numel() for p in module.parameters()) / 1e6, 2)


# ------------------------------------------------------------------------ bundled configs, tokenizer


@pytest.mark.parametrize(
    "family_name, component, expected",
    [
        ("sd15", "unet", 859.52),
        ("sd15", "vae", 83.65),
        ("sd15", "text_encoder", 123.06),
        ("sdxl", "unet", 2567.46),
        ("sdxl", "vae", 83.65),
        ("sdxl", "text_encoder", 123.06),
        ("sdxl", "text_encoder_2", 694.66),
    ],
)
def test_bundled_configs_describe_the_published_models(meta_pipes, family_name, component, expected):
    """The offline configs rebuild the real SD1.5 / SDXL base architectures, parameter for parameter."""
    assert _millions(getattr(meta_pipes[family_name], component)) == expected


def test_sdxl_vae_config_upcasts_and_uses_its_own_scaling_factor(meta_pipes):
    """SDXL's VAE overflows in fp16, so the config must ask for fp32 decoding and scale latents by 0.13025."""
    assert meta_pipes["sdxl"].vae.config.force_upcast is True
    assert meta_pipes["sdxl"].vae.config.scaling_factor == 0.13025
    assert meta_pipes["sd15"].vae.config.scaling_factor == 0.18215


def test_bundled_tokenizer_encodes_like_openai_clip():
    """The tokenizer rebuilt from OpenCLIP's BPE list gives CLIP's ids; SDXL's second one pads with "!"."""
    tokenizers = family("sdxl").tokenizers()
    first, second = tokenizers["tokenizer"], tokenizers["tokenizer_2"]
    assert first("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert len(first) == 49408 and first.model_max_length == 77
    assert first.pad_token == "<|endoftext|>" and second.pad_token == "!"
    assert second("a cat", padding="max_length", max_length=6).input_ids == [49406, 320, 2368, 49407, 0, 0]


# ----------------------------------------------------------------------------------------- LDM names


@pytest.mark.parametrize(
    "path, lpb, expected",
    [
        (
            "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
            2,
            "input_blocks.4.1.transformer_blocks.0.attn1.to_q",
        ),
        ("mid_block.resnets.0.conv1", 2, "middle_block.0.in_layers.2"),
        ("mid_block.attentions.0.proj_in", 2, "middle_block.1.proj_in"),
        ("mid_block.resnets.1.time_emb_proj", 2, "middle_block.2.emb_layers.1"),
        ("up_blocks.2.resnets.1.conv_shortcut", 2, "output_blocks.7.0.skip_connection"),
        ("time_embedding.linear_1", 2, "time_embed.0"),
        ("time_embedding.linear_2.weight", 2, "time_embed.2.weight"),
        ("add_embedding.linear_1", 2, "label_emb.0.0"),
        ("conv_in", 2, "input_blocks.0.0"),
        ("conv_norm_out", 2, "out.0"),
        ("conv_out.bias", 2, "out.2.bias"),
        ("down_blocks.0.resnets.1.norm2", 2, "input_blocks.2.0.out_layers.0"),
        ("down_blocks.0.downsamplers.0.conv", 2, "input_blocks.3.0.op"),
        ("down_blocks.2.downsamplers.0.conv.bias", 2, "input_blocks.9.0.op.bias"),
        ("up_blocks.3.attentions.2.proj_out", 2, "output_blocks.11.1.proj_out"),
        ("down_blocks.1.resnets.0.conv2", 1, "input_blocks.3.0.out_layers.3"),
        ("down_blocks.0.downsamplers.0.conv", 1, "input_blocks.2.0.op"),
        ("up_blocks.1.attentions.1.norm", 1, "output_blocks.3.1.norm"),
        ("down_blocks.1", 2, None),
        ("down_blocks.1.resnets", 2, None),
        ("down_blocks.1.resnets.0.nonlinearity", 2, None),
        ("time_proj", 2, None),
    ],
)
def test_unet_module_names_follow_the_ldm_block_numbering(path, lpb, expected):
    """Adapter key tables rely on this exact diffusers -> LDM mapping, for any layers_per_block."""
    assert unet_module_to_ldm(path, lpb, attention_up_blocks={1, 2}) == expected


def test_upsampler_slot_depends_on_whether_the_up_block_has_attention():
    """LDM puts the upsampler after the attention (`.2`) or, in a plain up block, after the resnet (`.1`)."""
    path = "up_blocks.0.upsamplers.0.conv"
    assert unet_module_to_ldm(path, 2, attention_up_blocks={1, 2}) == "output_blocks.2.1.conv"  # SD1.5
    assert unet_module_to_ldm(path, 2, attention_up_blocks={0, 1}) == "output_blocks.2.2.conv"  # SDXL
    with pytest.raises(ValueError, match="attention_up_blocks"):
        unet_module_to_ldm(path, 2)


def test_unet_module_names_refuse_an_index_beyond_layers_per_block():
    """A wrong layers_per_block would silently shift every name; an impossible index says so instead."""
    with pytest.raises(ValueError, match="layers_per_block=1"):
        unet_module_to_ldm("down_blocks.0.resnets.1.conv1", 1)
    with pytest.raises(ValueError, match="block index"):
        unet_module_to_ldm("down_blocks.x.resnets.0", 2)


@pytest.mark.parametrize("family_name", ["sd15", "sdxl"])
def test_full_size_ldm_layout_is_what_diffusers_single_file_loader_expects(meta_pipes, family_name):
    """Our LDM writer and diffusers' LDM reader are inverses on the real architectures: every tensor
    comes back under its own name and shape (checked on the meta device, so it costs nothing)."""
    pipe = meta_pipes[family_name]
    ldm = to_ldm_state_dict(pipe, family(family_name))
    converted = {
        "unet": sfu.convert_ldm_unet_checkpoint(ldm, dict(pipe.unet.config)),
        "vae": sfu.convert_ldm_vae_checkpoint(dict(ldm), dict(pipe.vae.config)),
        "text_encoder": {
            k.removeprefix("text_model."): v for k, v in sfu.convert_ldm_clip_checkpoint(ldm).items()
        },
    }
    if family_name == "sdxl":
        prefix = family("sdxl").text_encoder("text_encoder_2").single_file_prefix
        converted["text_encoder_2"] = sfu.convert_open_clip_checkpoint(
            pipe.text_encoder_2, ldm, prefix=prefix
        )
    for component, tensors in converted.items():
        expected = getattr(pipe, component).state_dict()
        assert {k: tuple(v.shape) for k, v in tensors.items()} == {
            k: tuple(v.shape) for k, v in expected.items()
        }


def test_open_clip_layout_fuses_qkv_and_transposes_the_projection():
    """SDXL's second encoder is stored as OpenCLIP does: one in_proj (q, k, v), text_projection as x @ P."""
    pipe = build_tiny_pipeline("sdxl")
    ldm = to_ldm_state_dict(pipe, family("sdxl"))
    encoder = pipe.text_encoder_2.state_dict()
    prefix = family("sdxl").text_encoder("text_encoder_2").single_file_prefix
    layer = "text_model.encoder.layers.1.self_attn."
    fused = torch.cat([encoder[f"{layer}{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(ldm[prefix + "transformer.resblocks.1.attn.in_proj_weight"], fused)
    assert torch.equal(ldm[prefix + "text_projection"], encoder["text_projection.weight"].T)
    assert ldm["first_stage_model.decoder.mid.attn_1.q.weight"].ndim == 4


# ------------------------------------------------------------------------------------------- family


@pytest.mark.parametrize("family_name", ["sd15", "sdxl"])
def test_detect_family_on_full_size_key_sets(meta_pipes, family_name):
    """The key set of a real checkpoint (as our LDM plan names it) is recognised as its family."""
    keys = {entry.key for entry in ldm_plan(meta_pipes[family_name], family(family_name))}
    assert checkpoint_files.detect_family(keys) == family_name


@pytest.mark.parametrize(
    "keys, found",
    [
        (["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", "lora_te_x.alpha"], "LoRA"),
        (["unet.down_blocks.0.attentions.0.proj_in.lora_A.weight"], "LoRA"),
        (["emb_params"], "textual-inversion"),
        (["clip_g", "clip_l"], "textual-inversion"),
        (
            [
                "model.diffusion_model.input_blocks.0.0.weight",
                "cond_stage_model.model.token_embedding.weight",
            ],
            "SD2",
        ),
        (["model.diffusion_model.joint_blocks.0.context_block.attn.qkv.weight"], "SD3"),
        (["double_blocks.0.img_attn.norm.key_norm.scale"], "Flux"),
        (["conditioner.embedders.0.model.transformer.resblocks.0.ln_1.weight"], "refiner"),
        (["model.diffusion_model.input_blocks.0.0.weight"], "UNet without its text encoder"),
        (["down_blocks.0.resnets.0.conv1.weight"], "diffusers component"),
        (["encoder.down.0.block.0.conv1.weight", "decoder.conv_in.weight"], "standalone VAE"),
    ],
)
def test_detect_family_says_what_a_foreign_file_looks_like(keys, found):
    """A file in the checkpoint folder that is not SD1.5/SDXL is named for what it is, with an example key."""
    with pytest.raises(UnknownFamilyError, match=found) as caught:
        checkpoint_files.detect_family(keys)
    assert keys[0] in str(caught.value) or keys[-1] in str(caught.value)


def test_detect_family_lists_key_count_and_samples_when_unrecognised():
    """An unknown layout is described by its size and a few keys, so a bug report shows what it was."""
    with pytest.raises(UnknownFamilyError, match=r"3 tensors \(e.g. alpha, beta, gamma\)"):
        checkpoint_files.detect_family(["gamma", "alpha", "beta"])


# ------------------------------------------------------------------------------- discover / resolve


def _safetensors(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"x": torch.zeros(2)}, str(path))
    return path


def test_discover_lists_files_and_diffusers_folders_sorted(tmp_path):
    """The model list shows safetensors files and diffusers folders (one level deep), nothing else."""
    _safetensors(tmp_path / "b.safetensors")
    _safetensors(tmp_path / "Sub" / "a.safetensors")
    (tmp_path / "pipe" / "unet").mkdir(parents=True)
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    _safetensors(tmp_path / "pipe" / "unet" / "diffusion_pytorch_model.safetensors")
    (tmp_path / "old.ckpt").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    found = checkpoint_files.discover_checkpoints(tmp_path)
    assert [(c.name, c.kind) for c in found] == [
        ("b.safetensors", "file"),
        ("pipe", "folder"),
        ("Sub/a.safetensors", "file"),
    ]
    assert found[1].size_bytes > 0
    assert checkpoint_files.discover_checkpoints(tmp_path / "missing") == []


def test_resolve_accepts_listed_names_and_bare_stems(tmp_path):
    """Users may pass the listed name or the name without suffix; absolute paths are refused even
    inside the folder, because names arrive from the API and must not reveal the file system."""
    target = _safetensors(tmp_path / "sub" / "m.safetensors")
    for spelling in ("sub/m.safetensors", "sub/m"):
        info = checkpoint_files.resolve_checkpoint(spelling, tmp_path)
        assert (info.name, info.kind, info.path) == ("sub/m.safetensors", "file", target)
    with pytest.raises(UnsafeCheckpointPathError, match="absolute paths"):
        checkpoint_files.resolve_checkpoint(str(target), tmp_path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd"])
def test_resolve_refuses_paths_leading_out_of_the_checkpoint_folder(tmp_path, name):
    """Checkpoint names come from the UI/API; none may reach files outside the checkpoint folder."""
    root = tmp_path / "root"
    root.mkdir()
    _safetensors(tmp_path / "outside.safetensors")
    with pytest.raises(UnsafeCheckpointPathError):
        checkpoint_files.resolve_checkpoint(name, root)


def test_resolve_follows_a_symlink_the_user_placed_in_the_folder(tmp_path):
    """A user's symlink inside the models folder (models on another drive) is listed and loads; the
    untrusted part is the name, which cannot contain `..` or be absolute."""
    root = tmp_path / "root"
    root.mkdir()
    target = _safetensors(tmp_path / "elsewhere" / "outside.safetensors")
    (root / "link.safetensors").symlink_to(target)
    assert checkpoint_files.resolve_checkpoint("link.safetensors", root).path.resolve() == target.resolve()
    assert [info.name for info in checkpoint_files.discover_checkpoints(root)] == ["link.safetensors"]


class _Boom:
    """Unpickling this would create a marker file: proof that a pickle was (not) loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin", ".pth"])
def test_resolve_refuses_pickle_formats_without_opening_them(tmp_path, suffix):
    """Pickle checkpoints can run code when loaded; they are refused by name, never unpickled."""
    marker = tmp_path / "pwned"
    (tmp_path / f"evil{suffix}").write_bytes(pickle.dumps(_Boom(marker)))
    with pytest.raises(UnsupportedCheckpointFormatError, match="safetensors"):
        checkpoint_files.resolve_checkpoint(f"evil{suffix}", tmp_path)
    assert not marker.exists()


def test_resolve_reports_missing_checkpoint_with_what_is_available(tmp_path):
    """A typo gets a 'not found' error that lists the names that do exist."""
    _safetensors(tmp_path / "real.safetensors")
    with pytest.raises(CheckpointNotFoundError, match=r"'nope.safetensors' not found.*real.safetensors"):
        checkpoint_files.resolve_checkpoint("nope.safetensors", tmp_path)


# ------------------------------------------------------------------------------------ broken files


def _torch_pickle(path: Path) -> None:
    torch.save({"state_dict": {"w": torch.zeros(2)}}, path)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: p.write_bytes(b"\x10\x00"), "not a valid safetensors"),
        (_torch_pickle, "pickled PyTorch checkpoint"),
    ],
    ids=["zero-byte", "short-header", "renamed-pickle"],
)
def test_invalid_safetensors_fail_with_file_and_reason(tmp_path, make, reason):
    """Broken files are caught by the header check, before diffusers (or pickle) ever sees them."""
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(ModelLoadError, match=f"bad.safetensors.*{reason}"):
        models.load_pipeline(checkpoint_files.resolve_checkpoint("bad.safetensors", tmp_path), torch.float32)


def test_truncated_checkpoint_fails_with_file_and_reason(tmp_path, demo_paths):
    """A half-downloaded checkpoint is reported as truncated, naming the file."""
    data = demo_paths["sd15_file"].read_bytes()
    (tmp_path / "half.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="half.safetensors.*truncated"):
        models.load_pipeline(checkpoint_files.resolve_checkpoint("half.safetensors", tmp_path), torch.float32)


def test_lora_in_checkpoint_folder_is_named_as_such(tmp_path):
    """Loading a LoRA as a checkpoint explains what the file is instead of failing inside diffusers."""
    save_file({"lora_unet_conv_in.lora_down.weight": torch.zeros(1, 4)}, str(tmp_path / "style.safetensors"))
    with pytest.raises(UnknownFamilyError, match="style.safetensors.*LoRA"):
        models.load_pipeline(checkpoint_files.resolve_checkpoint("style.safetensors", tmp_path), torch.float32)


def test_single_file_missing_a_tensor_is_refused(tmp_path):
    """diffusers keeps random weights for tensors absent from a single file; we refuse such a file."""
    pipe = build_tiny_pipeline("sd15")
    write_single_file(pipe, "sd15", tmp_path / "full.safetensors")
    with safe_open(str(tmp_path / "full.safetensors"), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(tmp_path / "full.safetensors"))
    del tensors["first_stage_model.decoder.mid.attn_1.q.weight"]
    save_file(tensors, str(tmp_path / "pruned.safetensors"), metadata=metadata)
    with pytest.raises(ModelLoadError, match="pruned.safetensors: 1 tensors.*attn_1.q.weight"):
        models.load_pipeline(checkpoint_files.resolve_checkpoint("pruned.safetensors", tmp_path), torch.float32)


def test_embedded_config_metadata_must_be_valid(tmp_path):
    """Corrupt embedded configs are a load error naming the metadata key, not a crash in diffusers."""
    pipe = build_tiny_pipeline("sd15")
    save_file(
        to_ldm_state_dict(pipe, family("sd15")),
        str(tmp_path / "odd.safetensors"),
        metadata={models.CONFIGS_METADATA_KEY: json.dumps({"safety_checker": {}})},
    )
    with pytest.raises(ModelLoadError, match="odd.safetensors.*steady_diffusion.configs"):
        models.load_pipeline(checkpoint_files.resolve_checkpoint("odd.safetensors", tmp_path), torch.float32)


def test_diffusers_folder_with_pickle_weights_is_refused(tmp_path, demo_paths):
    """A diffusers folder whose UNet has only `.bin` weights is refused instead of being unpickled."""
    folder = tmp_path / "pickled"
    shutil.copytree(demo_paths["sd15_folder"], folder)
    weights = folder / "text_encoder" / "model.safetensors"
    weights.rename(weights.with_name("pytorch_model.bin"))
    with pytest.raises(UnsupportedCheckpointFormatError, match="pickled/text_encoder: no .safetensors"):
        models.load_pipeline(checkpoint_files.resolve_checkpoint("pickled", tmp_path), torch.float32)


# ------------------------------------------------------------------------------------------ loading


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_bf16_load_gives_bf16_weights_on_cpu(demo_paths, kind):
    """The requested dtype reaches every floating tensor of every component at load time."""
    path = demo_paths[f"sdxl_{kind}"]
    loaded = models.load_pipeline(
        checkpoint_files.resolve_checkpoint(path.name, demo_paths["checkpoints_dir"]), torch.bfloat16
    )
    for name, module in loaded.pipe.components.items():
        if isinstance(module, torch.nn.Module):
            for key, tensor in _tensors(module).items():
                assert tensor.device.type == "cpu", f"{name}.{key}"
                assert not tensor.is_floating_point() or tensor.dtype == torch.bfloat16, f"{name}.{key}"


def test_folder_of_another_pipeline_class_is_named(tmp_path):
    """A diffusers folder for an unsupported pipeline says which class it is, before loading weights."""
    folder = tmp_path / "flux"
    _safetensors(folder / "unet" / "diffusion_pytorch_model.safetensors")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(UnknownFamilyError, match="flux: model_index.json names 'FluxPipeline'"):
        models.load_pipeline(checkpoint_files.resolve_checkpoint("flux", tmp_path), torch.float32)


def test_load_refuses_a_pipeline_that_breaks_the_cpu_dtype_contract(demo_paths, monkeypatch):
    """If a diffusers/accelerate change ever left a stray tensor in another dtype (or device, or a hook),
    the load fails naming it instead of handing placement a mixed pipeline."""
    stray = build_tiny_pipeline("sd15")
    stray.unet.conv_in.bias.data = stray.unet.conv_in.bias.data.double()
    monkeypatch.setattr(models, "_load_folder", lambda info, family_name, dtype: stray)
    info = checkpoint_files.resolve_checkpoint("tiny-sd15-diffusers", demo_paths["checkpoints_dir"])
    with pytest.raises(ModelLoadError, match=r"unet.conv_in.bias on cpu in torch.float64"):
        models.load_pipeline(info, torch.float32)
