"""LoRA files as the tools really write them, fused into the tiny SD1.5 and SDXL pipelines.

The files come from PEFT's and diffusers' own writers (see `lora_tools`), not from our synthetic
one. The reference is the formula W = W0 + Σ wᵢ·Dᵢ computed in float64 from the PEFT layers; fp32
models must land within a few float32 ulps of each layer's magnitude, and removal must restore
every bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline
from lora_tools import (
    COMPONENTS,
    FP32_ULPS,
    ToolFile,
    expected_deltas,
    peft_copy,
    write_diffusers,
    write_kohya,
    write_legacy,
    write_peft_folder,
)
from peft import LoraConfig, get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from app.adapters.errors import LoraApplyError
from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import write_adapter
from app.demo import build_tiny_pipeline

# -------------------------------------------------------------------------------------- fixtures
FORMATS = ("diffusers", "diffusers_dora", "kohya", "legacy", "peft_folder")
# Tensors in the legacy file that name modules the tiny models lack: counted, never applied.
STRAYS = {f"{layer}_lora.{part}.weight": torch.ones(4, 4) for part in ("down", "up") for layer in (
    "unet.down_blocks.5.attentions.0.transformer_blocks.0.attn1.processor.to_q",
    "text_encoder.text_model.encoder.layers.99.self_attn.to_k")}
UNMATCHED = {"legacy": len(STRAYS)}


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory):
    """`tool_files(family)`: every format's file for `family_name`, written once per module."""
    cache: dict[str, dict[str, ToolFile]] = {}

    def get(family_name: str) -> dict[str, ToolFile]:
        if family_name not in cache:
            pipe, root = build_tiny_pipeline(family_name), tmp_path_factory.mktemp(f"tool-{family_name}")
            cache[family_name] = {
                "diffusers": write_diffusers(root / "diffusers", pipe, family_name, seed=1),
                "diffusers_dora": write_diffusers(root / "dora", pipe, family_name, seed=2, dora=True),
                "kohya": write_kohya(root / "kohya.safetensors", pipe, family_name, seed=3),
                "legacy": write_legacy(root / "legacy.safetensors", pipe, family_name, seed=4, strays=STRAYS),
                "peft_folder": write_peft_folder(root / "peft", pipe, seed=5),
            }
        return cache[family_name]

    return get


@pytest.fixture(scope="module")
def model():
    """`model(family)`: a tiny fp32 pipeline built once per module, every weight and bias put back
    to its original bits on each call, and those original tensors."""
    cache: dict[str, tuple[object, dict[str, torch.Tensor]]] = {}

    def get(family_name: str):
        if family_name not in cache:
            pipe = build_tiny_pipeline(family_name)
            cache[family_name] = (pipe, {f"{c}.{k}": v.clone() for c in COMPONENTS[family_name]
                                         for k, v in getattr(pipe, c).state_dict().items()})
        pipe, pristine = cache[family_name]
        with torch.no_grad():
            for component in COMPONENTS[family_name]:
                for key, tensor in getattr(pipe, component).state_dict().items():
                    tensor.copy_(pristine[f"{component}.{key}"])
        return pipe, pristine

    return get


def _fuse(pipe, family_name: str, entries: list[tuple[str, ToolFile, float]]):
    """Fuse (name, file, strength) through a fresh LoraStack reading each file from disk."""
    stack = LoraStack(pipe, family_name)
    files = {name: read_adapter(name, tool.path) for name, tool, _ in entries}
    return stack, stack.reconcile([LoraSpec(name, w) for name, _, w in entries], files)


def _assert_fused(pipe, family_name: str, pristine: dict[str, torch.Tensor],
                  entries: list[tuple[ToolFile, float]]) -> float:
    """Every weight equals W0 + Σ w·D within its ulps budget, every other tensor keeps its bits;
    returns the largest error seen, in float32 ulps of the layer's magnitude."""
    worst = 0.0
    for component in COMPONENTS[family_name]:
        for key, tensor in getattr(pipe, component).state_dict().items():
            target, original = (component, key.removesuffix(".weight")), pristine[f"{component}.{key}"]
            touching = [(tool, w) for tool, w in entries if key.endswith(".weight") and target in tool.expected]
            if not touching:
                assert torch.equal(tensor, original), f"{component}.{key} changed but no file targets it"
                continue
            reference = original.double() + sum(w * tool.expected[target] for tool, w in touching)
            ulp = torch.finfo(torch.float32).eps * float(reference.abs().max())
            error = float((tensor.double() - reference).abs().max()) / ulp
            assert error <= FP32_ULPS, f"{component}.{key}: off by {error:.1f} ulps"
            worst = max(worst, error)
    return worst


def _assert_restored(pipe, family_name: str, pristine: dict[str, torch.Tensor]) -> None:
    for component in COMPONENTS[family_name]:
        for key, tensor in getattr(pipe, component).state_dict().items():
            original = pristine[f"{component}.{key}"]
            assert torch.equal(tensor.view(torch.int32), original.view(torch.int32)), f"{component}.{key} not restored"


# ------------------------------------------------------------------------ fused = the formula
@pytest.mark.parametrize("strength", [1.0, 0.6])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family_name", ["sd15", "sdxl"])
def test_tool_written_files_fuse_to_the_formula(model, tool_files, family_name, fmt, strength):
    """Each tool's file, alone at strength w, moves every module it names to W0 + w·scale·B@A (PEFT's
    scale, from the file's metadata or adapter_config.json), reaches every layer (attention,
    feed-forward, resnet convs, time/added embeddings, every text encoder), counts exactly the
    tensors that match nothing, and restores every bit when removed."""
    pipe, pristine = model(family_name)
    tool = tool_files(family_name)[fmt]
    stack, report = _fuse(pipe, family_name, [("a", tool, strength)])
    assert (report["a"].matched_layers, report["a"].unmatched_keys) == (len(tool.expected), UNMATCHED.get(fmt, 0))
    _assert_fused(pipe, family_name, pristine, [(tool, strength)])
    stack.reconcile([], {})
    _assert_restored(pipe, family_name, pristine)


def test_the_files_cover_every_kind_of_layer(tool_files):
    """Guards the test above: the written files really reach attention, feed-forward, resnet
    convs, the time embedding (and SDXL's added embedding) and every text encoder, with rank and
    alpha patterns, rsLoRA and DoRA in play."""
    for family_name in ("sd15", "sdxl"):
        targets = {f"{c}.{p}" for tool in tool_files(family_name).values() for c, p in tool.expected}
        needles = ["attn1.to_q", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2", "resnets.0.conv1", "conv2",
                   "conv_shortcut", "time_emb_proj", "time_embedding.linear_2", "self_attn.out_proj", "mlp.fc2"]
        needles += ["add_embedding.linear_1", "text_encoder_2.text_projection"] if family_name == "sdxl" else []
        for needle in needles:
            assert any(needle in t for t in targets), (family_name, needle)
    meta = json.loads(load_file_metadata(tool_files("sd15")["diffusers"].path)["lora_adapter_metadata"])
    assert (meta["unet.lora_alpha"], meta["unet.r"], meta["text_encoder.use_rslora"]) == (8, 4, True)


def load_file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata() or {}


@pytest.mark.parametrize(("first", "second"), [("diffusers", "kohya"), ("legacy", "diffusers_dora"),
                                               ("peft_folder", "legacy")])
@pytest.mark.parametrize("family_name", ["sd15", "sdxl"])
def test_two_tool_files_stacked(model, tool_files, family_name, first, second):
    """Two files of different layouts at strengths 1 and 0.6 sum their deltas, each taken against
    W0; dropping the first leaves exactly the second; dropping both restores every bit."""
    pipe, pristine = model(family_name)
    a, b = tool_files(family_name)[first], tool_files(family_name)[second]
    stack, _ = _fuse(pipe, family_name, [("a", a, 1.0), ("b", b, 0.6)])
    _assert_fused(pipe, family_name, pristine, [(a, 1.0), (b, 0.6)])
    stack.reconcile([LoraSpec("b", 0.6)], {"b": read_adapter("b", b.path)})
    _assert_fused(pipe, family_name, pristine, [(b, 0.6)])
    stack.reconcile([], {})
    _assert_restored(pipe, family_name, pristine)


@pytest.mark.parametrize(("family_name", "fmt"), [("sd15", "diffusers"), ("sd15", "kohya"), ("sdxl", "diffusers"),
                                                  ("sdxl", "diffusers_dora")])
def test_diffusers_fuses_these_files_to_the_same_weights(model, tool_files, family_name, fmt):
    """Where diffusers reads a layout right, its own `load_lora_weights` + `fuse_lora` on a fresh
    pipeline gives our fused weights: the same alpha from the metadata, the same `lora_te1_` text
    encoder, the same DoRA."""
    pipe, pristine = model(family_name)
    tool = tool_files(family_name)[fmt]
    _fuse(pipe, family_name, [("a", tool, 1.0)])
    theirs = build_tiny_pipeline(family_name)
    theirs.load_lora_weights(str(tool.path.parent), weight_name=tool.path.name)
    theirs.fuse_lora(components=list(COMPONENTS[family_name]), lora_scale=1.0)
    theirs.unload_lora_weights()
    for component in COMPONENTS[family_name]:
        ours = getattr(pipe, component).state_dict()
        for key, tensor in getattr(theirs, component).state_dict().items():
            torch.testing.assert_close(ours[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{component}.{key}")


@pytest.mark.parametrize(("family_name", "layout", "spelled"), [
    ("sdxl", "kohya", ("lora_unet_label_emb_0_0", "lora_unet_time_embed_2", "lora_unet_input_blocks_3_1_",
                       "lora_unet_input_blocks_0_0.", "lora_unet_out_2.", "lora_te2_text_projection.")),
    ("sd15", "kohya_ldm", ("lora_unet_time_embed_0", "lora_unet_input_blocks_1_1_", "lora_unet_output_blocks_",
                           "lora_unet_input_blocks_0_0.", "lora_unet_out_2.")),
])
def test_kohya_files_with_ldm_block_names_fuse_to_the_formula(model, tmp_path, family_name, layout, spelled):
    """kohya names UNet layers by LDM blocks on SDXL (`input_blocks_3_1_…`, `label_emb_0_0` for the
    added embedding, `time_embed_2`, `input_blocks_0_0` and `out_2` for conv_in/conv_out, plus
    `lora_te2_text_projection`), and some SD1.5 tools do too. Compared with the formula, not
    with diffusers: the installed diffusers refuses SD1.5 LDM names outright (it remaps them only
    when given a UNet config, which its SD1.5 loader does not pass), and earlier diffusers releases
    dropped SDXL's `label_emb` keys, so diffusers is no reference here."""
    pipe, pristine = model(family_name)
    targets = ("unet.time_embedding.linear_*", "unet.add_embedding.linear_*", "unet.*attn[12].to_[qk]",
               "unet.*resnets.*.conv[12]", "unet.*ff.net.2", "unet.conv_in", "unet.conv_out",
               "text_encoder*.layers.0.mlp.fc1", "text_encoder_2.text_projection")
    written = write_adapter(tmp_path / "ldm.safetensors", pipe, family_name, "lora", layout, targets=targets, alpha=3.0)
    for needle in spelled:
        assert any(k.startswith(needle) for k in written.tensors), (needle, sorted(written.tensors)[:5])
    expected = {target: float(t["alpha"]) / t["lora_down.weight"].shape[0] * (
        t["lora_up.weight"].double().flatten(1) @ t["lora_down.weight"].double().flatten(1)).reshape(
        getattr(pipe, target[0]).get_submodule(target[1]).weight.shape) for target, t in written.layers.items()}
    tool = ToolFile(written.path, expected)
    stack, report = _fuse(pipe, family_name, [("a", tool, 0.6)])
    assert (report["a"].matched_layers, report["a"].unmatched_keys) == (len(expected), 0)
    assert report["a"].layout.startswith("kohya (LDM block names)")
    _assert_fused(pipe, family_name, pristine, [(tool, 0.6)])
    stack.reconcile([], {})
    _assert_restored(pipe, family_name, pristine)


# ------------------------------------------------------------------------------ per-file report
REPORTS = {  # format -> (layout, scale source)
    "diffusers": ("diffusers/PEFT, lora_A/lora_B", "PEFT metadata (lora_adapter_metadata)"),
    "diffusers_dora": ("diffusers/PEFT, lora_A/lora_B", "PEFT metadata (lora_adapter_metadata)"),
    "kohya": ("kohya", "alpha tensors"),
    "peft_folder": ("PEFT (bare module names), lora_A/lora_B", "PEFT adapter_config.json"),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_report_says_layout_scale_source_leftovers_and_architecture(model, tool_files, fmt):
    """The per-file report names the layout the keys were written in, where the scale came from,
    the first tensors that matched nothing and the architecture the file fits; the LoRA card
    shows all of it."""
    from app.engine.snapshot import LoraState
    from app.ui.lora_cards import Fit, card_markdown, state_badge

    pipe, _ = model("sd15")
    _, reports = _fuse(pipe, "sd15", [("a", tool_files("sd15")[fmt], 1.0)])
    report = reports["a"]
    assert report.fits == "SD15" and report.declared is None
    if fmt == "legacy":
        assert report.layout.split(" + ")[0] == "diffusers legacy attention processors, to_q_lora.down"
        assert {"diffusers/PEFT, lora.down/lora.up", "diffusers/PEFT, lora_linear_layer"} <= set(
            report.layout.split(" + "))
        assert report.scale_source == "absent (scale 1)"
        assert report.unmatched_examples == tuple(sorted(STRAYS))[:3]
        assert report.message.startswith(f"4 of its {report.total_keys} tensors (2 layers) matched nothing in the "
                                         "model, e.g. text_encoder.")
    else:
        assert (report.layout, report.scale_source) == REPORTS[fmt]
        assert (report.unmatched_examples, report.message) == ((), "")
    card = card_markdown(None, "a", state_badge(LoraState("a", 1.0, 1.0, "applied"), None, Fit.from_report(report)))
    assert f"layout: {report.layout}" in card and f"scale: {report.scale_source}" in card
    assert ("4 tensors unmatched: `text_encoder." in card) == (fmt == "legacy")


def test_lora_te1_file_applies_on_sd15_and_foreign_files_are_refused_whole(model, tool_files):
    """`convert_state_dict_to_kohya` writes `lora_te1_` for SD1.5 too: every layer fits, so it
    applies. An SDXL file on SD1.5 (named as made for SDXL: it has a second text encoder SD1.5
    lacks) and an SD1.5 file on SDXL (cross-attention keys of the wrong width) are refused whole,
    no bit written."""
    pipe, pristine = model("sd15")
    kohya = tool_files("sd15")["kohya"]
    assert any(k.startswith("lora_te1_") for k in load_file(kohya.path))
    _, report = _fuse(pipe, "sd15", [("a", kohya, 1.0)])
    assert report["a"].fits == "SD15" and ("text_encoder", "encoder.layers.0.self_attn.q_proj") in kohya.expected
    for family_name, foreign, pattern in (("sd15", tool_files("sdxl")["diffusers"], r"\(it looks made for SDXL\)"),
                                          ("sdxl", tool_files("sd15")["kohya"], r"layers have the wrong shape")):
        pipe, pristine = model(family_name)
        with pytest.raises(LoraApplyError, match=rf"does not fit this {family_name.upper()} model.*{pattern}"):
            _fuse(pipe, family_name, [("x", foreign, 1.0)])
        _assert_restored(pipe, family_name, pristine)


# ------------------------------------------------------------------------------------- refusals
def _with_metadata(tmp_path: Path, tool: ToolFile, name: str, edit) -> ToolFile:
    """A copy of a tool's file whose `lora_adapter_metadata` JSON went through `edit` (a dict edit,
    or a string that replaces the JSON text)."""
    metadata = load_file_metadata(tool.path)
    if isinstance(edit, str):
        metadata["lora_adapter_metadata"] = edit
    else:
        config = json.loads(metadata["lora_adapter_metadata"])
        config.update(edit)
        metadata["lora_adapter_metadata"] = json.dumps(config)
    path = tmp_path / f"{name}.safetensors"
    save_file(load_file(tool.path), str(path), metadata=metadata)
    return ToolFile(path, tool.expected)


@pytest.mark.parametrize(("edit", "message"), [
    ({"unet.peft_type": "LOHA"}, "PEFT adapter type LOHA is not supported"),
    ({"unet.modules_to_save": ["conv_in"]}, "PEFT option modules_to_save"),
    ({"unet.init_lora_weights": "pissa_niter_4"}, "trains against a residual base model"),
    ({"unet.rank_pattern": {"conv2": 3}}, "gives rank 3 but the file's lora_A has rank 2"),
    ({"unet.use_dora": True}, "says use_dora=True but the layer has no magnitude vector"),
    ("{not json", "is not valid JSON"),
], ids=["loha", "modules_to_save", "pissa", "rank", "dora", "json"])
def test_peft_configs_beyond_plain_lora_are_refused_by_name(model, tool_files, tmp_path, edit, message):
    """A PEFT config that makes the adapter more than W + scale·B·A, or that disagrees with the
    tensors, refuses the file whole with the option named; no weight changes."""
    pipe, pristine = model("sd15")
    tool = _with_metadata(tmp_path, tool_files("sd15")["diffusers"], "edited", edit)
    with pytest.raises(LoraApplyError, match=message):
        _fuse(pipe, "sd15", [("x", tool, 1.0)])
    _assert_restored(pipe, "sd15", pristine)


@pytest.mark.parametrize(("metadata", "boft", "message"), [
    ({"ss_network_args": json.dumps({"algo": "tlora"})}, False, "T-LoRA: it was trained with a rank mask"),
    ({"lycoris_config": json.dumps({"algo": "glokr", "linear_dim": 4})}, False, "GLoKr: LyCORIS never released"),
    ({}, True, "BOFT .butterfly OFT, 4-D oft_blocks."),
], ids=["tlora", "glokr", "boft"])
def test_lycoris_algorithms_without_a_fusable_format_are_refused_by_name(model, tmp_path, metadata, boft, message):
    """T-LoRA (its tensors are a plain LoRA, but it needs a per-timestep rank mask), GLoKr (never
    released) and BOFT (its rotation changed between LyCORIS releases) are refused whole, named,
    whether the trainer's metadata or the tensors' shape tells."""
    pipe, pristine = model("sd15")
    written = write_adapter(tmp_path / "l.safetensors", pipe, "sd15", "lora", "lycoris", metadata=metadata)
    tensors = dict(written.tensors)
    if boft:
        tensors["lycoris_down_blocks_0_attentions_0_proj_in.oft_blocks"] = torch.zeros(2, 4, 8, 8)
    save_file(tensors, str(written.path), metadata={**written.metadata, **metadata})
    with pytest.raises(LoraApplyError, match=message):
        _fuse(pipe, "sd15", [("x", ToolFile(written.path, {}), 1.0)])
    _assert_restored(pipe, "sd15", pristine)


def test_metadata_naming_another_architecture_decides_only_a_partial_fit(model, tool_files, tmp_path):
    """Metadata saying SDXL does not refuse a file every layer of which fits SD1.5 (it applies, the
    report says so); the same file with tensors that match nothing is taken at its word and refused."""
    pipe, pristine = model("sd15")
    kohya = tool_files("sd15")["kohya"]
    tensors, sdxl = load_file(kohya.path), {"ss_base_model_version": "sdxl_base_v1-0"}
    save_file(tensors, str(tmp_path / "fits.safetensors"), metadata=sdxl)
    stack, report = _fuse(pipe, "sd15", [("a", ToolFile(tmp_path / "fits.safetensors", {}), 1.0)])
    assert report["a"].declared == "sdxl" and "its metadata names SDXL, but every layer fits" in report["a"].message
    stack.reconcile([], {})
    stray = {"lora_unet_no_block.lora_down.weight": torch.ones(4, 4)}
    save_file({**tensors, **stray}, str(tmp_path / "partial.safetensors"), metadata=sdxl)
    with pytest.raises(LoraApplyError, match=r"\(it looks made for SDXL\): its metadata names SDXL"):
        _fuse(pipe, "sd15", [("b", ToolFile(tmp_path / "partial.safetensors", {}), 1.0)])
    _assert_restored(pipe, "sd15", pristine)


def test_peft_lora_bias_moves_the_bias_by_scale_times_b(model, tmp_path):
    """PEFT's `lora_bias=True` gives lora_B a bias: the layer's bias moves by w·scale·b beside
    W0 + w·scale·B@A (PEFT's own merge rule), and both come back bit-exact on removal."""
    pipe, pristine = model("sd15")
    config = LoraConfig(r=4, lora_alpha=6, target_modules=["to_out.0", "ff.net.2", "conv1", "proj_in"], lora_bias=True)
    unet = peft_copy(pipe.unet, config, seed=9)
    StableDiffusionPipeline.save_lora_weights(tmp_path, unet_lora_layers=get_peft_model_state_dict(unet),
                                              unet_lora_adapter_metadata=config.to_dict())
    tool = ToolFile(tmp_path / "pytorch_lora_weights.safetensors", expected_deltas({"unet": unet}))
    stack, _ = _fuse(pipe, "sd15", [("b", tool, 0.6)])
    layers = {path: layer for path, layer in unet.named_modules() if hasattr(layer, "lora_A")}
    assert len(layers) == len(tool.expected) > 10
    for path, layer in layers.items():
        fused = pipe.unet.get_submodule(path)
        bias = pristine[f"unet.{path}.bias"].double() + 0.6 * layer.scaling["default"] * (
            layer.lora_B["default"].bias.detach().double())
        torch.testing.assert_close(fused.bias.double(), bias, rtol=0, atol=1e-6)
        torch.testing.assert_close(fused.weight.double(), pristine[f"unet.{path}.weight"].double()
                                   + 0.6 * tool.expected[("unet", path)], rtol=0, atol=1e-5)
    stack.reconcile([], {})
    _assert_restored(pipe, "sd15", pristine)


def test_adapter_config_json_counts_only_when_it_belongs_to_the_file(model, tool_files, tmp_path):
    """PEFT's `adapter_config.json` scales the `adapter_model.safetensors` beside it, or a renamed
    file alone in its folder; beside several files it could belong to any, so none takes it."""
    pipe, _ = model("sd15")
    folder = tool_files("sd15")["peft_folder"].path.parent
    (tmp_path / "adapter_config.json").write_bytes((folder / "adapter_config.json").read_bytes())
    renamed = tmp_path / "mine.safetensors"
    renamed.write_bytes((folder / "adapter_model.safetensors").read_bytes())
    assert read_adapter("mine", renamed).sidecar_config is not None
    (tmp_path / "other.safetensors").write_bytes(renamed.read_bytes())
    assert read_adapter("mine", renamed).sidecar_config is None
    stack, report = _fuse(pipe, "sd15", [("mine", ToolFile(renamed, {}), 1.0)])
    assert report["mine"].scale_source == "absent (scale 1)"
    stack.reconcile([], {})


def test_a_whole_module_weight_in_a_peft_file_is_refused_not_read_as_ia3(model, tool_files, tmp_path):
    """`conv_in.weight` beside PEFT's bare keys is a full replacement weight (PEFT modules_to_save),
    though IA3 also stores a `weight`: refused by name rather than fused as a scaling vector."""
    pipe, pristine = model("sd15")
    path = tool_files("sd15")["peft_folder"].path
    tensors = {**load_file(path), "conv_in.weight": pipe.unet.conv_in.weight.detach().clone()}
    save_file(tensors, str(tmp_path / "full.safetensors"))
    with pytest.raises(LoraApplyError, match=r"conv_in: a whole module weight .PEFT modules_to_save"):
        _fuse(pipe, "sd15", [("x", ToolFile(tmp_path / "full.safetensors", {}), 1.0)])
    _assert_restored(pipe, "sd15", pristine)
