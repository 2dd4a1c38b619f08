"""Flux LoRA formats, each written here from its documented key names (PEFT's by peft itself), fused
to W0 + w·scale·ΔW on every targeted module — each q/k/v (and MLP) slice of a fused BFL projection
included — restored bit-exactly, and equal as bypass forwards (sequential/group offload). One set of
ground-truth factors is written in every layout the tools use (kohya, ComfyUI, OneTrainer, diffusers,
xlabs), text encoders included, and each must apply whole."""

from __future__ import annotations

import pytest
import torch
from layer_probe import layer_output
from safetensors.torch import save_file

from app.adapters.algos import parse_layer
from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import ALGORITHMS, Layer
from app.demo import build_tiny_pipeline
from app.hooks import HookRegistry

FAMILY, RANK, ALPHA, STRENGTH = "flux-dev", 4, 2.0, 0.7
# BFL module -> (diffusers parts in row order) for block 0, as BFL's and diffusers' code define them.
FUSED = {
    "double_blocks.0.img_attn.qkv": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                     "transformer_blocks.0.attn.to_v"),
    "double_blocks.0.txt_attn.qkv": ("transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.add_k_proj",
                                     "transformer_blocks.0.attn.add_v_proj"),
    "single_blocks.1.linear1": ("single_transformer_blocks.1.attn.to_q", "single_transformer_blocks.1.attn.to_k",
                                "single_transformer_blocks.1.attn.to_v", "single_transformer_blocks.1.proj_mlp"),
    "double_blocks.1.img_attn.proj": ("transformer_blocks.1.attn.to_out.0",),
    "single_blocks.0.linear2": ("single_transformer_blocks.0.proj_out",),
}


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_pipeline(FAMILY)


def _weight(pipe, path: str, component: str = "transformer") -> torch.Tensor:
    return getattr(pipe, component).get_submodule(path).weight.detach().float()


def _fused_weight(pipe, bfl: str) -> torch.Tensor:
    return torch.cat([_weight(pipe, p) for p in FUSED[bfl]])


def _lora_factors(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(RANK, inp, generator=g) * 0.3, torch.randn(out, RANK, generator=g) * 0.3


def _apply(pipe, tmp_path, name: str, tensors: dict, metadata: dict | None = None, bypass=frozenset()):
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    stack = LoraStack(pipe, FAMILY, torch.device("cpu"), hooks=HookRegistry(), bypass=bypass)
    file = read_adapter(name, path)
    reports = stack.reconcile((LoraSpec(name, STRENGTH),), {name: file})
    return stack, reports[name], file


def _check_lora_formula(pipe, before, deltas: dict[str, torch.Tensor], scale: float) -> None:
    """Every targeted diffusers module equals W0 + w·scale·ΔW (its rows of a fused ΔW)."""
    for path, delta in deltas.items():
        want = before[path] + STRENGTH * scale * delta
        torch.testing.assert_close(_weight(pipe, path), want, rtol=1e-5, atol=1e-6, msg=path)


def _fused_deltas(pipe, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Random LoRA factors per BFL module, and the ΔW rows each diffusers part must receive."""
    factors, deltas = {}, {}
    for i, bfl in enumerate(FUSED):
        fused = _fused_weight(pipe, bfl)
        down, up = _lora_factors(fused.shape[0], fused.shape[1], seed + i)
        factors[bfl] = (down, up)
        start = 0
        for part in FUSED[bfl]:
            rows = _weight(pipe, part).shape[0]
            deltas[part] = up[start:start + rows] @ down
            start += rows
    return factors, deltas


BFL_SPELLINGS = {
    # kohya sd-scripts (networks/lora_flux.py): lora_unet_ + BFL path with "_", lora_down/lora_up/alpha
    "kohya": lambda bfl: (f"lora_unet_{bfl.replace('.', '_')}", "lora_down.weight", "lora_up.weight", True),
    # ComfyUI / BFL-trained: diffusion_model. + dotted BFL path, PEFT suffixes
    "comfyui": lambda bfl: (f"diffusion_model.{bfl}", "lora_A.weight", "lora_B.weight", True),
}


@pytest.mark.parametrize("spelling", sorted(BFL_SPELLINGS))
def test_fused_bfl_layers_land_on_each_slice(pipe, tmp_path, spelling):
    before = {p: _weight(pipe, p).clone() for parts in FUSED.values() for p in parts}
    raw = {p: pipe.transformer.get_submodule(p).weight.detach().clone() for p in before}
    factors, deltas = _fused_deltas(pipe, seed=3)
    tensors = {}
    for bfl, (down, up) in factors.items():
        key, down_suffix, up_suffix, alpha = BFL_SPELLINGS[spelling](bfl)
        tensors.update({f"{key}.{down_suffix}": down, f"{key}.{up_suffix}": up})
        if alpha:
            tensors[f"{key}.alpha"] = torch.tensor(ALPHA)
    tensors["lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight"] = torch.zeros(RANK, 16)  # no block 7
    stack, report, _ = _apply(pipe, tmp_path, spelling, tensors)
    assert report.matched_layers == sum(len(p) for p in FUSED.values())
    assert report.unmatched_keys == 1, report
    _check_lora_formula(pipe, before, deltas, ALPHA / RANK)
    stack.reconcile((), {})
    for path, weight in raw.items():
        assert torch.equal(pipe.transformer.get_submodule(path).weight, weight), f"{path} not restored bit-exactly"


def test_final_modulation_halves_are_swapped(pipe, tmp_path):
    """BFL's final_layer.adaLN_modulation.1 stores (shift, scale); diffusers' norm_out.linear (scale, shift)."""
    path = "norm_out.linear"
    before = _weight(pipe, path).clone()
    half = before.shape[0] // 2
    down, up = _lora_factors(before.shape[0], before.shape[1], seed=9)
    key = "lora_unet_final_layer_adaLN_modulation_1"
    _apply(pipe, tmp_path, "adaln", {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up})
    delta = torch.cat([up[half:], up[:half]]) @ down
    torch.testing.assert_close(_weight(pipe, path), before + STRENGTH * delta, rtol=1e-5, atol=1e-6)


def test_xlabs_and_ai_toolkit_and_clip(pipe, tmp_path):
    """xlabs (`processor.qkv_lora1/2`, `proj_lora1`, single `qkv_lora` = linear1's q/k/v rows only, no
    alpha), ai-toolkit (diffusers names, lora_A/B) and a kohya CLIP-L text-encoder layer, in one file."""
    g = torch.Generator().manual_seed(5)
    before = {p: _weight(pipe, p).clone() for parts in FUSED.values() for p in parts}
    clip_path = "text_model.encoder.layers.0.self_attn.q_proj"
    clip_before = pipe.text_encoder.get_submodule(clip_path.removeprefix("text_model.")
                                                  if not hasattr(pipe.text_encoder, "text_model") else clip_path)
    clip_w0 = clip_before.weight.detach().float().clone()
    tensors, deltas = {}, {}
    for xlabs, bfl in (("double_blocks.0.processor.qkv_lora1", "double_blocks.0.img_attn.qkv"),
                       ("double_blocks.0.processor.qkv_lora2", "double_blocks.0.txt_attn.qkv"),
                       ("single_blocks.1.processor.qkv_lora", "single_blocks.1.linear1")):
        parts = FUSED[bfl][:3]
        rows = sum(_weight(pipe, p).shape[0] for p in parts)
        down, up = torch.randn(RANK, 16, generator=g), torch.randn(rows, RANK, generator=g)
        tensors.update({f"{xlabs}.down.weight": down, f"{xlabs}.up.weight": up})
        for i, part in enumerate(parts):
            deltas[part] = up[i * 16:(i + 1) * 16] @ down
    down, up = torch.randn(RANK, 80, generator=g), torch.randn(16, RANK, generator=g)
    tensors.update({"transformer.single_transformer_blocks.0.proj_out.lora_A.weight": down,
                    "transformer.single_transformer_blocks.0.proj_out.lora_B.weight": up})
    deltas["single_transformer_blocks.0.proj_out"] = up @ down
    te_down, te_up = torch.randn(RANK, 32, generator=g), torch.randn(32, RANK, generator=g)
    tensors.update({"lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": te_down,
                    "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": te_up})
    stack, report, _ = _apply(pipe, tmp_path, "mixed", tensors)
    assert report.matched_layers == 3 + 3 + 3 + 1 + 1 and report.unmatched_keys == 0, report
    _check_lora_formula(pipe, before, deltas, 1.0)
    torch.testing.assert_close(clip_before.weight.detach().float(), clip_w0 + STRENGTH * te_up @ te_down)
    stack.reconcile((), {})


def test_peft_written_by_peft(pipe, tmp_path):
    """diffusers + peft write a Flux LoRA (`transformer.…lora_A/B`, alpha in the metadata)."""
    peft = pytest.importorskip("peft")
    from diffusers import FluxPipeline
    from peft.utils import get_peft_model_state_dict

    fresh = build_tiny_pipeline(FAMILY)
    config = peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=["to_q", "to_k", "proj_mlp"], init_lora_weights=False)
    fresh.transformer.add_adapter(config)
    state = get_peft_model_state_dict(fresh.transformer)
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=state, weight_name="peft.safetensors",
                                   transformer_lora_adapter_metadata=config.to_dict())
    targeted = [p for p, _m in pipe.transformer.named_modules() if p.endswith(("to_q", "to_k", "proj_mlp"))]
    before = {p: _weight(pipe, p).clone() for p in targeted}
    file = read_adapter("peft", tmp_path / "peft.safetensors")
    stack = LoraStack(pipe, FAMILY, torch.device("cpu"))
    report = stack.reconcile((LoraSpec("peft", STRENGTH),), {"peft": file})["peft"]
    assert report.matched_layers == len(before) and "metadata" in report.scale_source
    for path, w0 in before.items():
        a = file.tensors[f"transformer.{path}.lora_A.weight"].float()
        b = file.tensors[f"transformer.{path}.lora_B.weight"].float()
        torch.testing.assert_close(_weight(pipe, path), w0 + STRENGTH * (8 / RANK) * b @ a, rtol=1e-5, atol=1e-6)
    stack.reconcile((), {})


# Tucker variants need a conv kernel; Flux has no conv layer to carry one.
LYCORIS_ALGOS = ("lora", "loha", "lokr", "lokr_factorised", "glora", "glora_old", "dora", "full",
                 "ia3", "ia3_in", "oft")


def _build(algo: str, fused: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    return ALGORITHMS[algo].build(Layer("linear", fused, None), RANK, lambda *s: torch.randn(*s, generator=g), 0.5)


@pytest.mark.parametrize("algo", LYCORIS_ALGOS)
def test_lycoris_algorithms_on_fused_bfl_layers(pipe, tmp_path, algo):
    """Every LyCORIS algorithm written against BFL's fused weight (kohya naming, as sd-scripts' LyCORIS
    runs write it) gives each diffusers part exactly its rows of the fused W′ − W0."""
    g = torch.Generator().manual_seed(11)
    tensors, expected = {}, {}
    for bfl in ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear1"):
        fused = _fused_weight(pipe, bfl)
        layer = _build(algo, fused, g)
        if ALGORITHMS[algo].alpha:
            layer["alpha"] = torch.tensor(ALPHA)
        key = f"lora_unet_{bfl.replace('.', '_')}"
        tensors.update({f"{key}.{suffix}": t for suffix, t in layer.items()})
        delta = parse_layer(key, layer).delta(fused).weight
        start = 0
        for part in FUSED[bfl]:
            rows = _weight(pipe, part).shape[0]
            expected[part] = (_weight(pipe, part).clone(), delta[start:start + rows])
            start += rows
    stack, report, _ = _apply(pipe, tmp_path, algo, tensors)
    assert report.matched_layers == 7, report
    for part, (w0, delta) in expected.items():
        torch.testing.assert_close(_weight(pipe, part), w0 + STRENGTH * delta, rtol=1e-5, atol=1e-6, msg=part)
    stack.reconcile((), {})
    for part, (w0, _delta) in expected.items():
        assert torch.equal(_weight(pipe, part), w0), f"{part} not restored"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bypass_equals_fused_and_fp32_glora_on_bf16(tmp_path, dtype):
    """The same file fused and as bypass forwards (what sequential/group offload use) gives the same
    layer outputs; an fp32 GLoRA on a bf16 Flux applies both ways without a dtype error."""
    pipe = build_tiny_pipeline(FAMILY).to(dtype)
    g = torch.Generator().manual_seed(4)
    tensors = {}
    for bfl in ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear1"):
        fused = _fused_weight(pipe, bfl)
        layer = _build("glora", fused, g)
        tensors.update({f"lora_unet_{bfl.replace('.', '_')}.{k}": v for k, v in layer.items()})
    parts = [p for bfl in ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear1") for p in FUSED[bfl]]
    stack, _report, _ = _apply(pipe, tmp_path, "glora", tensors)
    fused_out = {p: layer_output(pipe.transformer.get_submodule(p)) for p in parts}
    stack.reconcile((), {})
    bypass, _report, _ = _apply(pipe, tmp_path, "glora", tensors, bypass=frozenset({"transformer", "text_encoder"}))
    assert set(bypass.bypassed()) == {("transformer", p) for p in parts}
    tolerance = 2e-5 if dtype == torch.float32 else 4e-2
    for part in parts:
        module = pipe.transformer.get_submodule(part)
        out = layer_output(module)
        assert module(torch.zeros(1, module.in_features, dtype=dtype)).dtype == dtype
        assert float((out - fused_out[part]).abs().max()) <= tolerance * float(fused_out[part].abs().max()), part


# ------------------------------------------------------------ one set of factors, every layout
# BFL module (or a text-encoder module) -> (component, diffusers parts in row order). One rank-4
# factor pair per entry is the ground truth; each layout below writes it under its own names,
# fused modules whole (BFL names) or cut into the parts' rows (diffusers names), as the tools do.
TRUTH = {
    "double_blocks.0.img_attn.qkv": ("transformer", FUSED["double_blocks.0.img_attn.qkv"]),
    "double_blocks.0.txt_attn.qkv": ("transformer", FUSED["double_blocks.0.txt_attn.qkv"]),
    "double_blocks.1.img_attn.proj": ("transformer", ("transformer_blocks.1.attn.to_out.0",)),
    "double_blocks.1.txt_attn.proj": ("transformer", ("transformer_blocks.1.attn.to_add_out",)),
    "single_blocks.1.linear1": ("transformer", FUSED["single_blocks.1.linear1"]),
    "single_blocks.0.linear2": ("transformer", ("single_transformer_blocks.0.proj_out",)),
    "clip:encoder.layers.0.self_attn.q_proj": ("text_encoder", ("encoder.layers.0.self_attn.q_proj",)),
    "clip:encoder.layers.1.mlp.fc1": ("text_encoder", ("encoder.layers.1.mlp.fc1",)),
    "t5:encoder.block.0.layer.0.SelfAttention.q": ("text_encoder_2", ("encoder.block.0.layer.0.SelfAttention.q",)),
    "t5:encoder.block.1.layer.1.DenseReluDense.wi_0": ("text_encoder_2",
                                                       ("encoder.block.1.layer.1.DenseReluDense.wi_0",)),
}
_XLABS = {"double_blocks.0.img_attn.qkv": "double_blocks.0.processor.qkv_lora1",
          "double_blocks.0.txt_attn.qkv": "double_blocks.0.processor.qkv_lora2",
          "double_blocks.1.img_attn.proj": "double_blocks.1.processor.proj_lora1",
          "double_blocks.1.txt_attn.proj": "double_blocks.1.processor.proj_lora2",
          "single_blocks.1.linear1": "single_blocks.1.processor.qkv_lora",
          "single_blocks.0.linear2": "single_blocks.0.processor.proj_lora"}


def _bfl_names(kohya_te: dict[str, str], dotted_te: dict[str, str] | None, kohya: bool):
    """Key of each TRUTH entry: BFL names (`lora_unet_…` or `diffusion_model.…`), text encoders by prefix."""
    def name(entry: str) -> str:
        encoder, _, path = entry.rpartition(":")
        if not encoder:
            return f"lora_unet_{path.replace('.', '_')}" if kohya else f"diffusion_model.{path}"
        path = f"text_model.{path}" if encoder == "clip" else path
        return f"{kohya_te[encoder]}{path.replace('.', '_')}" if kohya else f"{dotted_te[encoder]}{path}"
    return name


# layout -> (key of a TRUTH entry or None to cut it into diffusers parts, down/up suffixes, alpha?, entries)
LAYOUTS = {
    # kohya sd-scripts (networks/lora_flux.py): CLIP-L `lora_te1_`, T5 `lora_te3_`
    "kohya": (_bfl_names({"clip": "lora_te1_", "t5": "lora_te3_"}, None, True), ("lora_down", "lora_up"), True),
    # ComfyUI: `diffusion_model.` BFL names, text encoders by their all-in-one names, either suffix pair
    "comfyui_lora_A": (_bfl_names({}, {"clip": "text_encoders.clip_l.transformer.",
                                       "t5": "text_encoders.t5xxl.transformer."}, False), ("lora_A", "lora_B"), True),
    "comfyui_lora_down": (_bfl_names({}, {"clip": "text_encoders.clip_l.transformer.",
                                          "t5": "text_encoders.t5xxl.transformer."}, False),
                          ("lora_down", "lora_up"), True),
    # OneTrainer: diffusers names per part (`lora_transformer_`), CLIP-L `lora_te1_`, T5 `lora_te2_`
    "onetrainer": (None, ("lora_down", "lora_up"), True),
    # ai-toolkit / diffusers: `transformer.`, `text_encoder.`, `text_encoder_2.` + diffusers names, no alpha
    "diffusers": (None, ("lora_A", "lora_B"), False),
    # xlabs: processor names, `.down`/`.up`, no alpha, no text encoders; single `qkv_lora` = q, k, v rows only
    "xlabs": (lambda entry: _XLABS[entry], ("down", "up"), False),
}
_PART_PREFIX = {"onetrainer": {"transformer": "lora_transformer_", "text_encoder": "lora_te1_text_model_",
                               "text_encoder_2": "lora_te2_"},
                "diffusers": {"transformer": "transformer.", "text_encoder": "text_encoder.text_model.",
                              "text_encoder_2": "text_encoder_2."}}


def _truth(pipe) -> dict[str, tuple[str, tuple[tuple[str, slice], ...], torch.Tensor, torch.Tensor]]:
    """Per TRUTH entry: component, each part with its rows of the whole, and the (down, up) factors."""
    out = {}
    g = torch.Generator().manual_seed(21)
    for entry, (component, parts) in TRUTH.items():
        shapes = [getattr(pipe, component).get_submodule(p).weight.shape for p in parts]
        rows, start = [], 0
        for part, shape in zip(parts, shapes, strict=True):
            rows.append((part, slice(start, start + shape[0])))
            start += shape[0]
        down = torch.randn(RANK, shapes[0][1], generator=g, dtype=torch.float64) * 0.3
        out[entry] = (component, tuple(rows), down, torch.randn(start, RANK, generator=g, dtype=torch.float64) * 0.3)
    return out


def _layout_file(layout: str, truth) -> tuple[dict[str, torch.Tensor], dict[tuple[str, str], torch.Tensor]]:
    """The file's tensors (fp32) and the float64 ΔW = scale·B@A each diffusers module must receive."""
    name, (down_suffix, up_suffix), alpha = LAYOUTS[layout]
    scale = ALPHA / RANK if alpha else 1.0
    tensors, expected = {}, {}
    for entry, (component, rows, down, up) in truth.items():
        if layout == "xlabs" and entry not in _XLABS:
            continue
        if layout == "xlabs" and entry.endswith("linear1"):
            rows = rows[:3]  # xlabs' single-block LoRA: linear1's q, k, v rows, never proj_mlp's
        if name is not None:
            keys = [(name(entry), down, up[: rows[-1][1].stop])]
        else:
            prefix = _PART_PREFIX[layout][component]
            keys = [(f"{prefix}{part.replace('.', '_') if prefix.endswith('_') else part}", down, up[cut])
                    for part, cut in rows]
        for key, d, u in keys:
            tensors.update({f"{key}.{down_suffix}.weight": d.float(), f"{key}.{up_suffix}.weight": u.float()})
            if alpha:
                tensors[f"{key}.alpha"] = torch.tensor(ALPHA)
        expected.update({(component, part): scale * up[cut] @ down for part, cut in rows})
    return tensors, expected


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_flux_layout_fuses_to_the_formula_and_restores(pipe, tmp_path, layout):
    """One set of ground-truth factors written the way each tool writes a Flux LoRA — kohya, ComfyUI
    (both suffix pairs, CLIP-L as `text_encoders.clip_l.transformer.text_model.…`, T5 as
    `text_encoders.t5xxl.transformer.…`), OneTrainer (T5 as `lora_te2_`), ai-toolkit/diffusers and
    xlabs (single-block `proj_lora` = linear2 = `proj_out`) — applies whole: every targeted module
    (each row slice of a fused one, proj_out, the CLIP-L and T5 layers) equals the float64
    W0 + w·scale·B@A within fp32 rounding, nothing else moves, no tensor is left unmatched, and
    removal restores every bit."""
    components = ("transformer", "text_encoder", "text_encoder_2")
    pristine = {(c, k): v.clone() for c in components for k, v in getattr(pipe, c).state_dict().items()}
    tensors, expected = _layout_file(layout, _truth(pipe))
    stack, report, _ = _apply(pipe, tmp_path, layout, tensors)
    assert (report.unmatched_keys, report.matched_layers) == (0, len(expected)), report
    fused = {c: getattr(pipe, c).state_dict() for c in components}
    for (component, key), original in pristine.items():
        module, now = key.removesuffix(".weight"), fused[component][key]
        if (component, module) not in expected or not key.endswith(".weight"):
            assert torch.equal(now, original), f"{component}.{key} changed but no layer targets it"
            continue
        reference = original.double() + STRENGTH * expected[(component, module)]
        error = float((now.double() - reference).abs().max())
        assert error <= 4 * torch.finfo(torch.float32).eps * float(reference.abs().max()), (component, key, error)
    stack.reconcile((), {})
    for (component, key), original in pristine.items():
        assert torch.equal(fused[component][key], original), f"{component}.{key} not restored"


def test_the_layouts_reach_proj_out_and_both_text_encoders():
    """Guards the test above: its ground truth covers linear2 (`proj_out`), a fused q/k/v+MLP projection,
    CLIP-L and T5, so a layout that dropped any of them would fail there."""
    parts = {(c, p) for c, ps in TRUTH.values() for p in ps}
    assert ("transformer", "single_transformer_blocks.0.proj_out") in parts
    assert ("transformer", "single_transformer_blocks.1.proj_mlp") in parts
    assert {c for c, _ in parts} == {"transformer", "text_encoder", "text_encoder_2"}
