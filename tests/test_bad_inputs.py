"""Bad inputs through the public engine API: each is refused with a message that says what is wrong
(and names the file, tensor, key or LoRA), and the engine stays exactly as it was — READY, same
model, same LoRAs applied, every weight bit-identical, every tensor where the plan says.

Kinds covered, for LoRA files and for checkpoints where the kind applies: truncated file,
zero-byte file, pickle renamed `.safetensors` (zip and legacy), JSON header lying about shapes
or offsets, oversized header, invalid header JSON, a file with no tensors, NaN/Inf tensors, an
adapter for the other architecture, keys matching nothing, up/down rank mismatch, unknown
algorithm keys, a non-scalar alpha, a duplicate LoRA in the list, strengths outside the slider
range (accepted when finite) and NaN/Inf strengths (refused) through the API and prompt tags,
path traversal / absolute paths / NUL bytes / symlinks out of the folder, a checkpoint that is
neither SD1.5 nor SDXL (random tensors, a LoRA, a UNet alone), pickle suffixes, a diffusers
folder with only `.bin` weights, and files removed between listing and loading.

Rank above min(in, out) is *not* an error: ΔW = s·up·down is well defined for any rank (the
factorisation is merely over-parameterised), so such a LoRA is applied and gives exactly the
same ΔW a full-rank delta would; the test checks the fused weight against that formula.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiny
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from weight_digest import weights_digest

from app.adapters.errors import AdapterError, AdapterFormatError, LoraApplyError
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import write_adapter
from app.demo import build_tiny_pipeline
from app.engine import offload, placement
from app.engine.checkpoint_files import (
    CheckpointNotFoundError,
    ModelLoadError,
    UnknownFamilyError,
    UnsafeCheckpointPathError,
    UnsupportedCheckpointFormatError,
    discover_checkpoints,
    resolve_checkpoint,
)
from app.engine.file_scans import not_finite_refusal
from app.engine.generate import GenerateParams
from app.engine.models import load_pipeline
from app.engine.worker import Engine, EngineState
from app.families import FAMILIES
from app.paths import UnsafePathError
from app.safetensors_files import scan_file
from app.settings import Settings

FAST = dict(tiny.FAST, seed=3)
SD15 = "tiny-sd15.safetensors"
GOOD = LoraSpec("sd15-good", 0.8)
# One real linear layer of the tiny SD1.5 UNet, and its kohya key.
LAYER = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
KEY = "lora_unet_" + LAYER.replace(".", "_")


@dataclass
class Env:
    data: Path
    engine: Engine

    @property
    def lora_dir(self) -> Path:
        return self.engine.settings.lora_dir

    @property
    def ckpt_dir(self) -> Path:
        return self.engine.settings.checkpoints_dir


@dataclass(frozen=True)
class Baseline:
    digest: str
    model: str
    loras: tuple[LoraSpec, ...]
    history_len: int


@pytest.fixture(scope="module")
def env(demo_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("bad_inputs")
    for sub in ("models/Stable-diffusion", "embeddings"):
        shutil.copytree(demo_dir / sub, data / sub, copy_function=os.link)
    for family_name in ("sd15", "sdxl"):
        write_adapter(data / "models" / "Lora" / f"{family_name}-good.safetensors", build_tiny_pipeline(family_name),
                      family_name, "lora", "kohya", alpha=4.0)
    engine = Engine(Settings(data_dir=data, device="cpu"))
    yield Env(data, engine)
    engine.close()


@pytest.fixture
def ready(env) -> Baseline:
    """The engine READY on tiny SD1.5 (fp32) with `sd15-good` applied at 0.8."""
    eng = env.engine
    snap = eng.snapshot()
    if snap.model != SD15 or snap.state != EngineState.READY.value or snap.dtype != "fp32":
        eng.load_model(SD15, dtype="fp32")
    eng.set_loras([GOOD])
    snap = eng.snapshot()
    assert snap.loras == (GOOD,)
    return Baseline(weights_digest(eng.pipeline), SD15, snap.loras, len(snap.history))


def assert_intact(env: Env, base: Baseline, failed: str | None = None) -> None:
    """READY, same model and LoRAs, weights bit-identical, placement clean; when `failed` names a
    queued command, its history row says it failed and was rolled back; when None, the refusal
    happened before queueing and left no history row."""
    snap = env.engine.snapshot()
    assert snap.state == EngineState.READY.value
    assert snap.model == base.model and snap.loras == base.loras
    assert weights_digest(env.engine.pipeline) == base.digest
    plan = offload.plan_for(env.engine.pipeline, placement.DTYPES[snap.dtype], env.engine.device, snap.offload)
    assert placement.verify(env.engine.pipeline, plan) == []
    if failed is None:
        assert len(snap.history) == base.history_len, snap.history[-1]
    else:
        row = snap.history[-1]
        assert (row.command, row.outcome) == (failed, "failed, rolled back"), row


# ----------------------------------------------------------------------------- file builders
def _header_file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _good_bytes(env: Env) -> bytes:
    return (env.lora_dir / "sd15-good.safetensors").read_bytes()


def _lora_layer(env: Env, rank: int, up_rank: int | None = None, **extra) -> dict[str, torch.Tensor]:
    weight = env.engine.pipeline.unet.get_submodule(LAYER).weight
    out_dim, in_dim = weight.shape
    g = torch.Generator().manual_seed(rank)
    tensors = {f"{KEY}.lora_down.weight": torch.randn(rank, in_dim, generator=g) * 0.1,
               f"{KEY}.lora_up.weight": torch.randn(out_dim, up_rank or rank, generator=g) * 0.1}
    tensors.update({f"{KEY}.{k}": v for k, v in extra.items()})
    return tensors


def _with_bad_value(value: float):
    def build(env: Env) -> bytes:
        tensors = load_file(str(env.lora_dir / "sd15-good.safetensors"))
        key = sorted(k for k in tensors if k.endswith("lora_up.weight"))[0]
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = value
        path = env.data / "scratch.safetensors"
        save_file(tensors, str(path))
        return path.read_bytes()
    return build


def _tensors(build, scratch: str = "scratch.safetensors"):
    def to_bytes(env: Env) -> bytes:
        path = env.data / scratch
        save_file(build(env), str(path))
        return path.read_bytes()
    return to_bytes


def _zip_pickle(_env: Env) -> bytes:
    path = _env.data / "scratch.pt"
    torch.save({KEY + ".lora_down.weight": torch.ones(2, 2)}, path)
    return path.read_bytes()


# kind -> (file bytes builder, expected error type, message regex); the message must name the file.
BAD_LORA_FILES = {
    "truncated": (lambda env: _good_bytes(env)[:-100], AdapterFormatError,
                  r"bad-truncated\.safetensors: not a valid safetensors file .*truncated or corrupt"),
    "zero_bytes": (lambda env: b"", AdapterFormatError,
                   r"bad-zero_bytes\.safetensors: not a valid safetensors file \(the file is empty\)"),
    "pickle_zip": (_zip_pickle, AdapterFormatError,
                   r"bad-pickle_zip\.safetensors: .*pickled PyTorch checkpoint renamed to \.safetensors; "
                   r"refusing to unpickle it"),
    "pickle_legacy": (lambda env: pickle.dumps({"x": [1, 2, 3]}, protocol=4), AdapterFormatError,
                      r"bad-pickle_legacy\.safetensors: .*pickled PyTorch checkpoint .*refusing to unpickle it"),
    "header_lies_about_shape": (
        lambda env: _header_file({KEY + ".lora_down.weight": {"dtype": "F32", "shape": [64, 64],
                                                                "data_offsets": [0, 64]}}, bytes(64)),
        AdapterFormatError, r"bad-header_lies_about_shape\.safetensors: .*invalid shape, data type, or offset"),
    "header_lies_about_offsets": (
        lambda env: _header_file({KEY + ".lora_down.weight": {"dtype": "F32", "shape": [4, 8],
                                                                "data_offsets": [0, 128]}}, bytes(64)),
        AdapterFormatError, r"bad-header_lies_about_offsets\.safetensors: .*file not fully covered"),
    "header_too_large": (lambda env: struct.pack("<Q", 10**15) + b"{}", AdapterFormatError,
                         r"bad-header_too_large\.safetensors: .*header too large"),
    "header_not_json": (lambda env: struct.pack("<Q", 10) + b"{not json}", AdapterFormatError,
                        r"bad-header_not_json\.safetensors: .*invalid JSON in header"),
    "no_tensors": (lambda env: _header_file({"__metadata__": {"format": "pt"}}), AdapterFormatError,
                   r"bad-no_tensors\.safetensors: contains no tensors"),
    "nan_tensor": (_with_bad_value(float("nan")), AdapterFormatError,
                   r"bad-nan_tensor\.safetensors: tensor lora_\w+\.lora_up\.weight contains NaN or Inf values; "
                   r"refused"),
    "inf_tensor": (_with_bad_value(float("-inf")), AdapterFormatError,
                   r"bad-inf_tensor\.safetensors: tensor lora_\w+\.lora_up\.weight contains NaN or Inf"),
    "keys_match_nothing": (
        _tensors(lambda env: {"lora_unet_no_such_block_to_q.lora_down.weight": torch.ones(4, 32),
                              "lora_unet_no_such_block_to_q.lora_up.weight": torch.ones(32, 4)}),
        LoraApplyError, r"LoRA 'bad-keys_match_nothing': matched zero of its 1 layers in this SD15 model"),
    "rank_mismatch": (_tensors(lambda env: _lora_layer(env, rank=4, up_rank=3)), LoraApplyError,
                      rf"LoRA 'bad-rank_mismatch': .*{KEY}.*rank mismatch: lora_down has rank 4, lora_up has rank 3"),
    "unknown_algorithm_keys": (
        _tensors(lambda env: {f"{KEY}.foo_a": torch.ones(4, 32), f"{KEY}.foo_b": torch.ones(32, 4)}),
        LoraApplyError, rf"LoRA 'bad-unknown_algorithm_keys': {KEY}: unrecognised adapter keys \['foo_a', 'foo_b'\]"),
    "alpha_not_scalar": (_tensors(lambda env: _lora_layer(env, rank=4, alpha=torch.ones(2))), LoraApplyError,
                         rf"LoRA 'bad-alpha_not_scalar': {KEY}: alpha must be a single number, got shape \(2,\)"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LORA_FILES))
def test_bad_lora_file_is_refused_and_state_is_intact(env, ready, kind):
    """A malformed or unusable LoRA file added beside an applied LoRA is refused whole with a
    message naming the file (or LoRA) and the problem; the applied LoRA, the weights and the
    placement are exactly as before, and the engine is READY. `inspect_lora` refuses it the same
    way without leaving a history row."""
    build, error, message = BAD_LORA_FILES[kind]
    name = f"bad-{kind}"
    (env.lora_dir / f"{name}.safetensors").write_bytes(build(env))
    with pytest.raises(LoraApplyError, match=message) as refused:
        env.engine.set_loras([GOOD, LoraSpec(name, 1.0)])
    assert refused.value.lora_name == name and str(refused.value).startswith(f"LoRA '{name}': ")
    assert_intact(env, ready, failed="set_loras")
    assert re.search(message, env.engine.snapshot().last_error.message)
    history_len = len(env.engine.snapshot().history)
    with pytest.raises(error, match=message):
        env.engine.inspect_lora(name)
    assert len(env.engine.snapshot().history) == history_len


@pytest.mark.parametrize(("kind", "problem"), [("rank_mismatch", "rank mismatch"),
                                             ("truncated", "not a valid safetensors file"),
                                             ("nan_tensor", "contains NaN or Inf values")])
def test_apply_error_is_counted_against_the_lora(env, ready, kind, problem):
    """A LoRA that cannot be read or cannot apply gets an `apply_errors` count and the message in
    its per-LoRA counters (what the Diagnostics tab shows); the LoRA beside it gets none."""
    build = BAD_LORA_FILES[kind][0]
    name = f"counted-{kind}"
    (env.lora_dir / f"{name}.safetensors").write_bytes(build(env))
    good_before = env.engine.snapshot().lora_counters["sd15-good"].apply_errors
    with pytest.raises(LoraApplyError):
        env.engine.set_loras([GOOD, LoraSpec(name)])
    counters = env.engine.snapshot().lora_counters
    assert counters[name].apply_errors == 1
    assert counters[name].message.startswith(f"LoRA '{name}': ") and problem in counters[name].message
    assert counters["sd15-good"].apply_errors == good_before


def test_lora_for_the_other_architecture_is_refused_both_ways(env, ready):
    """An SDXL LoRA on SD1.5 and an SD1.5 LoRA on SDXL are refused whole, the message saying
    which architecture the file looks made for; nothing of it is half-applied."""
    with pytest.raises(LoraApplyError, match=r"LoRA 'sdxl-good': does not fit this SD15 model "
                                             r"\(it looks made for SDXL\)"):
        env.engine.set_loras([GOOD, LoraSpec("sdxl-good")])
    assert_intact(env, ready, failed="set_loras")

    eng = env.engine
    eng.set_loras([])
    eng.load_model("tiny-sdxl.safetensors", dtype="fp32")
    eng.set_loras([LoraSpec("sdxl-good", 0.5)])
    snap = eng.snapshot()
    base = Baseline(weights_digest(eng.pipeline), "tiny-sdxl.safetensors", snap.loras, len(snap.history))
    with pytest.raises(LoraApplyError, match=r"LoRA 'sd15-good': does not fit this SDXL model "
                                             r"\(it looks made for SD15\)"):
        eng.set_loras([LoraSpec("sdxl-good", 0.5), LoraSpec("sd15-good")])
    assert_intact(env, base, failed="set_loras")


def test_partly_matching_lora_applies_and_reports_unmatched_keys(env, ready):
    """Keys that match nothing beside keys that match are not fatal (trainers add layers other
    models lack): the LoRA applies, and its counters say how many tensors matched nothing (a layer's
    two tensors here) and name them."""
    tensors = _lora_layer(env, rank=4)
    tensors.update({"lora_unet_no_such_block_to_q.lora_down.weight": torch.ones(4, 32),
                    "lora_unet_no_such_block_to_q.lora_up.weight": torch.ones(32, 4)})
    save_file(tensors, str(env.lora_dir / "partial.safetensors"))
    snap = env.engine.set_loras([GOOD, LoraSpec("partial")])
    counters = snap.lora_counters["partial"]
    assert (counters.matched_layers, counters.unmatched_keys) == (1, 2)
    stray = "lora_unet_no_such_block_to_q"
    assert counters.message == (f"2 of its 4 tensors (1 layer) matched nothing in the model, e.g. "
                                f"{stray}.lora_down.weight, {stray}.lora_up.weight")
    assert snap.history[-1].outcome == "ok"


def test_rank_above_min_in_out_applies_exactly(env, ready):
    """Rank 4×min(in, out) is over-parameterised but valid: it applies (no error), and the fused
    weight is W0 + m·(alpha/rank)·up·down, computed here independently in float64."""
    eng = env.engine
    eng.set_loras([])
    module = eng.pipeline.unet.get_submodule(LAYER)
    w0 = module.weight.detach().clone()
    rank = 4 * min(w0.shape)
    tensors = _lora_layer(env, rank=rank, alpha=torch.tensor(float(rank // 2)))
    save_file(tensors, str(env.lora_dir / "huge-rank.safetensors"))
    snap = eng.set_loras([LoraSpec("huge-rank", 0.7)])
    assert snap.history[-1].outcome == "ok" and snap.lora_counters["huge-rank"].matched_layers == 1
    up, down = tensors[f"{KEY}.lora_up.weight"].double(), tensors[f"{KEY}.lora_down.weight"].double()
    expected = w0.double() + 0.7 * 0.5 * (up @ down)
    torch.testing.assert_close(module.weight.detach().double(), expected, rtol=1e-5, atol=1e-6)
    eng.set_loras([])
    assert torch.equal(module.weight.detach(), w0)


def test_duplicate_lora_is_refused_before_queueing(env, ready):
    """The same LoRA twice in one list is refused at once, naming it, with no history row."""
    with pytest.raises(ValueError, match="LoRA listed more than once: sd15-good; give each LoRA once"):
        env.engine.set_loras([GOOD, LoraSpec("sd15-good", 0.3)])
    assert_intact(env, ready)


@pytest.mark.parametrize("weights", [dict(weight=7.5), dict(weight=-5.0), dict(weight=1.0, te_weight=-3.0),
                                     dict(weight=0.0, unet_weight=12.0), dict(weight=1e-30)])
def test_finite_strength_outside_slider_range_is_accepted(env, ready, weights):
    """The slider spans [-2, 2] but the API accepts any finite strength (A1111 prompts do too):
    it is applied as given, and the snapshot shows it."""
    spec = LoraSpec("sd15-good", **weights)
    snap = env.engine.set_loras([spec])
    assert snap.loras == (spec,) and snap.history[-1].outcome == "ok"
    assert all(torch.isfinite(p).all() for p in env.engine.pipeline.unet.parameters())


@pytest.mark.parametrize("field", ["weight", "unet_weight", "te_weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_strength_is_refused(env, ready, field, value):
    """NaN/Inf strengths are refused where a spec is made, and again by the engine if a spec with
    one is forced past the constructor; nothing is queued."""
    with pytest.raises(ValueError, match=rf"LoRA 'sd15-good': {field} must be a finite number"):
        LoraSpec("sd15-good", **{field: value})
    forced = LoraSpec("sd15-good")
    object.__setattr__(forced, field, value)
    with pytest.raises(ValueError, match="LoRA 'sd15-good': (UNet|text-encoder) strength must be a finite number"):
        env.engine.set_loras([forced])
    assert_intact(env, ready)


@pytest.mark.parametrize("tag", ["<lora:sd15-good:nan>", "<lora:sd15-good:inf>", "<lora:sd15-good:1:-inf>"])
def test_non_finite_strength_in_prompt_tag_fails_the_generation_only(env, ready, tag):
    """A prompt tag with a NaN/Inf strength fails that generation with the finite-number message, before
    it is queued (the job's prompt chunks are counted from its tags before admission); weights and LoRAs
    are untouched."""
    with pytest.raises(ValueError, match="must be a finite number"):
        env.engine.generate(GenerateParams(f"a cat {tag}", **FAST))
    assert_intact(env, ready)


UNSAFE_LORA_NAMES = ["../sd15-good", "../../etc/passwd", "/etc/passwd", "sub/../../sd15-good", "a/../../b"]


@pytest.mark.parametrize("name", UNSAFE_LORA_NAMES)
def test_lora_path_traversal_and_absolute_names_are_refused(env, ready, name):
    """LoRA names that leave the LoRA folder are refused before queueing, by set_loras, by
    inspect_lora and in a prompt tag, with a message saying where names must live."""
    message = r"is not a plain name: absolute paths and '\.\.' are refused; put the file under .*models/Lora"
    with pytest.raises(UnsafePathError, match=message):
        env.engine.set_loras([LoraSpec(name)])
    assert_intact(env, ready)
    with pytest.raises(UnsafePathError, match=message):
        env.engine.inspect_lora(name)
    with pytest.raises(UnsafePathError, match=message):
        env.engine.generate(GenerateParams(f"a cat <lora:{name}:1>", **FAST))
    assert_intact(env, ready, failed="generate")


@pytest.mark.parametrize("name", ["", "bad\x00name"])
def test_empty_or_nul_lora_names_are_refused(env, ready, name):
    """An empty LoRA name or one with a NUL byte is refused before queueing."""
    with pytest.raises(UnsafePathError, match="LoRA name is empty or contains a NUL byte"):
        env.engine.set_loras([LoraSpec(name)])
    assert_intact(env, ready)


def test_lora_removed_between_listing_and_loading(env, ready):
    """A LoRA listed by the library but deleted before it is applied fails with a not-found
    message that names it and suggests it was moved; nothing changes."""
    shutil.copy(env.lora_dir / "sd15-good.safetensors", env.lora_dir / "vanishing.safetensors")
    assert "vanishing" in env.engine.library.names()
    (env.lora_dir / "vanishing.safetensors").unlink()
    with pytest.raises(LoraApplyError, match=r"LoRA 'vanishing' not found in .*\(was it moved or deleted\?\)"):
        env.engine.set_loras([GOOD, LoraSpec("vanishing")])
    assert_intact(env, ready, failed="set_loras")


def test_applied_lora_replaced_by_corrupt_file_keeps_last_good_weights(env, ready):
    """A LoRA file corrupted on disk after it was applied: the next slider move re-reads it, fails
    naming the file, and the weights fused from the good file stay."""
    shutil.copy(env.lora_dir / "sd15-good.safetensors", env.lora_dir / "mutable.safetensors")
    env.engine.set_loras([GOOD, LoraSpec("mutable", 0.5)])
    snap = env.engine.snapshot()
    base = Baseline(weights_digest(env.engine.pipeline), SD15, snap.loras, len(snap.history))
    (env.lora_dir / "mutable.safetensors").write_bytes(_good_bytes(env)[:-50])
    with pytest.raises(LoraApplyError, match=r"LoRA 'mutable': mutable\.safetensors: not a valid safetensors file"):
        env.engine.set_loras([GOOD, LoraSpec("mutable", 0.9)])
    assert_intact(env, base, failed="set_loras")


# ----------------------------------------------------------------------------------- checkpoints
def _ckpt_bytes(env: Env) -> bytes:
    return (env.ckpt_dir / SD15).read_bytes()


def _ckpt_tensors(build):
    return _tensors(build, "scratch-ckpt.safetensors")


def _checkpoint_with(value: float):
    """The good checkpoint (metadata included: it carries the tiny model's configs) with one value of
    one UNet conv set to `value`."""
    def build(env: Env) -> bytes:
        source, path = env.ckpt_dir / SD15, env.data / "scratch-ckpt.safetensors"
        with safe_open(str(source), framework="pt") as handle:
            metadata = handle.metadata()
        tensors = load_file(str(source))
        tensors["model.diffusion_model.input_blocks.0.0.weight"].view(-1)[3] = value
        save_file(tensors, str(path), metadata=metadata)
        return path.read_bytes()
    return build


def _unet_only(env: Env) -> dict[str, torch.Tensor]:
    tensors = load_file(str(env.ckpt_dir / SD15))
    return {k: v for k, v in tensors.items() if k.startswith("model.diffusion_model.")}


NOT_KNOWN = re.escape(f"not a checkpoint of a family this app runs ({', '.join(f.label for f in FAMILIES.values())})")
BAD_CHECKPOINTS = {
    "truncated": (lambda env: _ckpt_bytes(env)[: len(_ckpt_bytes(env)) // 2], ModelLoadError,
                  r"bad-truncated\.safetensors: not a valid safetensors file .*truncated or corrupt"),
    "zero_bytes": (lambda env: b"", ModelLoadError, r"bad-zero_bytes\.safetensors: .*the file is empty"),
    "pickle_zip": (_zip_pickle, ModelLoadError,
                   r"bad-pickle_zip\.safetensors: .*pickled PyTorch checkpoint renamed to \.safetensors"),
    "header_lies_about_shape": (
        lambda env: _header_file({"model.diffusion_model.input_blocks.0.0.weight": {
            "dtype": "F32", "shape": [320, 4, 3, 3], "data_offsets": [0, 64]}}, bytes(64)),
        ModelLoadError, r"bad-header_lies_about_shape\.safetensors: .*invalid shape, data type, or offset"),
    "pickle_legacy": (lambda env: pickle.dumps({"state_dict": {}}, protocol=2), ModelLoadError,
                      r"bad-pickle_legacy\.safetensors: .*pickled PyTorch checkpoint .*refusing to unpickle it"),
    "header_not_json": (lambda env: struct.pack("<Q", 10) + b"{not json}", ModelLoadError,
                        r"bad-header_not_json\.safetensors: .*invalid JSON in header"),
    "header_too_large": (lambda env: struct.pack("<Q", 10**15) + b"{}", ModelLoadError,
                         r"bad-header_too_large\.safetensors: .*header too large"),
    "no_tensors": (lambda env: _header_file({"__metadata__": {"format": "pt"}}), UnknownFamilyError,
                   r"bad-no_tensors\.safetensors: " + NOT_KNOWN + r": unrecognised layout with 0 tensors"),
    "random_tensors": (_ckpt_tensors(lambda env: {"foo.weight": torch.ones(2), "bar.bias": torch.ones(2)}),
                       UnknownFamilyError,
                       r"bad-random_tensors\.safetensors: " + NOT_KNOWN + r": unrecognised layout "
                       r"with 2 tensors"),
    "lora_in_checkpoint_folder": (lambda env: _good_bytes(env), UnknownFamilyError,
                                  NOT_KNOWN + r": looks like a LoRA/LyCORIS adapter "
                                  r"\(put it in models/Lora\)"),
    "unet_only": (_ckpt_tensors(_unet_only), UnknownFamilyError,
                  NOT_KNOWN + r": looks like a UNet without its text encoder"),
}


@pytest.mark.parametrize("kind", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoint_is_refused_and_previous_model_stays(env, ready, kind):
    """Loading a malformed or foreign checkpoint fails in LOADING with a message naming the file and
    the problem; the previous model stays loaded, READY, with its LoRA and weights untouched."""
    build, error, message = BAD_CHECKPOINTS[kind]
    (env.ckpt_dir / f"bad-{kind}.safetensors").write_bytes(build(env))
    with pytest.raises(error, match=message):
        env.engine.load_model(f"bad-{kind}.safetensors")
    assert_intact(env, ready, failed="load_model")
    assert f"bad-{kind}" in env.engine.snapshot().last_error.message


def test_checkpoint_with_nan_weights_is_refused_once_read_and_at_every_later_load(env):
    """A first load does not read the weights (file_scans), so a checkpoint holding a NaN loads; once
    its file is read, every generation with it is refused naming the tensor, and a later load of it
    is refused before anything is built, leaving the model loaded then as it was."""
    (env.ckpt_dir / "bad-nan.safetensors").write_bytes(_checkpoint_with(float("nan"))(env))
    message = (r"bad-nan\.safetensors: 1 weight tensors hold NaN or Inf values when loaded in float32, e\.g\. "
               r"model\.diffusion_model\.input_blocks\.0\.0\.weight; refusing it")
    env.engine.load_model("bad-nan.safetensors", dtype="fp32")
    env.engine.snapshot(wait_for_hash=True)  # the background read is done
    with pytest.raises(ModelLoadError, match=message):
        env.engine.generate(GenerateParams("a cat", **FAST))
    env.engine.load_model(SD15, dtype="fp32")
    env.engine.set_loras([GOOD])
    base = Baseline(weights_digest(env.engine.pipeline), SD15, (GOOD,), len(env.engine.snapshot().history))
    with pytest.raises(ModelLoadError, match=message):
        env.engine.load_model("bad-nan.safetensors")
    assert_intact(env, base, failed="load_model")


def test_weights_beyond_fp16_range_load_in_fp32_and_are_refused_in_fp16_with_a_hint(env):
    """A weight of 1e6 fits fp32 but overflows to Inf in fp16: the file's read finds it, and the verdict
    depends on the load dtype (a CPU stores an fp16 request as fp32, so it is asked directly): refused
    in fp16 with the advice to use bf16 or fp32, accepted in fp32 and bf16."""
    (env.ckpt_dir / "huge.safetensors").write_bytes(_checkpoint_with(1e6)(env))
    info = resolve_checkpoint("huge.safetensors", env.ckpt_dir)
    load_pipeline(info, torch.float32)  # fits fp32: no error
    scans = {info.path: scan_file(info.path)}
    assert not_finite_refusal(info.name, scans, torch.float32) is None
    assert not_finite_refusal(info.name, scans, torch.bfloat16) is None
    assert re.fullmatch(r"huge\.safetensors: 1 weight tensors hold NaN or Inf values when loaded in float16, e\.g\. "
                        r"model\.diffusion_model\.input_blocks\.0\.0\.weight \(values beyond ±65504 overflow fp16: "
                        r"try bf16 or fp32\); refusing it, since every image would come out black",
                        not_finite_refusal(info.name, scans, torch.float16))


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin", ".pth"])
def test_pickle_checkpoint_suffix_is_refused(env, ready, suffix):
    """Pickle-format checkpoints are refused by suffix, before anything opens them."""
    path = env.ckpt_dir / f"old{suffix}"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(UnsupportedCheckpointFormatError, match=rf"\{suffix} files are pickles and can run code"):
        env.engine.load_model(path.name)
    assert_intact(env, ready, failed="load_model")


def test_diffusers_folder_with_only_bin_weights_is_refused(env, ready):
    """A diffusers folder whose weights are `.bin` pickles is refused instead of unpickled."""
    folder = env.ckpt_dir / "bin-only"
    shutil.copytree(env.ckpt_dir / "tiny-sd15-diffusers", folder)
    for weights in folder.glob("unet/*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(ModelLoadError, match=r"bin-only"):
        env.engine.load_model("bin-only")
    assert_intact(env, ready, failed="load_model")


CHECKPOINT_NAME_REFUSED = (r"checkpoint .* is not a plain name: absolute paths and '\.\.' are refused; "
                           r"put the file under .*models/Stable-diffusion and use its name")


@pytest.mark.parametrize("name", ["../tiny-sd15.safetensors", "../../models/Stable-diffusion/tiny-sd15.safetensors",
                                  "sub/../../x.safetensors", "/etc/passwd"])
def test_checkpoint_names_with_dotdot_or_absolute_are_refused(env, ready, name):
    """Checkpoint names containing `..` and absolute paths are refused, naming the folder they must
    live in; the current model stays."""
    with pytest.raises(UnsafeCheckpointPathError, match=CHECKPOINT_NAME_REFUSED):
        env.engine.load_model(name)
    assert_intact(env, ready, failed="load_model")


def test_absolute_checkpoint_paths_are_refused_even_to_valid_files(env, ready, tmp_path):
    """An absolute path is refused whether it points at a valid checkpoint outside the folder or at
    one inside it: names are the only currency of the API (one policy for checkpoints and LoRAs)."""
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(env.ckpt_dir / SD15, outside)
    for name in (str(outside), str(env.ckpt_dir / SD15)):
        with pytest.raises(UnsafeCheckpointPathError, match=CHECKPOINT_NAME_REFUSED):
            env.engine.load_model(name)
        assert_intact(env, ready, failed="load_model")


def test_user_placed_symlink_in_the_checkpoint_folder_is_followed(env, ready, tmp_path):
    """By design a symlink the user placed inside the checkpoint folder is followed even when it
    points elsewhere (model folders often live on another drive): the check is on the name, which
    is what an untrusted caller controls. It is listed and loads under its link name."""
    outside = tmp_path / "on-another-drive.safetensors"
    shutil.copy(env.ckpt_dir / SD15, outside)
    (env.ckpt_dir / "linked.safetensors").symlink_to(outside)
    assert "linked.safetensors" in {i.name for i in discover_checkpoints(env.ckpt_dir)}
    snap = env.engine.load_model("linked.safetensors", dtype="fp32")
    assert snap.model == "linked.safetensors" and snap.history[-1].outcome == "ok"
    assert weights_digest(env.engine.pipeline) == ready.digest  # same file, same LoRA re-applied


def test_checkpoint_removed_between_listing_and_loading(env, ready):
    """A checkpoint listed by discovery and deleted before loading fails with a not-found message
    listing what is available; the current model stays."""
    shutil.copy(env.ckpt_dir / SD15, env.ckpt_dir / "vanishing.safetensors")
    assert "vanishing.safetensors" in {i.name for i in discover_checkpoints(env.ckpt_dir)}
    (env.ckpt_dir / "vanishing.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint 'vanishing.safetensors' not found in .*available: "):
        env.engine.load_model("vanishing.safetensors")
    assert_intact(env, ready, failed="load_model")


def test_every_refusal_is_a_value_error_the_ui_can_show(env, ready):
    """Every input refusal above is a ValueError subclass, so the UI shows the message instead of a
    traceback."""
    for cls in (AdapterError, AdapterFormatError, LoraApplyError, ModelLoadError, UnknownFamilyError,
                UnsafeCheckpointPathError, UnsupportedCheckpointFormatError, CheckpointNotFoundError, UnsafePathError):
        assert issubclass(cls, ValueError), cls


# --------------------------------------------------------------------- after a refusal, go on
def test_generation_after_a_refused_lora_list_uses_the_previous_list(env, ready):
    """After set_loras is refused (here: a LoRA for the other architecture), the previous list stays
    in force for generation too — not only in the weights — so the next generate succeeds with it."""
    with pytest.raises(LoraApplyError):
        env.engine.set_loras([GOOD, LoraSpec("sdxl-good")])
    assert_intact(env, ready, failed="set_loras")
    images = env.engine.generate(GenerateParams("a cat", **FAST))
    assert len(images) == 1
    assert "sd15-good" in images[0].infotext and "sdxl-good" not in images[0].infotext
    snap = env.engine.snapshot()
    assert snap.loras == (GOOD,) and weights_digest(env.engine.pipeline) == ready.digest


def test_generation_after_switching_architecture_with_loras_set(env, ready):
    """Switching SD1.5 -> SDXL while an SD1.5 LoRA is set: the load succeeds without that LoRA
    (set aside, not fatal), generation on SDXL works, and switching back to SD1.5 re-applies it —
    the weights are bit-identical to before the round trip."""
    snap = env.engine.load_model("tiny-sdxl.safetensors", dtype="fp32")
    assert snap.state == EngineState.READY.value and snap.loras == ()
    assert snap.history[-1].outcome == "ok"
    images = env.engine.generate(GenerateParams("a cat", **FAST))
    assert len(images) == 1 and "sd15-good" not in images[0].infotext
    snap = env.engine.load_model(SD15, dtype="fp32")
    assert snap.loras == (GOOD,)
    assert weights_digest(env.engine.pipeline) == ready.digest


def test_a_lora_with_a_garbage_header_length_gets_the_engines_message_on_its_card(tmp_path):
    """A LoRA whose first 8 bytes (the header length) are garbage: its card says what the engine says when
    applying it (one clear message, naming the file), never the hash's "cannot fit 'int' into an offset-sized
    integer"."""
    from app.adapters.files import read_adapter
    from app.ui.lora_cards import CardCache

    path = tmp_path / "garbage-header.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63 + 5) + b"{}" + bytes(100))
    with pytest.raises(AdapterFormatError) as engine_says:
        read_adapter("garbage-header", path)
    with pytest.raises(AdapterFormatError) as card_says:
        CardCache().card("garbage-header", path)
    assert str(card_says.value) == str(engine_says.value)
    assert "garbage-header.safetensors: not a valid safetensors file" in str(card_says.value)
