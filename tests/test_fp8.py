"""8-bit weight storage: fp8 at rest, the compute dtype in every forward, LoRAs as exact bypasses.

What it protects (issue: peers re-quantise fused LoRAs into fp8 and lose the delta, or hit dtype
errors): a model stored in fp8 draws exactly what the same fp8 weights widened by hand draw, in
every offload mode; the stored bytes never change (generation, LoRA add, re-weight, removal);
with a LoRA each patched layer outputs what the widened weight plus ΔW does, within bf16
rounding, for every algorithm; verify checks the (storage, compute) pair of every tensor, and a
weight found widened at rest is a violation that the next transition repairs.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from layer_probe import layer_output
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import CHECKPOINTS, FAST

from app import diagnostics
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import ALGORITHMS, write_adapter
from app.demo import build_tiny_pipeline
from app.engine import placement, storage
from app.engine.generate import GenerateParams
from app.engine.worker import Engine
from app.families import family
from app.report import collect_report
from app.settings import OFFLOAD_CHOICES, Settings
from app.ui import views

FP8 = placement.STORAGE_DTYPES["fp8"]
PARAMS = GenerateParams("a cat", seed=21, **FAST)


@pytest.fixture(scope="module")
def engines(demo_dir, tmp_path_factory):
    """(engine storing fp8, engine with every weight in bf16), both computing in bf16 on the CPU."""
    import shutil

    data = tmp_path_factory.mktemp("fp8")
    shutil.copytree(demo_dir / "models", data / "models")
    fp8 = Engine(Settings(data_dir=data, device="cpu", dtype="bf16", weights="fp8"))
    full = Engine(Settings(data_dir=data, device="cpu", dtype="bf16"))
    yield fp8, full
    fp8.close()
    full.close()


def _stored_digest(engine) -> str:
    """sha256 of every weight stored in 8 bits, in a stable order."""
    h = hashlib.sha256()
    for c, p, _m, n, t, _is_param in placement.iter_tensors(engine.pipeline):
        if t.dtype == FP8:
            h.update(f"{c}.{p}.{n}".encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _widen_by_hand(engine, family_name: str) -> None:
    """What fp8 storage means, done by hand on a full-precision engine: each stored weight cast to
    fp8 and back (outside the engine's knowledge: only the values change, not the dtypes)."""
    for component, paths in storage.layers_to_store(engine.pipeline, family(family_name), "fp8").items():
        root = getattr(engine.pipeline, component)
        for path in paths:
            weight = root.get_submodule(path).weight
            weight.data.copy_(weight.data.to(FP8).to(weight.dtype))


@pytest.mark.parametrize("family_name", ["sd15"])  # the conformance suite runs fp8 in every mode for every family
def test_fp8_storage_draws_what_the_widened_weights_draw_in_every_offload_mode(engines, family_name):
    fp8, full = engines
    full.load_model(CHECKPOINTS[family_name])
    _widen_by_hand(full, family_name)
    reference = np.asarray(full.generate(PARAMS)[0].image)
    full.unload()
    snap = fp8.load_model(CHECKPOINTS[family_name])
    stored = _stored_digest(fp8)
    layers = storage.layers_to_store(fp8.pipeline, family(family_name), "fp8")
    assert snap.stored_layers == sum(map(len, layers.values())) > 0
    assert snap.bytes_saved == sum(getattr(fp8.pipeline, c).get_submodule(p).weight.numel()
                                   for c, paths in layers.items() for p in paths)  # 2 bytes -> 1
    for mode in OFFLOAD_CHOICES:
        fp8.set_offload(mode)
        image = np.asarray(fp8.generate(PARAMS)[0].image)
        assert np.array_equal(image, reference), mode
        assert _stored_digest(fp8) == stored, f"{mode}: stored fp8 bytes changed"
        assert fp8.snapshot().violations_found_total == 0
    fp8.set_offload("none")


def test_diagnostics_names_storage_and_compute_dtype_per_module_and_the_bytes_saved(engines):
    """Each module row says what its tensors rest in and what its forward computes in; the summary
    line and the bug report carry the stored layer count and the bytes saved."""
    fp8, full = engines
    snap = fp8.load_model(CHECKPOINTS["sd15"])
    rows = {(r.component, r.module): r for r in snap.placement}
    attn = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    assert (rows["unet", f"{attn}.to_q"].storage, rows["unet", f"{attn}.to_q"].compute) == ("fp8 e4m3fn", "bf16")
    assert (rows["unet", f"{attn}.to_out.0"].storage, rows["unet", f"{attn}.to_out.0"].compute) == \
        ("bf16+fp8 e4m3fn", "bf16")  # the weight in 8 bits, its bias in the compute dtype
    assert (rows["unet", "conv_in"].storage, rows["unet", "conv_in"].compute) == ("bf16", "bf16")  # high precision
    assert (rows["text_encoder", "embeddings"].storage, rows["text_encoder", "embeddings"].compute) == \
        ("int64", "")  # position ids only
    assert not any("fp8" in r.storage for r in snap.placement if r.component == "vae")  # never stored
    layers = storage.layers_to_store(fp8.pipeline, family("sd15"), "fp8")
    stored = {(c, p) for c, paths in layers.items() for p in paths}
    assert {key for key, r in rows.items() if "fp8 e4m3fn" in r.storage} == stored
    table, _ = views.module_rows(snap, component="unet", text=f"{attn}.to_q")
    header = views.MODULE_HEADERS
    assert [table[0][header.index("storage dtype")], table[0][header.index("compute dtype")]] == ["fp8 e4m3fn", "bf16"]

    saved = sum(getattr(fp8.pipeline, c).get_submodule(p).weight.numel() for c, p in stored)  # 2 bytes -> 1
    summary = diagnostics.storage_summary(snap.weights, snap.stored_layers, snap.bytes_saved, snap.dtype,
                                          stored_as=snap.stored_as, resting_bytes=snap.resting_bytes)
    assert snap.stored_as == (f"{len(stored)} × fp8",) and snap.resting_bytes == saved
    assert summary == (f"weights: fp8 — {len(stored)} layers rest in fp8 e4m3fn and compute in bf16; "
                       f"{saved / 2**20:.2f} MiB saved ({saved:,} bytes), {saved / 2**20:.2f} MiB at rest")
    report = collect_report(fp8, fp8.settings)
    assert report["weight_storage"] == summary
    assert (report["snapshot"]["stored_layers"], report["snapshot"]["bytes_saved"]) == (len(stored), saved)
    row = next(r for r in report["snapshot"]["placement"] if (r["component"], r["module"]) == ("unet", f"{attn}.to_q"))
    assert (row["storage"], row["compute"]) == ("fp8 e4m3fn", "bf16")

    snap = full.load_model(CHECKPOINTS["sd15"])
    assert diagnostics.storage_summary(snap.weights, snap.stored_layers, snap.bytes_saved, snap.dtype) == \
        "weights: full — every weight rests in its compute dtype (bf16)"
    assert not any("fp8" in r.storage for r in snap.placement)
    full.unload()


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_a_lora_on_fp8_layers_is_the_widened_weight_plus_its_delta(engines, tmp_path, algo):
    """Every algorithm: the bypassed fp8 layer equals a bf16 copy of the widened weight with the
    LoRA fused (fp32 math, rounded once), within bf16 rounding; the stored bytes never change and
    removing the LoRA leaves them identical."""
    fp8, full = engines
    fp8.load_model(CHECKPOINTS["sd15"])
    stored = _stored_digest(fp8)
    pipe = build_tiny_pipeline("sd15")
    layout = "kohya" if algo in ("lora", "dora") else "lycoris"
    name = f"fp8-{algo}"
    write_adapter(fp8.library.root / f"{name}.safetensors", pipe, "sd15", algo, layout, seed=5, alpha=2.0)
    snap = fp8.set_loras([LoraSpec(name, 0.8)])
    assert snap.lora_mode == "bypass" and fp8.lora_stack._backups == {}
    assert _stored_digest(fp8) == stored
    full.load_model(CHECKPOINTS["sd15"])  # the reference: the widened weights with the LoRA fused
    _widen_by_hand(full, "sd15")
    assert full.set_loras([LoraSpec(name, 0.8)]).lora_mode == "fused"
    for component, path in fp8.lora_stack.bypassed():
        mine = getattr(fp8.pipeline, component).get_submodule(path)
        want = getattr(full.pipeline, component).get_submodule(path)
        got, expected = layer_output(mine, torch.bfloat16), layer_output(want, torch.bfloat16)
        assert float((got - expected).abs().max()) <= 4e-2 * float(expected.abs().max()), (component, path)
    full.set_loras([])  # the wanted list outlives an unload: the next load must start without it
    full.unload()
    fp8.set_loras([])
    assert _stored_digest(fp8) == stored and fp8.lora_stack.bypassed() == {}


def test_a_weight_found_widened_at_rest_is_a_violation_and_is_repaired(engines):
    fp8, _full = engines
    fp8.load_model(CHECKPOINTS["sd15"])
    stored = _stored_digest(fp8)
    layer = fp8.pipeline.unet.down_blocks[0].resnets[0].conv1
    assert layer.weight.dtype == FP8
    layer.weight.data = layer.weight.data.to(torch.bfloat16)  # what a careless LoRA write-back would do
    snap = fp8.set_offload("none")
    row = snap.history[-1]
    assert (row.violations_found, row.violations_repaired) == (1, 1)
    assert "fp8" in str(snap.violations[0]) and layer.weight.dtype == FP8
    assert _stored_digest(fp8) == stored  # fp8 -> bf16 -> fp8 is exact


def test_switching_weight_storage_reloads_and_keeps_the_loras(engines):
    fp8, _full = engines
    fp8.load_model(CHECKPOINTS["sd15"])
    fp8.set_loras([LoraSpec("demo-style-sd15", 0.7)])
    snap = fp8.set_weights("full")
    assert (snap.weights, snap.stored_layers, snap.lora_mode) == ("full", 0, "fused")
    assert [s.name for s in snap.loras] == ["demo-style-sd15"]
    snap = fp8.set_weights("fp8")
    assert snap.stored_layers > 0 and snap.lora_mode == "bypass"
    fp8.set_loras([])


def _bytes_hash(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_an_fp8_checkpoint_file_keeps_its_own_bytes_through_loras(engines):
    """An fp8 file as people share them (every matrix saved in float8_e4m3fn) loaded with fp8
    storage: each stored layer holds bytes identical to one of the file's tensors — diffusers widens
    on load and the plain cast narrows back exactly, every e4m3 value being a bf16 value — and still
    does after a LoRA is added, used and removed (the bypass never writes the base)."""
    fp8, _full = engines
    folder = fp8.settings.checkpoints_dir
    with safe_open(str(folder / CHECKPOINTS["sd15"]), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = {name: tensor.to(FP8) if tensor.is_floating_point() and tensor.dim() >= 2 else tensor
               for name, tensor in load_file(str(folder / CHECKPOINTS["sd15"])).items()}
    save_file(tensors, str(folder / "tiny-sd15-fp8.safetensors"), metadata=metadata)
    in_file = {_bytes_hash(t) for t in tensors.values() if t.dtype == FP8}

    def stored() -> dict[str, str]:
        return {f"{c}.{p}.{n}": _bytes_hash(t)
                for c, p, _m, n, t, _is_param in placement.iter_tensors(fp8.pipeline) if t.dtype == FP8}

    fp8.load_model("tiny-sd15-fp8.safetensors")
    loaded = stored()
    assert len(loaded) == fp8.snapshot().stored_layers > 100
    assert set(loaded.values()) <= in_file
    fp8.set_loras([LoraSpec("demo-style-sd15", 0.9)])
    fp8.generate(PARAMS)
    assert stored() == loaded
    fp8.set_loras([])
    assert stored() == loaded
    fp8.load_model(CHECKPOINTS["sd15"])


def test_the_bench_fused_copies_compute_what_the_bypass_computes_and_leave_the_fp8_bytes(engines):
    """The alternative the fp8 proxy measures (benchmarks/proxy_fp8.py): each touched layer's
    compute-dtype copy outputs what its bypass does, within bf16 rounding (and not what the layer
    without the LoRA does), and the stored bytes are the same before, while and after the copies
    are in use."""
    from benchmarks.proxy_fp8 import FusedCopies

    fp8, _full = engines
    fp8.load_model(CHECKPOINTS["sd15"])
    stored = _stored_digest(fp8)
    specs = [LoraSpec("demo-style-sd15", 0.7)]
    copies = FusedCopies(fp8, specs)
    try:
        assert fp8.lora_stack.bypassed() == {} and copies.copies
        assert all(c.dtype == torch.bfloat16 for c in copies.copies.values())
        fused = {m: layer_output(m, torch.bfloat16) for m in copies.copies}
        assert _stored_digest(fp8) == stored
    finally:
        copies.remove()
    assert all(not torch.equal(layer_output(module, torch.bfloat16), got) for module, got in fused.items())
    fp8.set_loras(specs)
    for module, got in fused.items():
        expected = layer_output(module, torch.bfloat16)
        assert float((got - expected).abs().max()) <= 4e-2 * float(expected.abs().max())
    fp8.set_loras([])
    assert _stored_digest(fp8) == stored


# ------------------------------------------------ fp8-compute (issue 41): the same storage, fp8 matmuls
@pytest.fixture(scope="module")
def compute(demo_dir, tmp_path_factory):
    """An engine with `--weights fp8-compute`, bf16, weights resting in fp32 where a mode moves them (every
    move a real cast), strict forwards on."""
    import shutil

    data = tmp_path_factory.mktemp("fp8-compute")
    shutil.copytree(demo_dir / "models", data / "models")
    engine = Engine(Settings(data_dir=data, device="cpu", dtype="bf16", rest_dtype="fp32", weights="fp8-compute",
                             strict_forwards=True))
    yield engine
    engine.close()


def _scales(engine) -> dict[str, torch.Tensor]:
    from app.engine.fp8_matmul import SCALE

    return {f"{c}.{p}": t.clone() for c, p, _m, n, t, _ in placement.iter_tensors(engine.pipeline) if n == SCALE}


def test_fp8_compute_draws_one_image_in_every_offload_mode_and_keeps_its_bytes_and_scales(compute):
    """Every offload mode (whole components moved, leaves and blocks streamed, with strict forwards) draws
    the image that nothing moved draws, within the grey levels the fp32-rest streamed modes differ by; the
    fp8 bytes and float32 scales are what they were at load; zero violations."""
    snap = compute.load_model(CHECKPOINTS["sd15"])
    assert snap.weights == "fp8-compute" and 0 < snap.matmul_layers < snap.stored_layers
    stored, scales = _stored_digest(compute), _scales(compute)
    assert len(scales) == snap.matmul_layers and all(s.dtype == torch.float32 for s in scales.values())
    reference = np.asarray(compute.generate(PARAMS)[0].image, dtype=np.int16)
    for mode in OFFLOAD_CHOICES:
        compute.set_offload(mode)
        image = np.asarray(compute.generate(PARAMS)[0].image, dtype=np.int16)
        assert np.abs(image - reference).mean() < 3.0, mode
        assert _stored_digest(compute) == stored, f"{mode}: stored fp8 bytes changed"
        now = _scales(compute)
        assert now.keys() == scales.keys() and all(torch.equal(now[k], v) for k, v in scales.items()), mode
        assert compute.snapshot().violations_found_total == 0, mode
    compute.set_offload("none")


def test_diagnostics_name_the_fp8_matmul_layers_and_why_the_others_widen(compute):
    """A matmul layer's row computes in `fp8 e4m3fn matmul → bf16` and rests in fp8 beside its float32
    scales and bf16 bias; a convolution stays on the storage path; the summary line (Diagnostics and the
    bug report) counts both and gives each reason with its count."""
    snap = compute.load_model(CHECKPOINTS["sd15"])
    rows = {(r.component, r.module): r for r in snap.placement}
    attn = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    assert (rows["unet", f"{attn}.to_q"].storage, rows["unet", f"{attn}.to_q"].compute) == \
        ("fp32+fp8 e4m3fn", "fp8 e4m3fn matmul → bf16")
    assert rows["unet", f"{attn}.to_out.0"].storage == "bf16+fp32+fp8 e4m3fn"
    conv = "down_blocks.0.resnets.0.conv1"
    assert (rows["unet", conv].storage, rows["unet", conv].compute) == ("bf16+fp8 e4m3fn", "bf16")
    summary = diagnostics.storage_summary(snap.weights, snap.stored_layers, snap.bytes_saved, snap.dtype,
                                          matmul_layers=snap.matmul_layers, matmul_unfit=snap.matmul_unfit,
                                          stored_as=snap.stored_as, resting_bytes=snap.resting_bytes)
    widened = snap.stored_layers - snap.matmul_layers
    assert summary.startswith(f"weights: fp8-compute — {snap.stored_layers} layers rest in fp8 e4m3fn, "
                              f"{snap.matmul_layers} of them computed as fp8 e4m3fn matmuls writing bf16; "
                              f"the other {widened} widen to bf16 (")
    assert sum(int(reason.split(" × ")[0]) for reason in snap.matmul_unfit) == widened
    assert "Conv2d: only Linear layers run as fp8 matmuls" in snap.matmul_unfit[0]
    assert collect_report(compute, compute.settings)["weight_storage"] == summary


def test_an_fp8_matmul_scale_found_in_another_dtype_is_a_violation_and_is_repaired(compute):
    """The scales are in the placement plan (pinned to float32 at rest and at compute): one found in bf16
    is a violation the next transition names and repairs back to float32."""
    from app.engine.fp8_matmul import SCALE

    compute.load_model(CHECKPOINTS["sd15"])
    layer = compute.pipeline.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    layer._buffers[SCALE] = layer._buffers[SCALE].to(torch.bfloat16)  # what a careless move would do
    snap = compute.set_offload("none")
    row = snap.history[-1]
    assert (row.violations_found, row.violations_repaired) == (1, 1)
    assert SCALE in str(snap.violations[0]) and layer.get_buffer(SCALE).dtype == torch.float32
