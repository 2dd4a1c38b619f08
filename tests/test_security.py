"""Safe to share (issue 14), the file and request side: what a hostile or broken file or request
can no longer do. Each test names the finding it protects against.

- LoRA files are cached within a byte budget, and a refused file can be dropped at once (finding 2).
- A checkpoint's config (embedded or bundled) must match the tensor shapes in its header before
  anything is built (finding 3).
- Files whose names are not valid UTF-8 are skipped with a logged reason (finding 4).
- Prompts and per-request work are capped (finding 5).
- LoRAs and embeddings with NaN/Inf or absurd values, and absurd strengths, are refused at read;
  NaN/Inf latents stop sampling with the step named (finding 6).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from app.adapters.errors import AdapterFormatError, LoraApplyError
from app.adapters.files import LoraLibrary
from app.adapters.prompt import parse_prompt_loras
from app.adapters.specs import MAX_STRENGTH, LoraSpec
from app.demo import build_tiny_pipeline
from app.engine import checkpoint_files, embeddings, generate, models
from app.engine.checkpoint_files import ModelLoadError
from app.engine.checkpoint_shapes import expected_shapes
from app.engine.generate import MAX_PIXEL_STEPS, MAX_PROMPT_CHARS, GenerateParams, NonFiniteLatentsError
from app.engine.worker import Engine
from app.families import FAMILIES, family
from app.settings import Settings
from app.ui.common import specs_from_json

SD15 = "tiny-sd15.safetensors"
BAD_NAME = b"caf\xe9-latin1"  # "café" in Latin-1: not valid UTF-8


def _lora_bytes(mib: float, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA-shaped file of about `mib` MiB that matches no layer (what the attacker sent)."""
    side = int((mib * 2**20 / 8) ** 0.5)
    g = torch.Generator().manual_seed(seed)
    return {"lora_unet_nothing_here.lora_down.weight": torch.randn(side, side, generator=g),
            "lora_unet_nothing_here.lora_up.weight": torch.randn(side, side, generator=g)}


# ------------------------------------------------------------------------ 2. LoRA cache in bytes
def test_lora_cache_is_bounded_in_bytes_and_forget_drops_a_file(tmp_path):
    """Three 4 MiB LoRAs read through a 10 MiB cache keep at most 10 MiB resident (the oldest goes
    first), and `forget` drops a file's cached read so a refused LoRA holds no memory."""
    for i in range(3):
        save_file(_lora_bytes(4, i), str(tmp_path / f"big{i}.safetensors"))
    library = LoraLibrary(tmp_path, cache_bytes=10 * 2**20)
    for i in range(3):
        library.open(f"big{i}")
        assert library.cached_bytes <= 10 * 2**20
    assert library.cached_bytes > 4 * 2**20  # the two newest stay: a slider move re-reads nothing
    library.forget("big2")
    library.forget("big1.safetensors")
    assert library.cached_bytes == 0


def test_a_lora_larger_than_the_cache_is_read_but_not_kept(tmp_path):
    """A file bigger than the whole budget is returned to the caller and never cached."""
    save_file(_lora_bytes(4, 0), str(tmp_path / "big.safetensors"))
    library = LoraLibrary(tmp_path, cache_bytes=2**20)
    assert library.open("big").tensors
    assert library.cached_bytes == 0


def test_the_cache_budget_is_a_setting():
    """The budget is a `Settings` field with a default that keeps a few typical LoRAs resident."""
    assert Settings().lora_cache_mib == 1024


def test_a_refused_lora_leaves_nothing_cached(data_dir):
    """A LoRA that matches no layer is refused and its tensors do not stay in the library's cache."""
    save_file(_lora_bytes(4, 0), str(data_dir / "models" / "Lora" / "nomatch.safetensors"))
    engine = Engine(Settings(data_dir=data_dir, device="cpu", lora_cache_mib=64))
    try:
        engine.load_model(SD15)
        with pytest.raises(LoraApplyError, match="matched zero"):
            engine.set_loras([LoraSpec("nomatch")])
        assert engine.library.cached_bytes == 0
    finally:
        engine.close()


# ------------------------------------------------------------------- 3. config against the header
def _rewritten_checkpoint(data_dir: Path, name: str, edit) -> checkpoint_files.CheckpointInfo:
    """The tiny SD1.5 checkpoint saved again with its metadata changed by `edit(metadata)`."""
    source = data_dir / "models" / "Stable-diffusion" / SD15
    with safe_open(str(source), framework="pt") as handle:
        metadata = dict(handle.metadata())
    edit(metadata)
    target = data_dir / "models" / "Stable-diffusion" / name
    save_file(load_file(str(source)), str(target), metadata=metadata)
    return checkpoint_files.resolve_checkpoint(name, data_dir / "models" / "Stable-diffusion")


def _edit_unet_config(**changes):
    def edit(metadata: dict[str, str]) -> None:
        configs = json.loads(metadata[models.CONFIGS_METADATA_KEY])
        configs["unet"].update(changes)
        metadata[models.CONFIGS_METADATA_KEY] = json.dumps(configs)
    return edit


@pytest.fixture
def no_building(monkeypatch):
    """Fail the test if diffusers is asked to build a pipeline from a single file."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("a pipeline was built before the config was checked against the header")
    for cls in (f.pipeline_class for f in FAMILIES.values()):
        if hasattr(cls, "from_single_file"):  # families whose files the engine assembles itself have none
            monkeypatch.setattr(cls, "from_single_file", refuse)


def test_embedded_config_larger_than_the_tensors_is_refused_before_building(data_dir, no_building):
    """A 12 MB file whose embedded config asks for 4096/8192 channels is refused with the tensor,
    its shape in the file and the shape the config asks for; nothing is built."""
    info = _rewritten_checkpoint(data_dir, "huge-config.safetensors", _edit_unet_config(
        block_out_channels=[4096, 8192], norm_num_groups=32))
    with pytest.raises(ModelLoadError, match=r"huge-config\.safetensors: \d+ tensors do not have the shapes "
                r"its embedded config asks for \(model\.diffusion_model\.\S+: the file holds \[.*\], its "
                r"embedded config expects \[.*(4096|8192)"):
        models.load_pipeline(info, torch.float32)


def test_embedded_config_with_endless_layers_is_refused_quickly(data_dir, no_building):
    """`layers_per_block=100000` would take minutes and gigabytes to build even on the meta device:
    building stops once the config needs more parameters than the file has tensors."""
    info = _rewritten_checkpoint(data_dir, "deep-config.safetensors", _edit_unet_config(layers_per_block=100_000))
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"deep-config\.safetensors: the config describes more than \d+ "
                                             r"parameters, more than the file's tensors can fill"):
        models.load_pipeline(info, torch.float32)
    assert time.perf_counter() - t0 < 10


def test_embedded_config_that_cannot_build_is_refused_with_the_reason(data_dir, no_building):
    """A config with a value of the wrong type is a refusal naming the file, not a crash."""
    info = _rewritten_checkpoint(data_dir, "odd-config.safetensors", _edit_unet_config(block_out_channels="wide"))
    with pytest.raises(ModelLoadError, match=r"odd-config\.safetensors: the config does not build a sd15 model"):
        models.load_pipeline(info, torch.float32)


def test_file_that_is_not_sd15_sized_is_refused_against_the_bundled_config(data_dir):
    """Without an embedded config the full-size SD1.5 config applies: a file holding every SD1.5
    tensor name but tiny tensors is refused by shape, naming the tensors. (The bundled config is
    trusted and diffusers builds it on the meta device, so no 860M-parameter UNet is allocated; our
    meta build runs only to explain diffusers' refusal.)"""
    names = expected_shapes("sd15", family("sd15").files.config_dir)
    path = data_dir / "models" / "Stable-diffusion" / "small.safetensors"
    save_file({name: torch.zeros(2) for name in names}, str(path))
    info = checkpoint_files.resolve_checkpoint(path.name, path.parent)
    with pytest.raises(ModelLoadError, match=r"small\.safetensors: \d+ tensors do not have the shapes the "
                                             r"SD15 architecture asks for .*; refused"):
        models.load_pipeline(info, torch.float32)


def test_matching_config_still_loads(data_dir):
    """The check refuses nothing honest: the demo checkpoint loads and every tensor is in place."""
    info = checkpoint_files.resolve_checkpoint(SD15, data_dir / "models" / "Stable-diffusion")
    assert models.load_pipeline(info, torch.float32).family == "sd15"


# ---------------------------------------------------------------------------- 4. non-UTF-8 names
def _bad_file(folder: Path, source: Path) -> None:
    os.link(source, os.path.join(os.fsencode(folder), BAD_NAME + b".safetensors"))


def test_non_utf8_names_are_skipped_with_a_logged_reason(data_dir, caplog):
    """A checkpoint, LoRA or embedding whose name is not UTF-8 is left out of the listings with a
    warning naming it; every other file is still listed and loads."""
    ckpts, loras, embeds = (data_dir / "models" / "Stable-diffusion", data_dir / "models" / "Lora",
                            data_dir / "embeddings")
    _bad_file(ckpts, ckpts / SD15)
    _bad_file(loras, next(loras.glob("*.safetensors")))
    _bad_file(embeds, embeds / "tiny-sd15-embedding.safetensors")
    caplog.set_level(logging.WARNING, logger="app.paths")
    names = [info.name for info in checkpoint_files.discover_checkpoints(ckpts)]
    assert SD15 in names and all(n.isprintable() and n.encode() for n in names)
    lora_names = LoraLibrary(loras).names()
    assert lora_names and all(n.encode() for n in lora_names)
    pipe = models.load_pipeline(checkpoint_files.resolve_checkpoint(SD15, ckpts), torch.float32).pipe
    assert embeddings.load_all(pipe, "sd15", embeds, set()) == ("tiny-sd15-embedding",)
    skipped = [r.getMessage() for r in caplog.records if "not valid UTF-8" in r.getMessage()]
    assert {m.split(" file ")[0] for m in skipped} == {"checkpoint", "LoRA", "embedding"}
    assert all("caf\\udce9-latin1.safetensors" in m for m in skipped)


# ------------------------------------------------------------------------------- 5. request caps
def test_prompt_longer_than_the_cap_is_refused_with_the_limit():
    """A 10 MB prompt (59 s and +1.4 GB before) is refused at once, naming the limit."""
    with pytest.raises(ValueError, match=rf"the prompt is 10,000,000 characters long; the limit is "
                                         rf"{MAX_PROMPT_CHARS:,} characters"):
        GenerateParams("x" * 10_000_000)
    with pytest.raises(ValueError, match="the negative prompt is"):
        GenerateParams("ok", negative_prompt="x" * (MAX_PROMPT_CHARS + 1))
    GenerateParams("x" * MAX_PROMPT_CHARS)


def test_work_per_request_is_capped_with_the_cap_named():
    """16 images of 2048² at 150 steps passed every per-field limit; the product is now capped."""
    with pytest.raises(ValueError, match=rf"batch count x batch x width x height x steps = 1 x 16 x 2048 x 2048 x "
                                         rf"150 = 10,066,329,600 is over the per-request cap of {MAX_PIXEL_STEPS:,}"):
        GenerateParams("a fox", steps=150, width=2048, height=2048, batch=16)
    GenerateParams("a fox", steps=1, width=2048, height=2048, batch=16)  # the GPU OOM test's request


def test_the_batch_count_counts_in_the_cap():
    """`n_iter` (batch count, up to 100) multiplied the capped work by up to 100: 4 x 1024² x 150
    steps fits once, not twice."""
    GenerateParams("a fox", steps=150, width=1024, height=1024, batch=4)
    with pytest.raises(ValueError, match=r"= 2 x 4 x 1024 x 1024 x 150 = 1,258,291,200 is over the per-request cap"):
        GenerateParams("a fox", steps=150, width=1024, height=1024, batch=4, n_iter=2)


# ------------------------------------------------------------------------- 6. absurd values
def test_lora_with_absurd_finite_values_is_refused_at_read(tmp_path):
    """A LoRA x1e30 is finite but fuses to Inf: it is refused at read, naming the tensor and value."""
    tensors = _lora_bytes(0.01, 0)
    tensors["lora_unet_nothing_here.lora_up.weight"] *= 1e30
    save_file(tensors, str(tmp_path / "loud.safetensors"))
    with pytest.raises(AdapterFormatError, match=r"loud\.safetensors: tensor lora_unet_nothing_here\.lora_up\.weight "
                                                 r"holds \d\.\d+e\+30, beyond ±65504"):
        LoraLibrary(tmp_path).open("loud")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_embedding_with_non_finite_or_absurd_values_is_skipped(data_dir, caplog, value):
    """A NaN, Inf or x1e30 embedding is skipped with its reason logged; the vocabulary is unchanged."""
    embeds = data_dir / "embeddings"
    tensors = load_file(str(embeds / "tiny-sd15-embedding.safetensors"))
    tensors["emb_params"][0, 0] = value
    shutil.rmtree(embeds)
    embeds.mkdir()
    save_file(tensors, str(embeds / "poisoned-vector.safetensors"))
    pipe = build_tiny_pipeline("sd15")
    vocabulary = len(pipe.tokenizer)
    caplog.set_level(logging.INFO, logger="app.engine.embeddings")
    assert embeddings.load_all(pipe, "sd15", embeds, set()) == ()
    assert len(pipe.tokenizer) == vocabulary
    assert any("poisoned-vector.safetensors skipped: poisoned-vector.safetensors: tensor emb_params" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("field", ["weight", "unet_weight", "te_weight"])
def test_absurd_strength_is_refused_everywhere_a_spec_is_made(field):
    """-1e30 used to fuse into Inf weights (black images, no error); beyond ±MAX_STRENGTH it is
    refused by the spec, the API's JSON and a prompt tag, with the bound in the message."""
    message = rf"LoRA 'style': {field} -1e\+30 is beyond ±{MAX_STRENGTH:g}, the largest strength accepted"
    with pytest.raises(ValueError, match=message):
        LoraSpec("style", **{field: -1e30})
    with pytest.raises(ValueError, match=message):
        specs_from_json([{"name": "style", field: -1e30}])
    with pytest.raises(ValueError, match=r"beyond ±100"):
        parse_prompt_loras("a fox <lora:style:-1e30>")
    assert LoraSpec("style", **{field: -MAX_STRENGTH})


def test_non_finite_latents_stop_sampling_and_name_the_step():
    """When the UNet starts producing NaN at step 2, sampling stops with `NonFiniteLatentsError`
    naming step 2 (the step after it never runs), instead of decoding a black image."""
    pipe = build_tiny_pipeline("sd15")
    calls = []

    def poison(_module, _args, output):
        calls.append(1)
        return (output[0] * float("nan"), *output[1:]) if len(calls) >= 2 else output

    pipe.unet.register_forward_hook(poison)
    params = GenerateParams("a fox", steps=4, width=64, height=64, sampler="Euler")
    with pytest.raises(NonFiniteLatentsError, match=r"the latents became NaN or Inf at step 2 of 4") as caught:
        generate.run(pipe, params, seed=1)
    assert (caught.value.step, caught.value.total) == (2, 4)
    assert len(calls) <= 3  # stopped one step after the bad one at the latest
