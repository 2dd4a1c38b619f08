"""Delta-weight math of every LoRA-family algorithm (app/adapters/algos/).

Every ΔW is checked against a reference written here straight from the published formula, in
float64 with einsum or explicit loops, never through the module's own helpers. The main matrix
runs each algorithm variant × base layer kind × adapter dtype × base weight dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app.adapters.algos import (
    IA3,
    OFT,
    Adapter,
    DoRA,
    Full,
    GLoRA,
    LoHa,
    LoKr,
    LoRA,
    Norm,
    parse_layer,
)
from app.adapters.errors import AdapterError, AdapterFormatError, IncompatibleAdapterError

OUT, IN, RANK = 12, 8, 4  # 12 = 3·4 and 8 = 2·4 so LoKr and OFT can split them
KINDS = {"linear": (OUT, IN), "conv3x3": (OUT, IN, 3, 3), "conv1x1": (OUT, IN, 1, 1)}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Both the code and the reference start from the very same stored (fp16/bf16) values, so the
# tolerance only has to absorb float32 accumulation. It is float32-tight for every dtype on
# purpose: a tolerance sized for half precision would let a half-precision compute path pass.
TOL = {F32: 1e-5, F16: 1e-5, BF16: 1e-5}
LAYER = "lora_unet_down_blocks_0_attentions_0_proj_in"

Tensors = dict[str, torch.Tensor]


def _gen(seed: int) -> Callable[..., torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, scale=1.0: torch.randn(*shape, generator=g) * scale


def _alpha(t: Tensors) -> float | None:
    return float(t["alpha"].double()) if "alpha" in t else None


# ------------------------------------------------------------------ variants: tensors + reference
# Each builder takes (kind, randn) and returns the fp32 suffix dict and a float64 reference
# reference(tensors64, W64) -> (ΔW, Δb). `tensors64` holds the values as stored (after the
# dtype cast under test), so both sides see identical inputs.


def lora(kind, rnd):
    down = rnd(RANK, IN, 3, 3) if kind == "conv3x3" else rnd(RANK, IN)
    up = rnd(OUT, RANK, 1, 1) if kind == "conv3x3" else rnd(OUT, RANK)
    tensors = {"lora_down.weight": down, "lora_up.weight": up, "alpha": torch.tensor(2.0)}

    def ref(t, w):
        d = t["lora_down.weight"].reshape(RANK, -1)
        u = t["lora_up.weight"].reshape(OUT, RANK)
        return torch.einsum("or,rj->oj", u, d).reshape(w.shape) * (_alpha(t) / RANK), None

    return tensors, ref


def lora_tucker(kind, rnd):
    tensors = {
        "lora_down.weight": rnd(RANK, IN, 1, 1),
        "lora_mid.weight": rnd(RANK, RANK, 3, 3),
        "lora_up.weight": rnd(OUT, RANK, 1, 1),
        "alpha": torch.tensor(3.0),
    }

    def ref(t, w):
        d, m, u = t["lora_down.weight"][:, :, 0, 0], t["lora_mid.weight"], t["lora_up.weight"][:, :, 0, 0]
        dw = torch.zeros(OUT, IN, 3, 3, dtype=torch.float64)
        for kh in range(3):
            for kw in range(3):
                dw[:, :, kh, kw] = u @ m[:, :, kh, kw] @ d
        return dw * (_alpha(t) / RANK), None

    return tensors, ref


def loha(kind, rnd):
    cols = IN * 9 if kind == "conv3x3" else IN  # LyCORIS stores conv factors flattened
    tensors = {
        "hada_w1_a": rnd(OUT, RANK),
        "hada_w1_b": rnd(RANK, cols),
        "hada_w2_a": rnd(OUT, RANK),
        "hada_w2_b": rnd(RANK, cols),
        "alpha": torch.tensor(2.0),
    }

    def ref(t, w):
        first = t["hada_w1_a"] @ t["hada_w1_b"]
        second = t["hada_w2_a"] @ t["hada_w2_b"]
        return (first * second).reshape(w.shape) * (_alpha(t) / RANK), None

    return tensors, ref


def loha_tucker(kind, rnd):
    tensors = {
        "hada_t1": rnd(RANK, RANK, 3, 3),
        "hada_w1_a": rnd(RANK, OUT),
        "hada_w1_b": rnd(RANK, IN),
        "hada_t2": rnd(RANK, RANK, 3, 3),
        "hada_w2_a": rnd(RANK, OUT),
        "hada_w2_b": rnd(RANK, IN),
        "alpha": torch.tensor(1.0),
    }

    def ref(t, w):
        def rebuild(i):
            return torch.einsum("abkl,ap,bq->pqkl", t[f"hada_t{i}"], t[f"hada_w{i}_a"], t[f"hada_w{i}_b"])

        return rebuild(1) * rebuild(2) * (_alpha(t) / RANK), None

    return tensors, ref


def _kron_reference(w1: torch.Tensor, w2: torch.Tensor, shape) -> torch.Tensor:
    """Kronecker product by its definition: out[a·B + b, c·D + d, …] = w1[a, c] · w2[b, d, …]."""
    a, c = w1.shape
    b, d = w2.shape[:2]
    return torch.einsum("ac,bd...->abcd...", w1, w2).reshape(a * b, c * d, *w2.shape[2:]).reshape(shape)


def _lokr_w2(kind, rnd):
    return rnd(4, 4, 3, 3) if kind == "conv3x3" else rnd(4, 4)


def lokr_full(kind, rnd):
    # alpha present but no decomposed factor: scale must stay 1.
    tensors = {"lokr_w1": rnd(3, 2), "lokr_w2": _lokr_w2(kind, rnd), "alpha": torch.tensor(7.0)}

    def ref(t, w):
        return _kron_reference(t["lokr_w1"], t["lokr_w2"], w.shape), None

    return tensors, ref


def lokr_w2_low_rank(kind, rnd):
    w2_b = rnd(2, 4, 3, 3) if kind == "conv3x3" else rnd(2, 4)
    tensors = {"lokr_w1": rnd(3, 2), "lokr_w2_a": rnd(4, 2), "lokr_w2_b": w2_b, "alpha": torch.tensor(1.0)}

    def ref(t, w):
        b = t["lokr_w2_b"]
        w2 = (t["lokr_w2_a"] @ b.reshape(2, -1)).reshape(4, *b.shape[1:])
        return _kron_reference(t["lokr_w1"], w2, w.shape) * (_alpha(t) / 2), None

    return tensors, ref


def lokr_both_low_rank(kind, rnd):
    w2_b = rnd(2, 4, 3, 3) if kind == "conv3x3" else rnd(2, 4)
    tensors = {
        "lokr_w1_a": rnd(3, 2),
        "lokr_w1_b": rnd(2, 2),
        "lokr_w2_a": rnd(4, 2),
        "lokr_w2_b": w2_b,
        "alpha": torch.tensor(4.0),
    }

    def ref(t, w):
        b = t["lokr_w2_b"]
        w1 = t["lokr_w1_a"] @ t["lokr_w1_b"]
        w2 = (t["lokr_w2_a"] @ b.reshape(2, -1)).reshape(4, *b.shape[1:])
        return _kron_reference(w1, w2, w.shape) * (_alpha(t) / 2), None

    return tensors, ref


def lokr_tucker(kind, rnd):
    tensors = {
        "lokr_w1": rnd(3, 2),
        "lokr_t2": rnd(2, 2, 3, 3),
        "lokr_w2_a": rnd(2, 4),
        "lokr_w2_b": rnd(2, 4),
        "alpha": torch.tensor(1.0),
    }

    def ref(t, w):
        w2 = torch.einsum("ijkl,ip,jq->pqkl", t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])
        return _kron_reference(t["lokr_w1"], w2, w.shape) * (_alpha(t) / 2), None

    return tensors, ref


def glora(kind, rnd):
    b2 = rnd(RANK, IN, 3, 3) if kind == "conv3x3" else rnd(RANK, IN)
    conv = kind == "conv3x3"
    tensors = {
        "a1.weight": rnd(IN, RANK, 1, 1) if conv else rnd(IN, RANK),
        "a2.weight": rnd(RANK, IN, 1, 1) if conv else rnd(RANK, IN),
        "b1.weight": rnd(OUT, RANK, 1, 1) if conv else rnd(OUT, RANK),
        "b2.weight": b2,
        "alpha": torch.tensor(2.0),
    }

    def ref(t, w):
        a1, a2 = t["a1.weight"].reshape(IN, RANK), t["a2.weight"].reshape(RANK, IN)
        w3 = w.reshape(OUT, IN, -1)
        wa = torch.stack([w3[:, :, k] @ a1 @ a2 for k in range(w3.shape[2])], dim=2).reshape(w.shape)
        b = (t["b1.weight"].reshape(OUT, RANK) @ t["b2.weight"].reshape(RANK, -1)).reshape(w.shape)
        return (wa + b) * (_alpha(t) / RANK), None

    return tensors, ref


def glora_old(kind, rnd):
    tensors = {
        "a1.weight": rnd(RANK, IN),
        "a2.weight": rnd(IN, RANK),
        "b1.weight": rnd(RANK, IN),
        "b2.weight": rnd(OUT, RANK),
        "alpha": torch.tensor(2.0),
    }

    def ref(t, w):
        w2 = w.reshape(OUT, IN)
        dw = w2 @ t["a2.weight"] @ t["a1.weight"] + t["b2.weight"] @ t["b1.weight"]
        return dw.reshape(w.shape) * (_alpha(t) / RANK), None

    return tensors, ref


def glora_tucker(kind, rnd):
    tensors = {
        "a1.weight": rnd(IN, RANK, 1, 1),
        "a2.weight": rnd(RANK, IN, 1, 1),
        "b1.weight": rnd(OUT, RANK, 1, 1),
        "bm.weight": rnd(RANK, RANK, 3, 3),
        "b2.weight": rnd(RANK, IN, 1, 1),
        "alpha": torch.tensor(2.0),
    }

    def ref(t, w):
        a1, a2 = t["a1.weight"][:, :, 0, 0], t["a2.weight"][:, :, 0, 0]
        b1, b2 = t["b1.weight"][:, :, 0, 0], t["b2.weight"][:, :, 0, 0]
        dw = torch.zeros_like(w)
        for kh in range(3):
            for kw in range(3):
                dw[:, :, kh, kw] = w[:, :, kh, kw] @ a1 @ a2 + b1 @ t["bm.weight"][:, :, kh, kw] @ b2
        return dw * (_alpha(t) / RANK), None

    return tensors, ref


def full(kind, rnd):
    tensors = {"diff": rnd(*KINDS[kind]), "diff_b": rnd(OUT)}
    return tensors, lambda t, w: (t["diff"], t["diff_b"])


def _ia3(on_input: bool):
    def build(kind, rnd):
        n = IN if on_input else OUT
        vec = rnd(1, n, *([1] * (len(KINDS[kind]) - 2))) if kind != "linear" else rnd(n)
        tensors = {"weight": vec, "on_input": torch.tensor(int(on_input))}

        def ref(t, w):
            v = t["weight"].reshape(-1)
            dw = torch.empty_like(w)
            for i in range(w.shape[0]):
                for j in range(w.shape[1]):
                    dw[i, j] = w[i, j] * (v[j] if on_input else v[i])
            return dw, None

        return tensors, ref

    return build


def _oft_reference(blocks, w, constraint=None, rescale=None):
    n, b, _ = blocks.shape
    q = blocks - blocks.transpose(1, 2)
    if constraint is not None and q.norm() > constraint:
        q = q * (constraint / q.norm())
    eye = torch.eye(b, dtype=torch.float64)
    w2 = w.reshape(OUT, -1)
    rotated = torch.empty_like(w2)
    for k in range(n):
        r = (eye + q[k]) @ torch.inverse(eye - q[k])
        rotated[k * b : (k + 1) * b] = r.T @ w2[k * b : (k + 1) * b]
    if rescale is not None:
        rotated = rotated * rescale.reshape(OUT, 1)
    return rotated.reshape(w.shape) - w


def oft(kind, rnd):
    tensors = {"oft_blocks": rnd(3, 4, 4, scale=0.3)}
    return tensors, lambda t, w: (_oft_reference(t["oft_blocks"], w), None)


def oft_constrained(kind, rnd):
    # ‖Q‖ is about 3 here; alpha · out_dim = 0.1 · 12 = 1.2 clamps it.
    tensors = {
        "oft_blocks": rnd(3, 4, 4, scale=0.3),
        "alpha": torch.tensor(0.1),
        "rescale": 1 + rnd(OUT, *([1] * (len(KINDS[kind]) - 1)), scale=0.1),
    }

    def ref(t, w):
        return _oft_reference(t["oft_blocks"], w, _alpha(t) * OUT, t["rescale"]), None

    return tensors, ref


def _dora(axis: str, inner: Callable = lora):
    def build(kind, rnd):
        tensors, inner_ref = inner(kind, rnd)
        n_dims = len(KINDS[kind])
        shape = (OUT, *[1] * (n_dims - 1)) if axis == "out" else (1, IN, *[1] * (n_dims - 2))
        tensors["dora_scale"] = rnd(*shape).abs() + 0.5

        def ref(t, w):
            merged = w + inner_ref(t, w)[0]
            dims = tuple(range(1, w.dim())) if axis == "out" else (0, *range(2, w.dim()))
            norm = merged.pow(2).sum(dim=dims, keepdim=True).sqrt()
            return merged * t["dora_scale"].reshape(norm.shape) / norm - w, None

        return tensors, ref

    return build


ALL_KINDS = tuple(KINDS)
VARIANTS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "lora": (lora, ALL_KINDS),
    "lora_tucker": (lora_tucker, ("conv3x3",)),
    "loha": (loha, ALL_KINDS),
    "loha_tucker": (loha_tucker, ("conv3x3",)),
    "lokr_full": (lokr_full, ALL_KINDS),
    "lokr_w2_low_rank": (lokr_w2_low_rank, ALL_KINDS),
    "lokr_both_low_rank": (lokr_both_low_rank, ALL_KINDS),
    "lokr_tucker": (lokr_tucker, ("conv3x3",)),
    "glora": (glora, ALL_KINDS),
    "glora_old": (glora_old, ("linear", "conv1x1")),
    "glora_tucker": (glora_tucker, ("conv3x3",)),
    "full": (full, ALL_KINDS),
    "ia3_out": (_ia3(False), ALL_KINDS),
    "ia3_in": (_ia3(True), ALL_KINDS),
    "oft": (oft, ALL_KINDS),
    "oft_constrained": (oft_constrained, ALL_KINDS),
    "dora_out": (_dora("out"), ALL_KINDS),
    "dora_in": (_dora("in"), ALL_KINDS),
    "dora_loha": (_dora("out", loha), ALL_KINDS),
    "dora_lokr": (_dora("in", lokr_both_low_rank), ALL_KINDS),
    "dora_glora": (_dora("out", glora), ALL_KINDS),
}
CASES = [(v, k) for v, (_, kinds) in VARIANTS.items() for k in kinds]


def _cast(tensors: Tensors, dtype: torch.dtype) -> Tensors:
    """Store the adapter as a file of `dtype` would: floating tensors cast, flags left alone."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def _build(variant: str, kind: str, adapter_dtype=F32, base_dtype=F32, seed=0):
    builder, _ = VARIANTS[variant]
    rnd = _gen(seed)
    tensors, ref = builder(kind, rnd)
    stored = _cast(tensors, adapter_dtype)
    base = rnd(*KINDS[kind]).to(base_dtype)
    return stored, ref, base


def _assert_matches(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.dtype == F32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


# ------------------------------------------------------------------------------------ the matrix
@pytest.mark.parametrize("base_dtype", [F32, BF16], ids=["base_fp32", "base_bf16"])
@pytest.mark.parametrize("adapter_dtype", [F32, F16, BF16], ids=["ad_fp32", "ad_fp16", "ad_bf16"])
@pytest.mark.parametrize(("variant", "kind"), CASES, ids=[f"{v}-{k}" for v, k in CASES])
def test_delta_matches_reference(variant, kind, adapter_dtype, base_dtype):
    """ΔW (and Δb) of every algorithm equals the formula's float64 value, in float32, shaped like
    the base weight, whatever the file's dtype and the model's dtype (no half-precision math)."""
    stored, ref, base = _build(variant, kind, adapter_dtype, base_dtype)
    base_bias = torch.zeros(OUT, dtype=base_dtype)
    delta = parse_layer(LAYER, stored).delta(base, base_bias)
    want_w, want_b = ref({k: v.double() for k, v in stored.items()}, base.double())
    _assert_matches(delta.weight, want_w, TOL[adapter_dtype])
    assert delta.weight.shape == base.shape
    if want_b is None:
        assert delta.bias is None
    else:
        _assert_matches(delta.bias, want_b, TOL[adapter_dtype])


@pytest.mark.parametrize(("variant", "kind"), CASES, ids=[f"{v}-{k}" for v, k in CASES])
def test_accumulate_adds_strength_times_delta_in_place(variant, kind):
    """`accumulate` (what the patcher sums with; LoRA's is one fused multiply-add) adds m·ΔW into the
    float32 accumulator in place and hands back Δb at strength 1, as `delta` computes them."""
    stored, _, base = _build(variant, kind, BF16, BF16)
    adapter, bias = parse_layer(LAYER, stored), torch.zeros(OUT, dtype=BF16)
    delta = adapter.delta(base, bias)
    acc = base.float()
    storage = acc.data_ptr()
    bias_delta = adapter.accumulate(acc, base.float(), bias.float(), -0.7)
    assert acc.data_ptr() == storage and acc.dtype == F32
    torch.testing.assert_close(acc, base.float() - 0.7 * delta.weight, rtol=1e-5, atol=1e-5)
    assert (bias_delta is None) == (delta.bias is None)
    if bias_delta is not None:
        assert torch.equal(bias_delta, delta.bias)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reads_base_is_set_exactly_where_delta_depends_on_the_weight_values(variant):
    """The patcher hands algorithms without `reads_base` its accumulator as W0 (already holding other
    adapters' sums): that is only sound if their ΔW ignores W0's values, so the flag must match."""
    kind = VARIANTS[variant][1][0]
    stored, _, base = _build(variant, kind)
    adapter = parse_layer(LAYER, stored)
    bias = torch.zeros(OUT)
    depends = not torch.equal(adapter.delta(base, bias).weight, adapter.delta(base * 3 + 1, bias).weight)
    assert adapter.reads_base == depends, (variant, adapter.reads_base)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_to_moves_every_tensor_and_keeps_the_file_dtype(variant):
    """`Adapter.to` (the one upload per LoRA) moves every tensor, a DoRA's inner adapter's included,
    keeps each tensor's dtype and the algorithm, and leaves the original where it was."""
    kind = VARIANTS[variant][1][0]
    stored, _, _ = _build(variant, kind, F16)
    adapter = parse_layer(LAYER, stored)
    moved = adapter.to(torch.device("meta"))

    def tensors(a) -> list[torch.Tensor]:
        found = []
        for f in dataclasses.fields(a):
            value = getattr(a, f.name)
            if isinstance(value, Adapter):
                found += tensors(value)
            elif isinstance(value, torch.Tensor):
                found.append(value)
        return found

    assert type(moved) is type(adapter) and moved.layer == adapter.layer
    assert [t.dtype for t in tensors(moved)] == [t.dtype for t in tensors(adapter)] and tensors(adapter)
    assert all(t.is_meta for t in tensors(moved)) and not any(t.is_meta for t in tensors(adapter))


def test_variants_are_parsed_as_the_intended_algorithm():
    """The registry picks the class each key set was written by (guards the matrix above)."""
    expected = {
        "lora": LoRA, "lora_tucker": LoRA, "loha": LoHa, "loha_tucker": LoHa, "lokr_full": LoKr,
        "lokr_w2_low_rank": LoKr, "lokr_both_low_rank": LoKr, "lokr_tucker": LoKr, "glora": GLoRA,
        "glora_old": GLoRA, "glora_tucker": GLoRA, "full": Full, "ia3_out": IA3, "ia3_in": IA3,
        "oft": OFT, "oft_constrained": OFT, "dora_out": DoRA, "dora_in": DoRA, "dora_loha": DoRA,
        "dora_lokr": DoRA, "dora_glora": DoRA,
    }  # fmt: skip
    for variant, kind in CASES:
        assert type(parse_layer(LAYER, _build(variant, kind)[0])) is expected[variant], (variant, kind)


def test_registry_marker_sets_are_disjoint():
    """No key set can be claimed by two algorithms, so parse_layer never depends on order."""
    from app.adapters.algos import _ALGORITHMS

    seen: set[str] = set()
    for algo in _ALGORITHMS:
        assert not (algo.markers & seen), algo.algo
        assert algo.markers <= algo.keys
        seen |= algo.markers


# ------------------------------------------------------------------------------------ scale/alpha
def test_alpha_absent_means_scale_one():
    """No `alpha` key: ΔW is the plain product (scale 1), not alpha/rank with some default."""
    rnd = _gen(1)
    down, up, w = rnd(RANK, IN), rnd(OUT, RANK), rnd(OUT, IN)
    got = parse_layer(LAYER, {"lora_down.weight": down, "lora_up.weight": up}).delta(w).weight
    _assert_matches(got, up.double() @ down.double(), 1e-5)
    loha_t = {
        "hada_w1_a": rnd(OUT, 2),
        "hada_w1_b": rnd(2, IN),
        "hada_w2_a": rnd(OUT, 2),
        "hada_w2_b": rnd(2, IN),
    }
    want = (loha_t["hada_w1_a"] @ loha_t["hada_w1_b"]) * (loha_t["hada_w2_a"] @ loha_t["hada_w2_b"])
    _assert_matches(parse_layer(LAYER, loha_t).delta(w).weight, want.double(), 1e-5)


def test_alpha_zero_means_scale_one():
    """alpha = 0 is what kohya/LyCORIS write for "alpha = rank": scale 1, not a zero delta."""
    rnd = _gen(2)
    down, up, w = rnd(RANK, IN), rnd(OUT, RANK), rnd(OUT, IN)
    t = {"lora_down.weight": down, "lora_up.weight": up, "alpha": torch.tensor(0.0)}
    _assert_matches(parse_layer(LAYER, t).delta(w).weight, up.double() @ down.double(), 1e-5)


@pytest.mark.parametrize("alpha_dtype", [BF16, F16, torch.int64])
def test_zero_dim_low_precision_alpha(alpha_dtype):
    """A 0-dim bf16/fp16 (or integer) alpha is read as a number: scale = alpha / rank."""
    rnd = _gen(3)
    down, up, w = rnd(RANK, IN), rnd(OUT, RANK), rnd(OUT, IN)
    alpha = torch.tensor(3, dtype=alpha_dtype)
    adapter = parse_layer(LAYER, {"lora_down.weight": down, "lora_up.weight": up, "alpha": alpha})
    assert adapter.alpha == 3.0
    _assert_matches(adapter.delta(w).weight, (up.double() @ down.double()) * 3 / RANK, 1e-5)


def test_loha_and_lokr_are_scaled_once():
    """alpha ≠ rank: LoHa/LoKr ΔW carries alpha/rank exactly once (LyCORIS's merge squares it)."""
    rnd = _gen(4)
    w = rnd(OUT, IN)
    t = {"hada_w1_a": rnd(OUT, 2), "hada_w1_b": rnd(2, IN), "hada_w2_a": rnd(OUT, 2), "hada_w2_b": rnd(2, IN)}
    plain = parse_layer(LAYER, t).delta(w).weight
    scaled = parse_layer(LAYER, {**t, "alpha": torch.tensor(8.0)}).delta(w).weight
    torch.testing.assert_close(scaled, plain * 4)
    k = {"lokr_w1": rnd(3, 2), "lokr_w2_a": rnd(4, 2), "lokr_w2_b": rnd(2, 4)}
    plain = parse_layer(LAYER, k).delta(w).weight
    scaled = parse_layer(LAYER, {**k, "alpha": torch.tensor(8.0)}).delta(w).weight
    torch.testing.assert_close(scaled, plain * 4)


# ------------------------------------------------------------------------------- dtype and device
def test_glora_fp32_adapter_on_bf16_base_returns_float32():
    """The LyCORIS "expected m1 and m2 to have the same dtype" report: GLoRA's W-dependent term
    must upcast the bf16 base weight, not multiply bf16 by fp32."""
    stored, ref, base = _build("glora", "linear", F32, BF16)
    delta = parse_layer(LAYER, stored).delta(base)
    assert base.dtype == BF16 and delta.weight.dtype == F32
    _assert_matches(delta.weight, ref({k: v.double() for k, v in stored.items()}, base.double())[0], 1e-5)


def test_adapter_tensors_keep_file_dtype_until_calculation():
    """Parsing and computing never converts the stored tensors: they stay the file's objects."""
    stored, _, base = _build("lora", "conv3x3", BF16, F32)
    adapter = parse_layer(LAYER, stored)
    adapter.delta(base)
    assert adapter.down is stored["lora_down.weight"] and adapter.down.dtype == BF16


def test_delta_does_not_track_gradients_of_a_parameter_base():
    """A Parameter base weight must not make ΔW hold an autograd graph (memory, in-place writes)."""
    stored, _, base = _build("glora", "linear")
    delta = parse_layer(LAYER, stored).delta(torch.nn.Parameter(base))
    assert not delta.weight.requires_grad and delta.weight.grad_fn is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["lora", "glora", "dora_in", "oft_constrained", "lokr_tucker"])
def test_delta_lands_on_the_base_weight_device(variant):
    """A CPU-held fp16 file patched into a CUDA bf16 weight yields a CUDA float32 ΔW equal to the
    CPU result: adapter tensors follow the weight, never the other way round."""
    kind = "conv3x3" if variant == "lokr_tucker" else "linear"
    stored, _, base = _build(variant, kind, F16, BF16)
    adapter = parse_layer(LAYER, stored)
    on_gpu = adapter.delta(base.cuda(), torch.zeros(OUT, dtype=BF16, device="cuda")).weight
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == F32
    torch.testing.assert_close(on_gpu.cpu(), adapter.delta(base).weight, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ conv shapes
def test_linear_adapter_on_1x1_conv_and_back():
    """SD1.5's proj_in is a 1×1 conv, SDXL's a linear: 2-D LoRA matrices patch a 1×1 conv and
    1×1-kernel LoRA tensors patch a linear, with the same values."""
    rnd = _gen(5)
    down, up = rnd(RANK, IN), rnd(OUT, RANK)
    want = up.double() @ down.double()
    flat = parse_layer(LAYER, {"lora_down.weight": down, "lora_up.weight": up})
    conv = parse_layer(
        LAYER, {"lora_down.weight": down[:, :, None, None], "lora_up.weight": up[:, :, None, None]}
    )
    _assert_matches(flat.delta(rnd(OUT, IN, 1, 1)).weight, want[:, :, None, None], 1e-5)
    _assert_matches(conv.delta(rnd(OUT, IN)).weight, want, 1e-5)


def test_conv_kernel_mismatch_is_incompatible():
    """A 3×3 LoCon cannot land on a 1×1 conv or a 1×3 kernel even with equal element counts."""
    rnd = _gen(6)
    adapter = parse_layer(
        LAYER, {"lora_down.weight": rnd(RANK, IN, 3, 3), "lora_up.weight": rnd(OUT, RANK, 1, 1)}
    )
    with pytest.raises(IncompatibleAdapterError, match="expected"):
        adapter.validate_against((OUT, IN, 1, 1))
    with pytest.raises(IncompatibleAdapterError):
        adapter.validate_against((OUT, IN * 3, 1, 3))


def test_lokr_flattened_w2_must_hold_whole_kernels():
    """A (b, d·kh·kw) LoKr w2 is accepted on a 3×3 conv, but not when its columns are not whole
    kernels (the reshape would scramble input channels with kernel taps)."""
    rnd = _gen(7)
    good = parse_layer(LAYER, {"lokr_w1": rnd(3, 2), "lokr_w2": rnd(4, 4 * 9)})
    good.validate_against((OUT, IN, 3, 3))
    bad = parse_layer(LAYER, {"lokr_w1": rnd(3, 6), "lokr_w2": rnd(4, 12)})  # 6·12 = 8·9, but 12 % 9 ≠ 0
    with pytest.raises(IncompatibleAdapterError, match="kernel size 9"):
        bad.validate_against((OUT, IN, 3, 3))


# ------------------------------------------------------------------------------------------ GLoRA
def _glora_tensors(rnd, out, inp, rank, old):
    if old:
        return {"a1.weight": rnd(rank, inp), "a2.weight": rnd(inp, rank), "b1.weight": rnd(rank, inp),
                "b2.weight": rnd(out, rank)}  # fmt: skip
    return {"a1.weight": rnd(inp, rank), "a2.weight": rnd(rank, inp), "b1.weight": rnd(out, rank),
            "b2.weight": rnd(rank, inp)}  # fmt: skip


@pytest.mark.parametrize(("out", "inp"), [(OUT, IN), (IN, IN)], ids=["rectangular", "square"])
@pytest.mark.parametrize("old", [False, True], ids=["new", "old"])
def test_glora_layout_detection(out, inp, old):
    """Old (≤2.x) and new GLoRA layouts are told apart by shape alone, including square layers
    where both fit (attention q/k/v): the reading whose rank is below the layer width wins."""
    rnd = _gen(8)
    adapter = parse_layer(LAYER, _glora_tensors(rnd, out, inp, RANK, old))
    assert isinstance(adapter, GLoRA) and adapter.old_layout is old and adapter.rank == RANK
    adapter.validate_against((out, inp))


def test_glora_layouts_give_their_own_formulas():
    """Same numbers read as old vs new layout produce W·a2·a1 + b2·b1 vs W·a1·a2 + b1·b2."""
    rnd = _gen(9)
    t = _glora_tensors(rnd, IN, IN, RANK, old=True)
    w = rnd(IN, IN).double()
    got = parse_layer(LAYER, t).delta(w.float()).weight
    a1, a2, b1, b2 = (t[k].double() for k in ("a1.weight", "a2.weight", "b1.weight", "b2.weight"))
    _assert_matches(got, w @ a2 @ a1 + b2 @ b1, 1e-5)


def test_glora_shapes_fitting_no_layout_are_a_format_error():
    """GLoRA tensors that fit neither layout name the layer and list the shapes."""
    rnd = _gen(10)
    t = {
        "a1.weight": rnd(IN, RANK),
        "a2.weight": rnd(RANK, IN),
        "b1.weight": rnd(OUT, 3),
        "b2.weight": rnd(RANK, IN),
    }
    with pytest.raises(AdapterFormatError, match=f"{LAYER}.*neither layout"):
        parse_layer(LAYER, t)


def test_glora_input_channels_must_match_target():
    """GLoRA's a1/a2 act on the input-channel axis, so they must match the target's channels even
    when the B branch (here a flattened b2) would fit."""
    rnd = _gen(13)
    t = {
        "a1.weight": rnd(4, RANK),
        "a2.weight": rnd(RANK, 4),
        "b1.weight": rnd(OUT, RANK),
        "b2.weight": rnd(RANK, IN * 9),
    }
    with pytest.raises(IncompatibleAdapterError, match="act on 4 input channels"):
        parse_layer(LAYER, t).validate_against((OUT, IN, 3, 3))


# ------------------------------------------------------------------------------------------- DoRA
def test_dora_both_axis_conventions_normalise_the_right_axis():
    """(out, 1) dora_scale sets every output row's norm to its magnitude; legacy (1, in) every
    input column's. At strength 1 the merged weight has exactly those norms."""
    stored, _, base = _build("dora_out", "linear")
    merged = base + parse_layer(LAYER, stored).delta(base).weight
    torch.testing.assert_close(merged.norm(dim=1), stored["dora_scale"].reshape(-1))
    stored, _, base = _build("dora_in", "conv3x3")
    merged = base + parse_layer(LAYER, stored).delta(base).weight
    torch.testing.assert_close(merged.pow(2).sum(dim=(0, 2, 3)).sqrt(), stored["dora_scale"].reshape(-1))


def test_dora_one_dimensional_scale_is_per_output_row():
    """A 1-D magnitude vector (PEFT's layout after renaming) means one magnitude per output row."""
    stored, _, base = _build("dora_out", "linear")
    as_vector = {**stored, "dora_scale": stored["dora_scale"].reshape(-1)}
    torch.testing.assert_close(
        parse_layer(LAYER, as_vector).delta(base).weight, parse_layer(LAYER, stored).delta(base).weight
    )


def test_dora_strength_interpolates_to_normalised_weight():
    """Our DoRA strength convention: W0 + m·ΔW lies on the line from W0 to the DoRA weight, so m=0.5
    is the midpoint (documented; LyCORIS differs at m ≠ 1)."""
    stored, ref, base = _build("dora_out", "linear")
    delta = parse_layer(LAYER, stored).delta(base).weight.double()
    target = base.double() + ref({k: v.double() for k, v in stored.items()}, base.double())[0]
    _assert_matches((base.double() + 0.5 * delta).float(), (base.double() + target) / 2, 1e-5)


def test_dora_format_errors():
    """dora_scale alone, with a non-low-rank algorithm, or varying along both axes is refused."""
    rnd = _gen(11)
    with pytest.raises(AdapterFormatError, match=f"{LAYER}: dora_scale without"):
        parse_layer(LAYER, {"dora_scale": rnd(OUT, 1)})
    with pytest.raises(AdapterFormatError, match="cannot accompany a Full"):
        parse_layer(LAYER, {"diff": rnd(OUT, IN), "dora_scale": rnd(OUT, 1)})
    lora_t = _build("lora", "linear")[0]
    with pytest.raises(AdapterFormatError, match="dora_scale must be"):
        parse_layer(LAYER, {**lora_t, "dora_scale": rnd(OUT, IN)})


def test_dora_scale_for_another_layer_is_incompatible():
    """A dora_scale sized for neither the output rows nor the input columns does not fit."""
    stored, _, _ = _build("dora_out", "linear")
    adapter = parse_layer(LAYER, {**stored, "dora_scale": torch.ones(OUT + 1, 1)})
    with pytest.raises(IncompatibleAdapterError, match=r"dora_scale.*expected \(12, 1\) or \(1, 8\)"):
        adapter.validate_against((OUT, IN))


# -------------------------------------------------------------------------------------------- OFT
@pytest.mark.parametrize("variant", ["oft", "oft_constrained"])
def test_oft_rotation_is_orthogonal(variant):
    """Each OFT block R is a rotation (R·Rᵀ = I), so OFT preserves the angles between neurons."""
    stored, _, _ = _build(variant, "linear", BF16)
    r = parse_layer(LAYER, stored).rotation().double()
    eye = torch.eye(r.shape[-1], dtype=torch.float64).expand_as(r)
    torch.testing.assert_close(r @ r.transpose(1, 2), eye, atol=1e-5, rtol=0)


def _skew_from_rotation(r: torch.Tensor) -> torch.Tensor:
    """Inverse Cayley transform: Q = (R − I)(R + I)⁻¹."""
    eye = torch.eye(r.shape[-1], dtype=r.dtype)
    return torch.stack([(rk - eye) @ torch.inverse(rk + eye) for rk in r])


def test_oft_respects_the_constraint():
    """COFT: the skew part behind R is scaled down to ‖Q‖_F = alpha·out_dim when it exceeds it,
    and left alone without alpha."""
    stored, _, _ = _build("oft_constrained", "linear")
    blocks = stored["oft_blocks"].double()
    raw = blocks - blocks.transpose(1, 2)
    bound = float(stored["alpha"]) * OUT
    assert raw.norm() > bound  # the test only means something if the clamp is active
    q = _skew_from_rotation(parse_layer(LAYER, stored).rotation().double())
    assert q.norm().item() == pytest.approx(bound, rel=1e-4)
    torch.testing.assert_close(q, raw * (bound / raw.norm()), atol=1e-5, rtol=1e-4)
    free = _skew_from_rotation(parse_layer(LAYER, {"oft_blocks": stored["oft_blocks"]}).rotation().double())
    torch.testing.assert_close(free, raw, atol=1e-5, rtol=1e-4)


def test_oft_explicit_constraint_tensor_is_absolute():
    """A `constraint` tensor is the ‖Q‖_F bound itself (no out_dim factor) and wins over alpha."""
    stored, _, _ = _build("oft", "linear")
    adapter = parse_layer(LAYER, {**stored, "constraint": torch.tensor(0.5), "alpha": torch.tensor(9.0)})
    assert adapter.constraint == 0.5
    assert _skew_from_rotation(adapter.rotation().double()).norm().item() == pytest.approx(0.5, rel=1e-4)


# ------------------------------------------------------------------------------------- norm / IA3
def test_norm_adapter_changes_weight_and_bias():
    """w_norm/b_norm are added to a norm layer's 1-D weight and bias as they are."""
    rnd = _gen(12)
    w_norm, b_norm = rnd(IN, scale=0.1).to(F16), rnd(IN, scale=0.1).to(F16)
    adapter = parse_layer(LAYER, {"w_norm": w_norm, "b_norm": b_norm})
    assert isinstance(adapter, Norm)
    delta = adapter.delta(torch.ones(IN, dtype=BF16), torch.zeros(IN, dtype=BF16))
    assert delta.weight.dtype == delta.bias.dtype == F32
    torch.testing.assert_close(delta.weight, w_norm.float())
    torch.testing.assert_close(delta.bias, b_norm.float())
    with pytest.raises(IncompatibleAdapterError, match=r"expected \(9,\), got \(8,\)"):
        adapter.validate_against((IN + 1,))


def test_bias_delta_on_layer_without_bias_is_incompatible():
    """A diff_b for a layer that has no bias is a mapping error, reported with the layer name."""
    stored, _, base = _build("full", "linear")
    with pytest.raises(IncompatibleAdapterError, match=f"{LAYER}: Full changes a bias"):
        parse_layer(LAYER, stored).delta(base, None)


def test_ia3_wrong_axis_length_is_incompatible():
    """An IA3 vector must match the axis it scales (output rows, or input columns with on_input)."""
    stored, _, _ = _build("ia3_in", "linear")
    adapter = parse_layer(LAYER, stored)
    adapter.validate_against((OUT, IN))
    with pytest.raises(IncompatibleAdapterError, match="input channels"):
        adapter.validate_against((IN, OUT))


# ----------------------------------------------------------------------------------- format errors
_MALFORMED = [
    ({"lora_down.weight": (8, IN), "lora_up.weight": (OUT, 4)},
     "rank mismatch: lora_down has rank 8, lora_up has rank 4"),
    ({"lora_down.weight": (4, IN, 1, 1), "lora_up.weight": (OUT, 4, 1, 1), "lora_mid.weight": (2, 4, 3, 3)},
     "rank mismatch: lora_up has rank 4, lora_mid has rank 2"),
    ({"lora_down.weight": (4, IN), "lora_up.weight": (OUT, 4, 3, 3)}, "lora_up must be a matrix"),
    ({"lora_up.weight": (OUT, 4)}, "LoRA needs lora_down.weight"),
    ({"hada_w1_a": (OUT, 4), "hada_w1_b": (2, IN), "hada_w2_a": (OUT, 2), "hada_w2_b": (2, IN)},
     "rank mismatch: hada_w1_b has rank 2, hada_w1_a has rank 4"),
    ({"hada_w1_a": (OUT, 2), "hada_w1_b": (2, IN), "hada_w2_a": (OUT, 2), "hada_w2_b": (2, IN + 1)},
     "LoHa factors disagree"),
    ({"hada_t1": (2, 2, 3, 3), "hada_w1_a": (2, OUT), "hada_w1_b": (2, IN), "hada_w2_a": (OUT, 2),
      "hada_w2_b": (2, IN)}, "needs both hada_t1 and hada_t2"),
    ({"lokr_w1": (3, 2), "lokr_w1_a": (3, 1), "lokr_w2": (4, 4)}, "either lokr_w1 or both"),
    ({"lokr_w1_a": (3, 2), "lokr_w1_b": (2, 2), "lokr_w2_a": (4, 3), "lokr_w2_b": (3, 4)},
     "rank mismatch: lokr_w1_b has rank 2, lokr_w2_b has rank 3"),
    ({"lokr_w1": (3, 2), "lokr_w2": (4, 4), "lokr_t2": (2, 2, 3, 3)}, "lokr_t2 goes with"),
    ({"oft_blocks": (3, 4, 5)}, "oft_blocks must be"),
    ({"weight": (OUT, IN), "on_input": ()}, "IA3 weight must be a vector"),
    ({"diff": (OUT, IN), "diff_b": (OUT + 1,)}, "diff_b has 13 values"),
    ({"lora_down.weight": (4, IN), "lora_up.weight": (OUT, 4), "alpha": (2,)},
     "alpha must be a single number"),
]  # fmt: skip


@pytest.mark.parametrize(("tensors", "message"), _MALFORMED, ids=[m[:40] for _, m in _MALFORMED])
def test_malformed_tensors_raise_format_error_naming_layer(tensors, message):
    """Inconsistent tensors raise AdapterFormatError whose message names the layer and the fault."""
    built = {k: torch.zeros(shape) if shape else torch.tensor(0) for k, shape in tensors.items()}
    with pytest.raises(AdapterFormatError) as info:
        parse_layer(LAYER, built)
    assert LAYER in str(info.value) and message in str(info.value)


def test_unknown_keys_are_listed():
    """Unrecognised key sets raise AdapterFormatError listing the keys; a near miss says which key
    does not belong (no silent skipping of a layer)."""
    with pytest.raises(
        AdapterFormatError, match=r"unrecognised adapter keys \['lora_A.weight', 'lora_B.weight'\]"
    ):
        parse_layer(LAYER, {"lora_A.weight": torch.zeros(4, IN), "lora_B.weight": torch.zeros(OUT, 4)})
    near = {
        "lora_down.weight": torch.zeros(4, IN),
        "lora_up.weight": torch.zeros(OUT, 4),
        "scale": torch.zeros(()),
    }
    with pytest.raises(AdapterFormatError, match=r"look like LoRA but \['scale'\] do not belong"):
        parse_layer(LAYER, near)
    with pytest.raises(AdapterFormatError, match="unrecognised adapter keys \\[\\]"):
        parse_layer(LAYER, {})


def test_errors_are_value_errors():
    """The UI catches one familiar type; the patcher tells broken files from misfits."""
    assert issubclass(AdapterFormatError, AdapterError) and issubclass(IncompatibleAdapterError, AdapterError)
    assert issubclass(AdapterError, ValueError)
    assert not issubclass(AdapterFormatError, IncompatibleAdapterError)


# ------------------------------------------------------------------------------ validate_against
class _RecordOps(TorchDispatchMode):
    """Records every tensor operation dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _wrong_shape(kind: str) -> tuple[int, ...]:
    """Both channel counts doubled: every algorithm depends on at least one of them."""
    return (OUT * 2, IN * 2, *KINDS[kind][2:])


@pytest.mark.parametrize(("variant", "kind"), CASES, ids=[f"{v}-{k}" for v, k in CASES])
def test_validate_against_rejects_mismatch_without_computing(variant, kind):
    """validate_against accepts the right target and rejects a wrong one (naming layer, expected
    and got) using shapes only: not a single tensor operation runs, right or wrong."""
    adapter = parse_layer(LAYER, _build(variant, kind)[0])
    with _RecordOps() as recorder:
        adapter.validate_against(KINDS[kind])
        with pytest.raises(IncompatibleAdapterError) as info:
            adapter.validate_against(_wrong_shape(kind))
    assert recorder.ops == []
    assert LAYER in str(info.value) and str(OUT * 2) in str(info.value)


def test_delta_checks_shape_before_computing():
    """delta() on a mismatched weight raises IncompatibleAdapterError rather than a torch error."""
    stored, _, _ = _build("lora", "linear")
    with pytest.raises(IncompatibleAdapterError, match=r"expected \(12, 9\), got \(12, 8\)"):
        parse_layer(LAYER, stored).delta(torch.zeros(OUT, IN + 1))


# ---------------------------------------------------------------------------------- rank / params
def test_rank_and_num_params():
    """rank is the low-rank dimension (None where there is none); num_params counts every stored
    value, DoRA's magnitude included."""
    lora_t, _, _ = _build("lora", "linear")
    adapter = parse_layer(LAYER, lora_t)
    assert adapter.rank == RANK and adapter.num_params == RANK * IN + OUT * RANK
    dora = parse_layer(LAYER, _build("dora_out", "linear")[0])
    assert dora.rank == RANK and dora.num_params == RANK * IN + OUT * RANK + OUT
    assert parse_layer(LAYER, _build("lokr_full", "linear")[0]).rank is None
    assert parse_layer(LAYER, _build("lokr_tucker", "conv3x3")[0]).rank == 2
    assert parse_layer(LAYER, _build("oft", "linear")[0]).rank is None
    assert parse_layer(LAYER, _build("glora_old", "linear")[0]).rank == RANK


def test_direct_construction_is_validated_too():
    """The dataclasses check themselves, so code that builds one without a file is safe as well."""
    with pytest.raises(AdapterFormatError, match="rank mismatch"):
        LoRA(torch.zeros(8, IN), torch.zeros(OUT, 4), layer=LAYER)
    adapter: Adapter = LoRA(torch.zeros(4, IN), torch.zeros(OUT, 4), alpha=4.0)
    assert "LoRA" in repr(adapter) and "Tensor(4, 8):float32" in repr(adapter)
    assert math.isclose(float(adapter.delta(torch.zeros(OUT, IN)).weight.abs().sum()), 0.0)
