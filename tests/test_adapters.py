"""Adapter files end to end: written by `app.adapters.synthetic`, read by the library, fused by the
patcher into the tiny SD1.5/SDXL pipelines.

Fused weights are checked against a reference computed here, independently of `app.adapters`:
straight from each algorithm's published formula, with einsum in float64 on the very tensors the
file holds, then W0 + Σ mᵢ·ΔWᵢ(W0). fp32 models must land within a few float32 ulps of the layer's
magnitude; bf16 models on the reference rounded to bf16, one bf16 ulp at most. Every refusal
(wrong architecture, corrupt file, a failure half-way through) must leave every weight
bit-identical.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.adapters.algos import LoHa
from app.adapters.errors import LoraApplyError
from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import ALGORITHMS, LAYOUTS, adapter_state_digests, write_adapter
from app.demo import build_tiny_pipeline
from app.engine.worker import Engine, EngineState

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
COMPONENTS = {"sd15": ("unet", "text_encoder"), "sdxl": ("unet", "text_encoder", "text_encoder_2")}
CHECKPOINTS = {"sd15": "tiny-sd15.safetensors", "sdxl": "tiny-sdxl.safetensors"}
# float32 ulps of a layer's magnitude the fp32 result may be off: rank/channel sums round in
# float32 (measured ≤ 3.4); DoRA also normalises whole rows and adds a float32 eps to the norm
# (measured ≤ 9).
FP32_ULPS = 4
FP32_ULPS_BY_ALGO = {"dora": 12, "dora_in": 12}
Tensors = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------- tiny models
@dataclass
class TinyModel:
    """A tiny pipeline in one dtype. `live` holds its UNet/text-encoder tensors by `component.key`
    (sharing storage with the parameters, so in-place fusing shows through), `pristine` copies."""

    pipe: object
    family: str
    live: Tensors
    pristine: Tensors

    def module(self, component: str, path: str) -> torch.nn.Module:
        return getattr(self.pipe, component).get_submodule(path)

    @torch.no_grad()
    def restore(self) -> None:
        for key, tensor in self.live.items():
            tensor.copy_(self.pristine[key])


@pytest.fixture(scope="module")
def tiny() -> Callable[[str, torch.dtype], TinyModel]:
    """`tiny(family, dtype)`: a pipeline built once per module, restored to its original weights on
    every call so a test never sees what an earlier (possibly failed) one fused."""
    cache: dict[tuple[str, torch.dtype], TinyModel] = {}

    def get(family_name: str, dtype: torch.dtype) -> TinyModel:
        if (family_name, dtype) not in cache:
            pipe = build_tiny_pipeline(family_name)
            live = {}
            for component in COMPONENTS[family_name]:
                module = getattr(pipe, component).to(dtype)
                live.update({f"{component}.{k}": v for k, v in module.state_dict().items()})
            cache[(family_name, dtype)] = TinyModel(pipe, family_name, live, {k: v.clone() for k, v in live.items()})
        model = cache[(family_name, dtype)]
        model.restore()
        return model

    return get


def _fuse(model: TinyModel, entries: list[tuple[LoraSpec, object]]) -> tuple[LoraStack, dict]:
    """Fuse (spec, SyntheticAdapter) pairs through a fresh LoraStack, reading each file back from disk."""
    stack = LoraStack(model.pipe, model.family)
    files = {spec.name: read_adapter(spec.name, adapter.path) for spec, adapter in entries}
    return stack, stack.reconcile([spec for spec, _ in entries], files)


# ----------------------------------------------------------------- reference math (float64)
def _scale(t: Tensors, rank: int) -> float:
    alpha = float(t["alpha"]) if "alpha" in t else 0.0
    return alpha / rank if alpha else 1.0


def _mat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _ref_lora(t: Tensors, w: torch.Tensor):
    up, down = _mat(t["lora_up.weight"]), t["lora_down.weight"]
    if "lora_mid.weight" in t:
        dw = torch.einsum("mnkl,im,nj->ijkl", t["lora_mid.weight"], up, _mat(down))
    else:
        dw = torch.einsum("or,ri->oi", up, _mat(down)).reshape(w.shape)
    return _scale(t, down.shape[0]) * dw, None


def _hada(t: Tensors, i: int) -> torch.Tensor:
    a, b = t[f"hada_w{i}_a"], t[f"hada_w{i}_b"]
    if f"hada_t{i}" in t:
        return torch.einsum("abkl,ap,bq->pqkl", t[f"hada_t{i}"], a, b)
    return torch.einsum("or,ri->oi", a, b)


def _ref_loha(t: Tensors, w: torch.Tensor):
    return _scale(t, t["hada_w1_b"].shape[0]) * (_hada(t, 1) * _hada(t, 2)).reshape(w.shape), None


def _kron_factor(t: Tensors, i: int) -> torch.Tensor:
    if f"lokr_w{i}" in t:
        return t[f"lokr_w{i}"]
    a, b = t[f"lokr_w{i}_a"], t[f"lokr_w{i}_b"]
    if i == 2 and "lokr_t2" in t:
        return torch.einsum("ijkl,ip,jq->pqkl", t["lokr_t2"], a, b)
    return torch.einsum("or,r...->o...", a, b)


def _ref_lokr(t: Tensors, w: torch.Tensor):
    w1, w2 = _kron_factor(t, 1), _kron_factor(t, 2)
    kron = torch.einsum("ac,bd...->abcd...", w1, w2)  # out[a·B+b, c·D+d, …] = w1[a, c]·w2[b, d, …]
    a, b, c, d = kron.shape[:4]
    decomposed = t.get("lokr_w2_b", t.get("lokr_w1_b"))
    scale = 1.0 if decomposed is None else _scale(t, decomposed.shape[0])
    return scale * kron.reshape(a * b, c * d, *w2.shape[2:]).reshape(w.shape), None


def _ref_glora(t: Tensors, w: torch.Tensor):
    a1, a2, b1, b2 = (_mat(t[f"{n}.weight"]) for n in ("a1", "a2", "b1", "b2"))
    wa = torch.einsum("oi...,ir,rj->oj...", w, a1, a2)
    b = torch.einsum("or,ri->oi", b1, b2).reshape(w.shape)
    return _scale(t, a2.shape[0]) * (wa + b), None


def _ref_glora_old(t: Tensors, w: torch.Tensor):
    a1, a2, b1, b2 = (t[f"{n}.weight"] for n in ("a1", "a2", "b1", "b2"))
    dw = torch.einsum("oi,ir,rj->oj", w, a2, a1) + torch.einsum("or,ri->oi", b2, b1)
    return _scale(t, a1.shape[0]) * dw, None


def _ref_dora(t: Tensors, w: torch.Tensor):
    merged = w + _ref_lora(t, w)[0]
    magnitude = t["dora_scale"]
    axis = 0 if magnitude.shape[0] != 1 else 1  # (out, 1, …) or a 1-D vector: rows; (1, in, …): columns
    view = [1] * w.dim()
    view[axis] = -1
    dims = tuple(d for d in range(w.dim()) if d != axis)
    norm = merged.pow(2).sum(dim=dims, keepdim=True).sqrt()
    return merged * magnitude.reshape(view) / norm - w, None


def _ref_ia3(t: Tensors, w: torch.Tensor):
    view = [1] * w.dim()
    view[1 if int(t["on_input"]) else 0] = -1
    return w * t["weight"].reshape(view), None


def _ref_oft(t: Tensors, w: torch.Tensor):
    blocks = t["oft_blocks"]
    n, b, _ = blocks.shape
    q = blocks - blocks.transpose(1, 2)
    eye = torch.eye(b, dtype=torch.float64)
    rotation = (eye + q) @ torch.linalg.inv(eye - q)  # Cayley transform, per block
    rotated = torch.einsum("knm,knx->kmx", rotation, w.reshape(n, b, -1))  # Rᵀ·W per block
    return rotated.reshape(w.shape) - w, None


REFERENCES: dict[str, Callable] = {
    "lora": _ref_lora,
    "lora_tucker": _ref_lora,
    "loha": _ref_loha,
    "loha_tucker": _ref_loha,
    "lokr": _ref_lokr,
    "lokr_factorised": _ref_lokr,
    "lokr_tucker": _ref_lokr,
    "glora": _ref_glora,
    "glora_old": _ref_glora_old,
    "dora": _ref_dora,
    "dora_in": _ref_dora,
    "full": lambda t, w: (t["diff"].reshape(w.shape), t.get("diff_b")),
    "norm": lambda t, w: (t.get("w_norm"), t.get("b_norm")),
    "ia3": _ref_ia3,
    "ia3_in": _ref_ia3,
    "oft": _ref_oft,
}


def _expected(model: TinyModel, entries: list[tuple[LoraSpec, str, object]]) -> dict[str, tuple]:
    """state-dict key -> (float64 reference, float32 slack) for every tensor the (spec, algo,
    adapter) entries change: W0 + Σ mᵢ·ΔWᵢ(W0), each ΔW from the original weight."""
    targets = dict.fromkeys(t for _, _, adapter in entries for t in adapter.layers)
    out = {}
    for component, path in targets:
        w0 = model.pristine[f"{component}.{path}.weight"].double()
        bias = model.pristine.get(f"{component}.{path}.bias")
        b0 = None if bias is None else bias.double()
        want_w, want_b, magnitude = w0.clone(), None if b0 is None else b0.clone(), [w0.abs().max()]
        ulps = FP32_ULPS
        for spec, algo, adapter in entries:
            tensors = adapter.layers.get((component, path))
            if tensors is None:
                continue
            strength = spec.strength_for(component)
            ulps = max(ulps, FP32_ULPS_BY_ALGO.get(algo, FP32_ULPS))
            dw, db = REFERENCES[algo]({k: v.double() for k, v in tensors.items()}, w0)
            if dw is not None:
                want_w += strength * dw
                magnitude.append(abs(strength) * dw.abs().max())
            if db is not None:
                want_b += strength * db
        eps = torch.finfo(F32).eps
        out[f"{component}.{path}.weight"] = (want_w, ulps * eps * float(max(magnitude)))
        if want_b is not None and not torch.equal(want_b, b0):
            out[f"{component}.{path}.bias"] = (want_b, ulps * eps * float(max(b0.abs().max(), want_b.abs().max())))
    return out


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at each value of x (float64 in, float64 out)."""
    _, exponent = torch.frexp(x)
    ulp = torch.ldexp(torch.full_like(x, torch.finfo(dtype).eps), exponent - 1)
    return torch.clamp(ulp, min=torch.finfo(dtype).tiny)


def _assert_close_to_reference(key: str, got: torch.Tensor, want: torch.Tensor, slack: float) -> None:
    """fp32: within `slack` (a few float32 ulps of the layer's magnitude). bf16: the reference
    rounded to bf16, at most one bf16 ulp away (float32 rounding can tip a value lying on a
    rounding boundary), plus the same float32 slack for values near zero."""
    if got.dtype == F32:
        err = (got.double() - want).abs().max().item()
        assert err <= slack, f"{key}: {err:.3g} off the reference, allowed {slack:.3g}"
        return
    rounded = want.to(got.dtype).double()
    excess = ((got.double() - rounded).abs() - _ulp(rounded, got.dtype)).max().item()
    assert excess <= slack, f"{key}: more than one {got.dtype} ulp off the rounded reference"


def _assert_fused(model: TinyModel, entries: list[tuple[LoraSpec, str, object]]) -> None:
    """Changed tensors match the reference; every other UNet/text-encoder tensor is bit-identical."""
    expected = _expected(model, entries)
    for key, current in model.live.items():
        original = model.pristine[key]
        assert current.dtype == original.dtype, f"{key} changed dtype"
        if key in expected:
            _assert_close_to_reference(key, current, *expected[key])
        else:
            assert torch.equal(current, original), f"{key} changed but no adapter targets it"


# ----------------------------------------------------------------------------- the writer itself
def test_writer_spells_keys_as_trainers_do_and_files_read_back_exactly(tiny, tmp_path):
    """Guards every other test here: keys look like each trainer's (kohya diffusers names on SD1.5,
    LDM names on SDXL, `lora_te*_text_model_…` text encoders, `lycoris_`, PEFT dotted A/B without
    alpha) and the file holds exactly the returned tensors, in the requested dtype."""
    cases = {
        ("sd15", "kohya"): ["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
                            "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha"],
        ("sdxl", "kohya"): ["lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q.lora_up.weight",
                            "lora_unet_middle_block_0_in_layers_2.lora_down.weight",
                            "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
                            "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.alpha"],
        ("sd15", "lycoris"): ["lycoris_down_blocks_0_resnets_0_conv1.lora_down.weight"],
        ("sdxl", "peft"): ["unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
                           "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight",
                           "text_encoder_2.text_model.encoder.layers.0.mlp.fc1.lora_A.weight"],
    }
    for (family_name, layout), keys in cases.items():
        adapter = write_adapter(tmp_path / f"{family_name}-{layout}.safetensors", tiny(family_name, F32).pipe,
                                family_name, "lora", layout, BF16, alpha=2.0)
        on_disk = load_file(adapter.path)
        assert set(keys) <= on_disk.keys(), (family_name, layout, sorted(on_disk)[:4])
        assert on_disk.keys() == adapter.tensors.keys()
        assert all(torch.equal(on_disk[k], v) and on_disk[k].dtype == BF16 for k, v in adapter.tensors.items())
        assert sum(len(t) for t in adapter.layers.values()) == len(on_disk)
        assert (layout == "peft") != any(k.endswith(".alpha") for k in on_disk)


# ------------------------------------------------------------------------ fused = the formula
@pytest.mark.parametrize("model_dtype", [F32, BF16], ids=["model_fp32", "model_bf16"])
@pytest.mark.parametrize("file_dtype", [F32, F16, BF16], ids=["file_fp32", "file_fp16", "file_bf16"])
@pytest.mark.parametrize("algo", tuple(ALGORITHMS))
def test_every_algorithm_fuses_to_the_formula_on_sd15(tiny, tmp_path, algo, file_dtype, model_dtype):
    """Every algorithm, stored in each file dtype and fused into SD1.5 in fp32 and bf16 at separate
    UNet/text-encoder strengths, equals W0 + m·ΔW from its formula: no half-precision math, no
    double scaling, no dtype change; untouched tensors keep their bits, and removal restores all."""
    model = tiny("sd15", model_dtype)
    adapter = write_adapter(tmp_path / "a.safetensors", model.pipe, "sd15", algo, "kohya", file_dtype,
                            alpha=2.0, seed=1)
    spec = LoraSpec("a", unet_weight=0.8, te_weight=-0.6)
    stack, report = _fuse(model, [(spec, adapter)])
    assert (report["a"].matched_layers, report["a"].unmatched_keys) == (len(adapter.layers), 0)
    _assert_fused(model, [(spec, algo, adapter)])
    stack.reconcile([], {})
    _assert_fused(model, [])


@pytest.mark.parametrize("family_name", ["sd15", "sdxl"])
@pytest.mark.parametrize(("layout", "algo"), [(lay, algo) for lay in LAYOUTS for algo in ("lora", "dora")])
def test_every_layout_reaches_the_same_modules(tiny, tmp_path, family_name, layout, algo):
    """kohya keys with diffusers or LDM UNet names, LyCORIS `lycoris_` keys and PEFT/diffusers dotted
    keys (unscaled, 1-D DoRA magnitude) all resolve to the intended modules of both architectures,
    text encoders included, and fuse to the formula."""
    model = tiny(family_name, F32)
    adapter = write_adapter(tmp_path / "a.safetensors", model.pipe, family_name, algo, layout, F16, alpha=2.0, seed=2)
    spec = LoraSpec("a", 0.9)
    _, report = _fuse(model, [(spec, adapter)])
    assert (report["a"].matched_layers, report["a"].unmatched_keys) == (len(adapter.layers), 0)
    assert {c for c, _ in adapter.layers} == set(COMPONENTS[family_name])
    _assert_fused(model, [(spec, algo, adapter)])


SDXL_ALGOS = ("lora", "lora_tucker", "loha", "lokr_factorised", "lokr_tucker", "glora", "dora_in", "full",
              "norm", "ia3_in", "oft")


@pytest.mark.parametrize("model_dtype", [F32, BF16], ids=["model_fp32", "model_bf16"])
@pytest.mark.parametrize("algo", SDXL_ALGOS)
def test_sdxl_adapters_with_ldm_names_fuse_to_the_formula(tiny, tmp_path, algo, model_dtype):
    """On SDXL, kohya files name UNet layers in the LDM layout (`input_blocks_3_1_…`) and the text
    encoders `lora_te1_`/`lora_te2_`; a representative set of algorithms fuses exactly there."""
    model = tiny("sdxl", model_dtype)
    adapter = write_adapter(tmp_path / "a.safetensors", model.pipe, "sdxl", algo, "kohya", BF16, alpha=3.0, seed=3)
    spec = LoraSpec("a", unet_weight=1.2, te_weight=0.7)
    _, report = _fuse(model, [(spec, adapter)])
    assert report["a"].unmatched_keys == 0
    _assert_fused(model, [(spec, algo, adapter)])


def test_glora_fp32_file_on_a_bf16_model(tiny, tmp_path):
    """LyCORIS report `expected m1 and m2 to have the same dtype`: GLoRA multiplies the model's own
    weight by the file's a1/a2, so an fp32 file on a bf16 model mixed dtypes. Both are read in
    float32 here; the fused bf16 weights equal the formula and the layers' dtype stays bf16."""
    model = tiny("sd15", BF16)
    adapter = write_adapter(tmp_path / "g.safetensors", model.pipe, "sd15", "glora", "kohya", F32, alpha=4.0)
    spec = LoraSpec("g", 1.0)
    _fuse(model, [(spec, adapter)])
    _assert_fused(model, [(spec, "glora", adapter)])
    for component, path in adapter.layers:
        fused = model.module(component, path).weight
        assert fused.dtype == BF16 and not torch.equal(fused, model.pristine[f"{component}.{path}.weight"])


@pytest.mark.parametrize("model_dtype", [F32, BF16], ids=["model_fp32", "model_bf16"])
def test_three_stacked_adapters_sum_deltas_taken_against_the_original_weight(tiny, tmp_path, model_dtype):
    """Three adapters on overlapping layers (LoRA, LoHa and the weight-dependent GLoRA) fuse to
    W0 + Σ mᵢ·ΔWᵢ(W0); removing the middle one leaves exactly the other two (recomputed from the
    backup, never by subtraction); removing all restores every bit."""
    model = tiny("sd15", model_dtype)
    plan = (("lora", 0.7, None), ("loha", -0.5, ("unet.*attn1.to_q", "unet.*resnets.0.conv1")),
            ("glora", 1.3, ("unet.*attn1.to_q", "unet.*attn2.to_k", "unet.*resnets.0.conv_shortcut")))
    entries = []
    for i, (algo, strength, targets) in enumerate(plan):
        adapter = write_adapter(tmp_path / f"{algo}.safetensors", model.pipe, "sd15", algo, "kohya", F16,
                                targets=targets, alpha=2.0, seed=10 + i)
        entries.append((LoraSpec(algo, strength), algo, adapter))
    stack, _ = _fuse(model, [(spec, adapter) for spec, _, adapter in entries])
    _assert_fused(model, entries)
    files = {spec.name: read_adapter(spec.name, adapter.path) for spec, _, adapter in entries}
    stack.reconcile([entries[0][0], entries[2][0]], files)
    _assert_fused(model, [entries[0], entries[2]])
    stack.reconcile([], {})
    _assert_fused(model, [])


def test_unmatched_keys_are_counted_and_the_rest_applies(tiny, tmp_path):
    """Layers naming modules this model lacks are skipped and counted in `MatchReport.unmatched_keys`
    in tensors (two layers of two tensors: 4), the message naming the first few; every other layer
    applies exactly."""
    model = tiny("sd15", F32)
    adapter = write_adapter(tmp_path / "a.safetensors", model.pipe, "sd15", "lora", "kohya", F32, alpha=2.0)
    strays = ("lora_unet_down_blocks_7_attentions_0_proj_in", "lora_te_text_model_encoder_layers_42_mlp_fc1")
    extra = {f"{layer}.{part}": torch.ones(4, 4) for layer in strays for part in ("lora_down.weight", "lora_up.weight")}
    save_file({**adapter.tensors, **extra}, str(adapter.path), metadata=adapter.metadata)
    spec = LoraSpec("a", 1.0)
    _, report = _fuse(model, [(spec, adapter)])
    assert (report["a"].matched_layers, report["a"].unmatched_keys) == (len(adapter.layers), 4)
    assert report["a"].unmatched_examples == tuple(sorted(extra))[:3]
    total = len(adapter.tensors) + len(extra)
    assert report["a"].total_keys == total and not report["a"].partial
    assert report["a"].message.startswith(f"4 of its {total} tensors (2 layers) matched nothing in the model, "
                                          "e.g. lora_te_")
    _assert_fused(model, [(spec, "lora", adapter)])


def test_failure_half_way_through_rolls_every_touched_layer_back(tiny, tmp_path, monkeypatch):
    """A delta that raises on its fifth layer, after earlier layers of the new list were written,
    leaves every layer bit-identical to before the call (old list re-fused, new layers restored),
    keeps the applied list, and a later removal still restores the checkpoint exactly."""
    model = tiny("sd15", BF16)
    kept = write_adapter(tmp_path / "kept.safetensors", model.pipe, "sd15", "lora", "kohya", F16, alpha=2.0, seed=4)
    new = write_adapter(tmp_path / "new.safetensors", model.pipe, "sd15", "loha", "kohya", F16, alpha=2.0, seed=5)
    files = {name: read_adapter(name, a.path) for name, a in (("kept", kept), ("new", new))}
    stack = LoraStack(model.pipe, "sd15")
    stack.reconcile([LoraSpec("kept", 1.0)], files)
    before = adapter_state_digests(model.pipe)
    calls, real_delta = [], LoHa.delta

    def failing_delta(self, *args, **kwargs):
        calls.append(self.layer)
        if len(calls) == 5:
            raise RuntimeError("injected failure")
        return real_delta(self, *args, **kwargs)

    monkeypatch.setattr(LoHa, "delta", failing_delta)
    with pytest.raises(LoraApplyError, match="injected failure"):
        stack.reconcile([LoraSpec("kept", 0.5), LoraSpec("new", 1.0)], files)
    assert len(calls) == 5
    assert adapter_state_digests(model.pipe) == before
    assert stack.applied == (LoraSpec("kept", 1.0),)
    monkeypatch.undo()
    stack.reconcile([], {})
    _assert_fused(model, [])


def test_failure_half_way_through_is_blamed_on_the_lora_that_failed(tiny, tmp_path, monkeypatch):
    """When an adapter raises while patching a layer several LoRAs share, the error (and so the
    engine's per-LoRA error counter) names the LoRA whose adapter raised, not the first LoRA in the
    list that touches that layer."""
    model = tiny("sd15", F32)
    first = write_adapter(tmp_path / "first.safetensors", model.pipe, "sd15", "lora", "kohya", F16, seed=4)
    culprit = write_adapter(tmp_path / "culprit.safetensors", model.pipe, "sd15", "loha", "kohya", F16, seed=5)
    assert first.layers.keys() == culprit.layers.keys()

    def failing_delta(self, *args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(LoHa, "delta", failing_delta)
    with pytest.raises(LoraApplyError, match="injected failure") as caught:
        _fuse(model, [(LoraSpec("first"), first), (LoraSpec("culprit"), culprit)])
    assert caught.value.lora_name == "culprit"


def test_reordering_the_list_gives_the_bits_of_a_fresh_fuse_in_that_order(tiny, tmp_path):
    """The fused weights must depend on the list, not on the path to it. Listing the same LoRAs in
    another order rewrites nothing (no strength changed), so the result must already equal a fresh
    fuse of the new order: the sum has to be taken in an order the list's order cannot change."""
    model = tiny("sd15", F32)
    adapters = {name: write_adapter(tmp_path / f"{name}.safetensors", model.pipe, "sd15", algo, "kohya", F16, seed=i)
                for i, (name, algo) in enumerate((("a", "lora"), ("c", "loha")))}
    files = {name: read_adapter(name, adapter.path) for name, adapter in adapters.items()}
    a, c = LoraSpec("a", 0.7), LoraSpec("c", 0.9)
    stack = LoraStack(model.pipe, "sd15")
    stack.reconcile([a, c], files)
    stack.reconcile([c, a], files)
    by_path = adapter_state_digests(model.pipe)
    stack.reconcile([], {})
    LoraStack(model.pipe, "sd15").reconcile([c, a], files)
    assert by_path == adapter_state_digests(model.pipe)


# ------------------------------------------------------------------ refusals through the engine
def _assert_refused_cleanly(engine: Engine, before: dict[str, str], message: str) -> None:
    """The refusal changed no weight bit, kept the applied list, and left the engine READY."""
    snap = engine.snapshot()
    assert snap.state == EngineState.READY.value
    assert snap.history[-1].outcome == "failed, rolled back"
    assert message in snap.last_error.message
    assert snap.loras == ()
    assert adapter_state_digests(engine.pipeline) == before


@pytest.mark.parametrize(("lora_arch", "model_family"), [("sdxl", "sd15"), ("sd15", "sdxl")])
def test_lora_for_the_other_architecture_is_refused_whole(engine, tiny, lora_arch, model_family):
    """An SDXL LoRA on SD1.5, and an SD1.5 LoRA on SDXL, are refused with a message naming both
    architectures (cross-attention widths differ), before any weight is written."""
    lora_dir = engine.settings.lora_dir
    write_adapter(lora_dir / "other.safetensors", tiny(lora_arch, F32).pipe, lora_arch, "lora", "kohya", F16)
    engine.load_model(CHECKPOINTS[model_family])
    before = adapter_state_digests(engine.pipeline)
    pattern = rf"does not fit this {model_family.upper()} model \(it looks made for {lora_arch.upper()}\)"
    with pytest.raises(LoraApplyError, match=pattern) as caught:
        engine.set_loras([LoraSpec("other")])
    _assert_refused_cleanly(engine, before, str(caught.value))
    assert engine.snapshot().lora_counters["other"].apply_errors == 1


def test_lora_for_the_other_architecture_is_refused_even_where_its_shapes_fit(engine, tiny):
    """An SDXL LoCon touching only the first level's resnet convs (32 channels in both tiny models,
    320 in both real ones) fits SD1.5 shape for shape; its metadata and `lora_te1_`/`lora_te2_`
    keys say SDXL. Fusing SDXL-trained deltas into SD1.5 layers that merely share a name is
    garbage, so the LoRA must be refused, not half-applied with its text-encoder keys unmatched."""
    targets = ("unet.down_blocks.0.resnets.0.conv[12]", "text_encoder*.layers.0.self_attn.q_proj")
    write_adapter(engine.settings.lora_dir / "xl.safetensors", tiny("sdxl", F32).pipe, "sdxl", "lora", "kohya", F16,
                  targets=targets)
    engine.load_model(CHECKPOINTS["sd15"])
    before = adapter_state_digests(engine.pipeline)
    with pytest.raises(LoraApplyError, match="SDXL") as caught:
        engine.set_loras([LoraSpec("xl")])
    _assert_refused_cleanly(engine, before, str(caught.value))


def _valid(path, pipe) -> dict[str, torch.Tensor]:
    return write_adapter(path, pipe, "sd15", "lora", "kohya", F16, alpha=2.0).tensors


def _truncated(path, pipe) -> None:
    _valid(path, pipe)
    path.write_bytes(path.read_bytes()[:-64])


def _lying_header(path, pipe) -> None:
    """The JSON header claims a shape the tensor's byte range cannot hold."""
    _valid(path, pipe)
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    key = _first(header, "lora_down.weight")
    header[key]["shape"] = [d + 1 for d in header[key]["shape"]]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size :])


def _rewritten(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable:
    """A valid file whose tensors `edit` changes in place before it is saved again."""

    def build(path, pipe) -> None:
        tensors = _valid(path, pipe)
        edit(tensors)
        save_file(tensors, str(path))

    return build


def _first(keyed: dict, suffix: str) -> str:
    return next(k for k in sorted(keyed) if k.endswith(suffix))


def _with_nan(tensors) -> None:
    tensors[_first(tensors, "lora_up.weight")][0, 0] = float("nan")


def _with_rank_mismatch(tensors) -> None:
    key = _first(tensors, "lora_down.weight")
    tensors[key] = tensors[key][:-1].clone()


def _with_unknown_algorithm(tensors) -> None:
    layer = _first(tensors, "lora_down.weight").removesuffix(".lora_down.weight")
    for suffix in ("lora_down.weight", "lora_up.weight", "alpha"):
        del tensors[f"{layer}.{suffix}"]
    tensors[f"{layer}.boft_blocks"] = torch.zeros(2, 4, 4)


def _with_bias_on_a_biasless_layer(tensors) -> None:
    """A Full adapter whose `diff_b` targets attn1.to_q, which has no bias: caught at write time."""
    layer = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    for suffix in ("lora_down.weight", "lora_up.weight", "alpha"):
        del tensors[f"{layer}.{suffix}"]
    tensors[f"{layer}.diff"] = torch.full((32, 32), 0.01)
    tensors[f"{layer}.diff_b"] = torch.full((32,), 0.01)


CORRUPT = {
    "truncated": (_truncated, "file not fully covered"),
    "zero_bytes": (lambda path, pipe: path.write_bytes(b""), "the file is empty"),
    "renamed_pickle": (lambda path, pipe: torch.save(_valid(path, pipe), path), "pickled PyTorch checkpoint"),
    "header_lies_about_shape": (_lying_header, "invalid shape"),
    "nan_tensor": (_rewritten(_with_nan), "contains NaN or Inf"),
    "rank_mismatch": (_rewritten(_with_rank_mismatch), "rank mismatch"),
    "unknown_algorithm": (_rewritten(_with_unknown_algorithm), "unrecognised adapter keys ['boft_blocks']"),
    "bias_on_biasless_layer": (_rewritten(_with_bias_on_a_biasless_layer), "changes a bias but the layer has none"),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_corrupt_adapter_is_refused_and_changes_nothing(engine, tiny, case):
    """Each way a LoRA file can be broken is refused with a message saying which way, naming the
    file or layer; with another LoRA already fused, every weight keeps its bits and the engine
    stays READY with the previous LoRA list."""
    build, message = CORRUPT[case]
    write_adapter(engine.settings.lora_dir / "good.safetensors", tiny("sd15", F32).pipe, "sd15", "loha", "kohya",
                  F16, seed=7)
    build(engine.settings.lora_dir / "broken.safetensors", tiny("sd15", F32).pipe)
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([LoraSpec("good", 0.8)])
    before = adapter_state_digests(engine.pipeline)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.set_loras([LoraSpec("good", 0.8), LoraSpec("broken")])
    snap = engine.snapshot()
    assert snap.state == EngineState.READY.value
    assert snap.history[-1].outcome == "failed, rolled back" and message in snap.last_error.message
    assert "broken" in snap.last_error.message
    assert snap.loras == (LoraSpec("good", 0.8),)
    assert adapter_state_digests(engine.pipeline) == before


def test_unreadable_lora_file_counts_against_that_lora(engine):
    """Diagnostics keep per-LoRA error counts (SD.Next's per-network errors): a LoRA whose file
    cannot even be read must show up there too, not only in the engine's last error."""
    (engine.settings.lora_dir / "empty.safetensors").write_bytes(b"")
    engine.load_model(CHECKPOINTS["sd15"])
    with pytest.raises(ValueError, match="the file is empty"):
        engine.set_loras([LoraSpec("empty")])
    counters = engine.snapshot().lora_counters
    assert "empty" in counters and counters["empty"].apply_errors == 1
