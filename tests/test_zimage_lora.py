"""Z-Image LoRA files as the tools write them, each fused exactly, or refused with the reason.

Per format, written here from its documented key names: the weights we fuse equal the float64
formula W0 + w·scale·ΔW on every targeted module (each q/k/v slice of ComfyUI's fused `qkv`
included) and what diffusers' `load_lora_weights` + `fuse_lora` gives (`ZImageLoraLoaderMixin`,
whose converter `_convert_non_diffusers_z_image_lora_to_diffusers` reads every format below);
removing the LoRA gives back every weight bit for bit. Formats:

* diffusers/PEFT: `transformer.…lora_A/B`, alpha in `lora_adapter_metadata` (written by peft);
* ai-toolkit: `diffusion_model.` + diffusers names, `lora_A/B` (LoRA) or `lokr_w1`/`lokr_w2_a/b` (LoKr);
  PEFT's raw parameter names there (`lora_A.default.weight`), which diffusers also reads;
* musubi-tuner: `lora_unet_layers_0_attention_to_q.lora_down/up` + `alpha` (kohya over diffusers names);
* Anime-Z: the same names with dotted `lora.down`/`lora.up` suffixes;
* musubi's ComfyUI conversion (kohya over original names): fused `lora_unet_…_attention_qkv`,
  `…_attention_out` (diffusers' converter splits `_` and `.` alike, so it reaches its dotted-qkv branch);
* ComfyUI: `diffusion_model.` + original names, `qkv.lora.down/up` (diffusers splits these);
* every LyCORIS algorithm on the fused `qkv` (kohya naming), and Qwen3 text-encoder LoRAs
  (`lora_te_…`; diffusers' Z-Image loader reads none: the formula alone decides).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from app.adapters.algos import parse_layer
from app.adapters.errors import LoraApplyError
from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import ALGORITHMS, Layer
from app.demo import build_tiny_pipeline

FAMILY, RANK, ALPHA, STRENGTH = "zimage-turbo", 4, 2.0, 0.7
SCALE = ALPHA / RANK
QKV = ("to_q", "to_k", "to_v")
# diffusers modules a LoRA over diffusers names targets: attention, feed-forward, modulation, the
# refiners, the embedders (a ModuleDict entry among them).
PLAIN = ("layers.0.attention.to_q", "layers.0.attention.to_out.0", "layers.1.feed_forward.w2",
         "layers.0.adaLN_modulation.0", "noise_refiner.0.attention.to_k", "context_refiner.0.feed_forward.w1",
         "cap_embedder.1", "all_x_embedder.2-1")
# original module -> its diffusers parts, in row order
ORIGINAL = {"layers.1.attention.qkv": tuple(f"layers.1.attention.{p}" for p in QKV),
            "layers.1.attention.out": ("layers.1.attention.to_out.0",),
            "noise_refiner.0.attention.qkv": tuple(f"noise_refiner.0.attention.{p}" for p in QKV)}


@pytest.fixture
def pipe():
    """A fresh tiny Z-Image (diffusers' own ZImagePipeline class, seed-0 weights)."""
    return build_tiny_pipeline(FAMILY)


def _weight(pipe, path: str) -> torch.Tensor:
    return pipe.transformer.get_submodule(path).weight.detach()


def _factors(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(RANK, inp, generator=g) * 0.3, torch.randn(out, RANK, generator=g) * 0.3


def _plain(pipe, key, down_suffix: str, up_suffix: str, alpha: bool):
    """A LoRA over diffusers names: (tensors, {diffusers path: float64 ΔW at strength 1})."""
    tensors, deltas = {}, {}
    for i, path in enumerate(PLAIN):
        weight = _weight(pipe, path)
        down, up = _factors(weight.shape[0], weight.shape[1], i)
        tensors.update({f"{key(path)}.{down_suffix}": down, f"{key(path)}.{up_suffix}": up})
        if alpha:
            tensors[f"{key(path)}.alpha"] = torch.tensor(ALPHA)
        deltas[path] = (SCALE if alpha else 1.0) * up.double() @ down.double()
    return tensors, deltas


def _original(pipe, key, down_suffix: str, up_suffix: str):
    """A LoRA over original names (fused qkv): each diffusers part gets its rows of the fused ΔW."""
    tensors, deltas = {}, {}
    for i, (original, parts) in enumerate(ORIGINAL.items()):
        fused = torch.cat([_weight(pipe, p) for p in parts])
        down, up = _factors(fused.shape[0], fused.shape[1], 10 + i)
        tensors.update({f"{key(original)}.{down_suffix}": down, f"{key(original)}.{up_suffix}": up,
                        f"{key(original)}.alpha": torch.tensor(ALPHA)})
        delta, start = SCALE * up.double() @ down.double(), 0
        for part in parts:
            rows = _weight(pipe, part).shape[0]
            deltas[part] = delta[start:start + rows]
            start += rows
    return tensors, deltas


def _lokr(pipe):
    """ai-toolkit's LoKr over diffusers names: full w1 (2×2), w2 = w2_a @ w2_b of rank 4, alpha."""
    tensors, deltas = {}, {}
    for i, path in enumerate((PLAIN[0], PLAIN[1], PLAIN[3])):  # even widths (w2's input is 85)
        out, inp = _weight(pipe, path).shape
        g = torch.Generator().manual_seed(20 + i)
        w1 = torch.randn(2, 2, generator=g)
        w2_a, w2_b = torch.randn(out // 2, RANK, generator=g) * 0.3, torch.randn(RANK, inp // 2, generator=g) * 0.3
        key = f"diffusion_model.{path}"
        tensors.update({f"{key}.lokr_w1": w1, f"{key}.lokr_w2_a": w2_a, f"{key}.lokr_w2_b": w2_b,
                        f"{key}.alpha": torch.tensor(ALPHA)})
        deltas[path] = SCALE * torch.kron(w1.double(), w2_a.double() @ w2_b.double())
    return tensors, deltas


def _flat(prefix: str):
    return lambda path: prefix + path.replace(".", "_")


FORMATS = {  # name -> writer; diffusers' converter reads every one of them
    "ai-toolkit": lambda p: _plain(p, "diffusion_model.{}".format, "lora_A.weight", "lora_B.weight", False),
    "musubi-tuner": lambda p: _plain(p, _flat("lora_unet_"), "lora_down.weight", "lora_up.weight", True),
    "anime-z": lambda p: _plain(p, _flat("lora_unet_"), "lora.down.weight", "lora.up.weight", True),
    "musubi-comfy-conversion": lambda p: _original(p, _flat("lora_unet_"), "lora_down.weight", "lora_up.weight"),
    "comfyui": lambda p: _original(p, "diffusion_model.{}".format, "lora.down.weight", "lora.up.weight"),
    "ai-toolkit-lokr": _lokr,
    # PEFT's raw parameter names under diffusion_model. (diffusers drops the `default.`)
    "peft-named-parameters": lambda p: _plain(p, "diffusion_model.{}".format, "lora_A.default.weight",
                                               "lora_B.default.weight", False),
}


def _apply(pipe, tmp_path, name: str, tensors: dict, metadata: dict | None = None):
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    stack = LoraStack(pipe, FAMILY, torch.device("cpu"))
    report = stack.reconcile((LoraSpec(name, STRENGTH),), {name: read_adapter(name, path)})[name]
    return stack, report, path


def _diffusers_fused(path, deltas) -> dict[str, torch.Tensor]:
    """diffusers' own reading: load_lora_weights + fuse_lora(lora_scale=w) on a fresh copy."""
    theirs = build_tiny_pipeline(FAMILY)
    theirs.load_lora_weights(str(path), adapter_name="x")
    theirs.fuse_lora(lora_scale=STRENGTH)
    theirs.unload_lora_weights()
    return {p: _weight(theirs, p).clone() for p in deltas}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_tool_format_fuses_to_the_formula_and_to_diffusers(pipe, tmp_path, name):
    tensors, deltas = FORMATS[name](pipe)
    tensors["lora_unet_layers_9_attention_to_q.lora_down.weight"] = torch.zeros(RANK, 32)  # no block 9
    raw = {p: _weight(pipe, p).clone() for p in deltas}
    stack, report, path = _apply(pipe, tmp_path, name, tensors)
    assert report.matched_layers == len(deltas) and report.unmatched_keys == 1, report
    assert "lora_unet_layers_9_attention_to_q.lora_down.weight" in report.message
    for p, delta in deltas.items():
        want = (raw[p].double() + STRENGTH * delta).float()
        torch.testing.assert_close(_weight(pipe, p), want, rtol=1e-5, atol=1e-6, msg=p)
    del tensors["lora_unet_layers_9_attention_to_q.lora_down.weight"]  # diffusers refuses what matches nothing
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    for p, theirs in _diffusers_fused(path, deltas).items():
        torch.testing.assert_close(_weight(pipe, p), theirs, rtol=1e-5, atol=1e-6, msg=f"{p} vs diffusers")
    stack.reconcile((), {})
    assert all(torch.equal(_weight(pipe, p), w) for p, w in raw.items()), "not restored bit for bit"


def test_diffusers_peft_file_written_by_peft_matches_diffusers(pipe, tmp_path):
    """diffusers + peft write `transformer.…lora_A/B` with alpha in the metadata (scale α/r = 2)."""
    peft = pytest.importorskip("peft")
    from diffusers import ZImagePipeline
    from peft.utils import get_peft_model_state_dict

    source = build_tiny_pipeline(FAMILY)
    config = peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=["to_q", "to_v", "w2", "layers.0.adaLN_modulation.0"],
                             init_lora_weights=False)
    source.transformer.add_adapter(config)
    ZImagePipeline.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(source.transformer),
                                     weight_name="peft.safetensors", transformer_lora_adapter_metadata=config.to_dict())
    state = read_adapter("peft", tmp_path / "peft.safetensors").tensors
    targets = sorted({k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in state})
    deltas = {p: 2.0 * state[f"transformer.{p}.lora_B.weight"].double()
              @ state[f"transformer.{p}.lora_A.weight"].double() for p in targets}
    raw = {p: _weight(pipe, p).clone() for p in targets}
    stack = LoraStack(pipe, FAMILY, torch.device("cpu"))
    file = read_adapter("peft", tmp_path / "peft.safetensors")
    report = stack.reconcile((LoraSpec("peft", STRENGTH),), {"peft": file})
    assert report["peft"].matched_layers == len(targets) > 10 and "metadata" in report["peft"].scale_source
    theirs = _diffusers_fused(tmp_path / "peft.safetensors", deltas)
    for p, delta in deltas.items():
        torch.testing.assert_close(_weight(pipe, p), (raw[p].double() + STRENGTH * delta).float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(_weight(pipe, p), theirs[p], rtol=1e-5, atol=1e-6)
    stack.reconcile((), {})
    assert all(torch.equal(_weight(pipe, p), w) for p, w in raw.items())


LYCORIS_ALGOS = ("lora", "loha", "lokr", "lokr_factorised", "glora", "dora", "full", "ia3", "oft")


@pytest.mark.parametrize("algo", LYCORIS_ALGOS)
def test_lycoris_algorithms_on_the_fused_qkv(pipe, tmp_path, algo):
    """Every LyCORIS algorithm written against the original fused `qkv` (kohya naming, as LyCORIS
    runs over the original model write it) gives `to_q`, `to_k`, `to_v` exactly their rows of W′ − W0."""
    g = torch.Generator().manual_seed(11)
    tensors, expected = {}, {}
    for original in ("layers.1.attention.qkv", "noise_refiner.0.attention.qkv"):
        parts = ORIGINAL[original]
        fused = torch.cat([_weight(pipe, p) for p in parts])
        layer = ALGORITHMS[algo].build(Layer("linear", fused, None), RANK, lambda *s: torch.randn(*s, generator=g), 0.5)
        if ALGORITHMS[algo].alpha:
            layer["alpha"] = torch.tensor(ALPHA)
        key = f"lycoris_{original.replace('.', '_')}"
        tensors.update({f"{key}.{suffix}": t for suffix, t in layer.items()})
        delta, start = parse_layer(key, layer).delta(fused).weight, 0
        for part in parts:
            rows = _weight(pipe, part).shape[0]
            expected[part] = (_weight(pipe, part).clone(), delta[start:start + rows])
            start += rows
    stack, report, _ = _apply(pipe, tmp_path, algo, tensors)
    assert report.matched_layers == 6 and report.unmatched_keys == 0, report
    for part, (w0, delta) in expected.items():
        torch.testing.assert_close(_weight(pipe, part), w0 + STRENGTH * delta, rtol=1e-5, atol=1e-6, msg=part)
    stack.reconcile((), {})
    assert all(torch.equal(_weight(pipe, part), w0) for part, (w0, _d) in expected.items())


def test_qwen3_text_encoder_lora(pipe, tmp_path):
    """A kohya LoRA on the Qwen3 encoder (`lora_te_layers_0_self_attn_q_proj`, `…_mlp_down_proj`) beside
    a transformer layer: each encoder weight is W0 + w·(α/r)·B@A; diffusers' Z-Image loader reads no
    text-encoder LoRA, so the formula alone decides."""
    tensors, deltas = {}, {}
    for i, path in enumerate(("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj")):
        weight = pipe.text_encoder.get_submodule(path).weight
        down, up = _factors(weight.shape[0], weight.shape[1], 30 + i)
        key = f"lora_te_{path.replace('.', '_')}"
        tensors.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                        f"{key}.alpha": torch.tensor(ALPHA)})
        deltas[path] = (weight.detach().clone(), SCALE * up.double() @ down.double())
    tensors.update({"lora_unet_layers_0_attention_to_q.lora_down.weight": torch.zeros(RANK, 32),
                    "lora_unet_layers_0_attention_to_q.lora_up.weight": torch.zeros(32, RANK)})
    stack, report, _ = _apply(pipe, tmp_path, "te", tensors)
    assert report.matched_layers == 3 and report.unmatched_keys == 0, report
    for path, (w0, delta) in deltas.items():
        torch.testing.assert_close(pipe.text_encoder.get_submodule(path).weight,
                                   (w0.double() + STRENGTH * delta).float(), rtol=1e-5, atol=1e-6)
    stack.reconcile((), {})
    assert all(torch.equal(pipe.text_encoder.get_submodule(p).weight, w0) for p, (w0, _d) in deltas.items())


def test_a_layer_written_fused_and_split_reads_the_split_layers_as_diffusers_does(pipe, tmp_path):
    """Some trainers (Anime-Z) write `qkv` and `to_q`/`to_k`/`to_v` of one block both: the split layers
    are read (each to the formula and to diffusers' reading, which skips the fused one) and the report
    says so; the fused layer is not counted as matched nor as unmatched."""
    tensors, _ = _original(pipe, _flat("lora_unet_"), "lora_down.weight", "lora_up.weight")  # qkv + out, fused
    deltas = {}
    for i, proj in enumerate(QKV):
        path = f"layers.1.attention.{proj}"
        down, up = _factors(32, 32, 40 + i)
        key = f"lora_unet_{path.replace('.', '_')}"
        tensors.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up})
        deltas[path] = up.double() @ down.double()
    for original, parts in ORIGINAL.items():  # the other fused layers apply as written
        if original != "layers.1.attention.qkv":
            down, up = (tensors[f"lora_unet_{original.replace('.', '_')}.lora_{d}.weight"] for d in ("down", "up"))
            deltas.update({p: SCALE * up.double()[j * 32:(j + 1) * 32] @ down.double() for j, p in enumerate(parts)})
    raw = {p: _weight(pipe, p).clone() for p in deltas}
    stack, report, path = _apply(pipe, tmp_path, "both", tensors)
    assert report.matched_layers == len(deltas) and report.unmatched_keys == 0, report
    assert "1 fused layer (e.g. lora_unet_layers_1_attention_qkv) also written split" in report.message
    theirs = _diffusers_fused(path, deltas)
    for p, delta in deltas.items():
        torch.testing.assert_close(_weight(pipe, p), (raw[p].double() + STRENGTH * delta).float(), rtol=1e-5,
                                   atol=1e-6, msg=p)
        torch.testing.assert_close(_weight(pipe, p), theirs[p], rtol=1e-5, atol=1e-6, msg=f"{p} vs diffusers")
    stack.reconcile((), {})
    assert all(torch.equal(_weight(pipe, p), w) for p, w in raw.items())


def test_one_module_named_twice_otherwise_is_refused_as_ambiguous(pipe, tmp_path):
    """Two spellings of the same single module (`lora_unet_…_to_k` and ai-toolkit's `diffusion_model.…to_k`)
    are not a fused/split pair: refused whole, naming both layers, nothing applied."""
    down, up = _factors(32, 32, 50)
    raw = _weight(pipe, "layers.0.attention.to_k").clone()
    tensors = {"lora_unet_layers_0_attention_to_k.lora_down.weight": down,
               "lora_unet_layers_0_attention_to_k.lora_up.weight": up,
               "diffusion_model.layers.0.attention.to_k.lora_A.weight": down.clone(),
               "diffusion_model.layers.0.attention.to_k.lora_B.weight": up.clone()}
    with pytest.raises(LoraApplyError, match=r"both target transformer\.layers\.0\.attention\.to_k"):
        _apply(pipe, tmp_path, "twice", tensors)
    assert torch.equal(_weight(pipe, "layers.0.attention.to_k"), raw)
