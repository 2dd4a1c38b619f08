"""LoRAs through the engine: the SD.Next sequences that used to crash or drift, per-component
strengths, prompt tags, diagnostics, minimal re-weighting and the demo LoRAs.

Weights are compared by the sha256 of every UNet/text-encoder tensor: "equal" below always means
bit-identical. Expected fused weights come from a fresh `LoraStack` fuse of the same list on a
copy of the original model, so every step must be independent of the path that led to it.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import FAST

from app.adapters.errors import LoraApplyError
from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack, backup_beside
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import adapter_state_digests, write_adapter, write_demo_loras
from app.demo import build_tiny_pipeline
from app.diagnostics import placement_rows
from app.engine.generate import GenerateParams
from app.engine.placement import DTYPES
from app.engine.worker import Engine, EngineState
from app.settings import Settings
from benchmarks.mutation_costs import counting

CHECKPOINTS = {"sd15": "tiny-sd15.safetensors", "sdxl": "tiny-sdxl.safetensors"}
ATTENTION = ("unet.*attn[12].to_[qkv]", "unet.*attn1.to_out.0", "text_encoder*.self_attn.q_proj")
BIASED_CONVS = ("unet.*resnets.*.conv[12]", "unet.*resnets.*.conv_shortcut", "unet.*samplers.0.conv")


@pytest.fixture(scope="module")
def tiny():
    """`tiny(family)`: an fp32 tiny pipeline built once per module, used only to shape adapter files
    (the demo checkpoints hold the same modules)."""
    cache = {}

    def get(family_name: str):
        if family_name not in cache:
            cache[family_name] = build_tiny_pipeline(family_name)
        return cache[family_name]

    return get


def _write(engine: Engine, tiny, name: str, algo: str = "lora", family_name: str = "sd15", **kwargs):
    """A kohya-layout fp16 adapter named `name` in the engine's LoRA folder."""
    kwargs.setdefault("alpha", 2.0)
    return write_adapter(engine.settings.lora_dir / f"{name}.safetensors", tiny(family_name), family_name, algo,
                         "kohya", torch.float16, **kwargs)


def _generate(engine: Engine, prompt: str = "a cat", seed: int = 3, **kwargs):
    return engine.generate(GenerateParams(prompt, seed=seed, **{**FAST, **kwargs}))


def _pixels(images, i: int = 0) -> np.ndarray:
    return np.asarray(images[i].image, dtype=np.int16)


def _split(digests: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(UNet digests, text-encoder digests)."""
    unet = {k: v for k, v in digests.items() if k.startswith("unet.")}
    return unet, {k: v for k, v in digests.items() if not k.startswith("unet.")}


class FreshFuse:
    """Copies of the engine's UNet/text encoders as loaded (call before any LoRA), fused from scratch
    on demand: what any path through set_loras must end at."""

    def __init__(self, engine: Engine, family_name: str) -> None:
        self.engine, self.family = engine, family_name
        components = ("unet", "text_encoder", "text_encoder_2") if family_name == "sdxl" else ("unet", "text_encoder")
        self.pipe = SimpleNamespace(**{c: copy.deepcopy(getattr(engine.pipeline, c)) for c in components})
        self.original = {c: copy.deepcopy(getattr(self.pipe, c).state_dict()) for c in components}

    def digests(self, specs: list[LoraSpec]) -> dict[str, str]:
        for component, state in self.original.items():
            getattr(self.pipe, component).load_state_dict(state)
        files = {s.name: read_adapter(s.name, self.engine.library.path_for(s.name)) for s in specs}
        LoraStack(self.pipe, self.family).reconcile(specs, files)
        return adapter_state_digests(self.pipe)


# ------------------------------------------------------------------------- SD.Next sequences
def _same_image(a: np.ndarray, b: np.ndarray, tolerance: int) -> bool:
    return a.shape == b.shape and int(np.abs(a - b).max()) <= tolerance


def _sdnext_weight_sequence(engine: Engine, tiny, dtype: str, image_tolerance: int = 0) -> None:
    """add 1.0 → gen → 1.1 → gen → 1.0 → gen → remove → gen, with the checks the tests promise.

    Weights are compared bit for bit everywhere; images exactly on the CPU, within
    `image_tolerance` levels on a GPU, whose kernels need not be bitwise reproducible."""
    _write(engine, tiny, "style", targets=ATTENTION + BIASED_CONVS, strength=0.8)
    engine.load_model(CHECKPOINTS["sd15"], dtype=dtype)
    checkpoint, plain = adapter_state_digests(engine.pipeline), _pixels(_generate(engine))
    fresh = FreshFuse(engine, "sd15").digests([LoraSpec("style", 1.0)])
    engine.set_loras([LoraSpec("style", 1.0)])
    at_one = adapter_state_digests(engine.pipeline)
    first = _pixels(_generate(engine))
    engine.set_loras([LoraSpec("style", 1.1)])
    assert adapter_state_digests(engine.pipeline) != at_one
    stronger = _pixels(_generate(engine))
    engine.set_loras([LoraSpec("style", 1.0)])
    assert adapter_state_digests(engine.pipeline) == at_one == fresh
    assert _same_image(_pixels(_generate(engine)), first, image_tolerance)
    engine.set_loras([])
    assert adapter_state_digests(engine.pipeline) == checkpoint
    assert _same_image(_pixels(_generate(engine)), plain, image_tolerance)
    assert not np.array_equal(first, plain) and not np.array_equal(stronger, first)
    snap = engine.snapshot()
    assert [h.command for h in snap.history].count("generate") == 5
    assert [(h.outcome, h.violations_found) for h in snap.history] == [("ok", 0)] * len(snap.history)
    assert snap.state == EngineState.READY.value and snap.violations_found_total == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sdnext_weight_change_sequence(engine, tiny, dtype):
    """SD.Next #3860/#3614: add at 1.0 → generate → 1.1 → generate → 1.0 → generate → remove →
    generate. No transition finds a placement violation; going back to 1.0 is bit-identical to a
    fresh apply at 1.0 (weights and image: recomputed from backups, never subtracted); the final
    remove restores the checkpoint bit for bit and its image equals the one before any LoRA."""
    _sdnext_weight_sequence(engine, tiny, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_sdnext_weight_change_sequence_on_gpu(gpu_data_dir, tiny, dtype):
    """The same sequence on CUDA in half precision, where SD.Next put biases on the CPU (#3614) and
    crashed on the second weight (#3860): every tensor stays where the plan puts it, in place."""
    eng = Engine(Settings(data_dir=gpu_data_dir, device="cuda"))
    try:
        _sdnext_weight_sequence(eng, tiny, dtype, image_tolerance=1)
        assert {p.device.type for p in eng.pipeline.unet.parameters()} == {"cuda"}
        assert {p.dtype for p in eng.pipeline.unet.parameters()} == {DTYPES[dtype]}
    finally:
        eng.close()


def test_unet_and_text_encoder_strengths_touch_only_their_component(engine, tiny):
    """`LoraSpec(name, unet_weight=…, te_weight=…)`: a zero text-encoder strength leaves every
    text-encoder tensor bit-identical and vice versa; together the halves are exactly the two
    separate results, each equal to a fresh fuse."""
    _write(engine, tiny, "a")
    engine.load_model(CHECKPOINTS["sd15"])
    unet0, te0 = _split(adapter_state_digests(engine.pipeline))
    fresh = FreshFuse(engine, "sd15")
    steps = {}
    for unet_w, te_w in ((0.8, 0.0), (0.0, 1.3), (0.8, 1.3)):
        specs = [LoraSpec("a", unet_weight=unet_w, te_weight=te_w)]
        engine.set_loras(specs)
        steps[unet_w, te_w] = _split(adapter_state_digests(engine.pipeline))
        assert adapter_state_digests(engine.pipeline) == fresh.digests(specs)
    unet_only, te_only, both = steps[0.8, 0.0], steps[0.0, 1.3], steps[0.8, 1.3]
    assert unet_only[1] == te0 and unet_only[0] != unet0
    assert te_only[0] == unet0 and te_only[1] != te0
    assert both == (unet_only[0], te_only[1])


def test_three_loras_on_biased_convs_add_remove_add_each_step_equals_a_fresh_fuse(engine, tiny):
    """SD.Next: add three LoRAs touching biased convs (LoCon, a full diff with `diff_b`, LoHa),
    remove one, add another, switching offload mode between runs and generating after each step:
    every fused step's weights (biases included) equal a fresh fuse of the same list on the
    original model; under `sequential` (bypass) the stored weights stay the checkpoint's and the
    bypassed layers are exactly the ones a fresh fuse patches; the last remove restores the
    checkpoint."""
    _write(engine, tiny, "locon", targets=BIASED_CONVS, seed=1)
    _write(engine, tiny, "fullb", "full", targets=BIASED_CONVS, seed=2)
    _write(engine, tiny, "loha", "loha", targets=BIASED_CONVS + ATTENTION, seed=3)
    _write(engine, tiny, "lokr", "lokr_factorised", targets=BIASED_CONVS, seed=4)
    engine.load_model(CHECKPOINTS["sd15"], dtype="bf16")
    checkpoint, fresh = adapter_state_digests(engine.pipeline), FreshFuse(engine, "sd15")
    a, b, c, d = LoraSpec("locon", 0.9), LoraSpec("fullb", 0.7), LoraSpec("loha", -0.6), LoraSpec("lokr", 1.2)
    steps = [[a], [a, b], [a, b, c], [a, c], [a, c, d], []]
    for i, specs in enumerate(steps):
        engine.set_offload(("none", "model", "sequential")[i % 3])
        engine.set_loras(specs)
        want = fresh.digests(specs)
        if engine.snapshot().offload == "sequential":  # bypass forwards: stored weights untouched
            assert adapter_state_digests(engine.pipeline) == checkpoint, f"step {i}: {specs}"
            patched = {k.rsplit(".", 1)[0] for k in want if want[k] != checkpoint[k]}
            assert {".".join(t) for t in engine.lora_stack.bypassed()} == patched, f"step {i}: {specs}"
        else:
            assert adapter_state_digests(engine.pipeline) == want, f"step {i}: {specs}"
        assert _generate(engine, seed=i)
    assert adapter_state_digests(engine.pipeline) == checkpoint
    assert all(h.outcome == "ok" and h.violations_found == 0 for h in engine.snapshot().history)


def test_generate_twice_unchanged_then_a_batch_of_three_all_carry_the_lora(engine, tiny):
    """SD.Next: two identical generations, then a batch of 3; every image of the batch carries the
    LoRA (differs from the same seed's image without it; the first equals the single image)."""
    _write(engine, tiny, "style", targets=ATTENTION + BIASED_CONVS, strength=1.0)
    engine.load_model(CHECKPOINTS["sd15"])
    plain = _generate(engine, seed=20, batch=3)
    engine.set_loras([LoraSpec("style", 1.0)])
    once, twice = _generate(engine, seed=20), _generate(engine, seed=20)
    assert np.array_equal(_pixels(once), _pixels(twice))
    batch = _generate(engine, seed=20, batch=3)
    assert np.abs(_pixels(batch, 0) - _pixels(once)).max() <= 1
    for i in range(3):
        assert np.abs(_pixels(batch, i) - _pixels(plain, i)).mean() > 2.0, f"batch image {i} lacks the LoRA"


# ------------------------------------------------------------------------------- prompt tags
@pytest.mark.parametrize(("tag", "spec"), [("<lora:style:0.6>", LoraSpec("style", 0.6)),
                                           ("<lora:style:1.4:0.6>", LoraSpec("style", unet_weight=0.6, te_weight=1.4))])
def test_prompt_tags_apply_to_one_generation_and_stay_in_the_saved_prompt(engine, tiny, tag, spec):
    """`<lora:name:w>` and `<lora:name:unet_w:te_w>` take the same patching path as set_loras, for
    that generation only (A1111): identical image, and afterwards the weights are the checkpoint's
    again and the snapshot lists no LoRA; the saved prompt keeps the tag (so A1111/Civitai can
    reproduce the image) and the infotext records the LoRA's weight and hash."""
    _write(engine, tiny, "style", targets=ATTENTION + BIASED_CONVS)
    engine.load_model(CHECKPOINTS["sd15"])
    checkpoint = adapter_state_digests(engine.pipeline)
    engine.set_loras([spec])
    by_slider = adapter_state_digests(engine.pipeline)
    slider_image = _pixels(_generate(engine, prompt="a cat, detailed"))
    engine.set_loras([])
    assert by_slider != checkpoint
    (tagged,) = _generate(engine, prompt=f"a cat, detailed {tag}")
    assert adapter_state_digests(engine.pipeline) == checkpoint and engine.snapshot().loras == ()
    assert np.array_equal(np.asarray(tagged.image, dtype=np.int16), slider_image)
    prompt_line, _, params = tagged.infotext.partition("\n")
    assert prompt_line == f"a cat, detailed {tag}"
    assert 'Lora weights: "style: 0.6"' in params and 'Lora hashes: "style: ' in params
    (untagged,) = _generate(engine, prompt="a cat, detailed")
    assert "Lora" not in untagged.infotext


def test_lora_hash_is_a1111s_and_a_metadata_edit_keeps_it_but_counts_as_another_file(engine, tiny):
    """`Lora hashes` carries A1111's short hash (kohya's addnet hash: sha256 of the bytes after the
    safetensors header, 12 digits), the one Civitai looks LoRAs up by, not the whole file's. A file
    rewritten with the same tensors and other metadata keeps that hash, yet is not the same adapter
    to the patcher: metadata may carry the alpha."""
    import hashlib

    written = _write(engine, tiny, "style", targets=ATTENTION)
    data = written.path.read_bytes()
    addnet = hashlib.sha256(data[8 + int.from_bytes(data[:8], "little"):]).hexdigest()[:12]
    assert addnet != hashlib.sha256(data).hexdigest()[:12]
    engine.load_model(CHECKPOINTS["sd15"])
    (image,) = _generate(engine, prompt="a cat <lora:style:0.6>")
    assert f'Lora hashes: "style: {addnet}"' in image.infotext
    first = read_adapter("style", written.path)
    save_file(dict(written.tensors), str(written.path), metadata={**written.metadata, "ss_output_name": "renamed"})
    edited = read_adapter("style", written.path)
    assert edited.short_hash == first.short_hash == addnet and written.path.read_bytes() != data
    assert not first.same_as(edited) and edited.same_as(read_adapter("style", written.path))


# ----------------------------------------------------------------------- diagnostics and reach
def test_snapshot_lists_loras_on_patched_modules_and_counts_matches(engine, tiny):
    """Diagnostics: each placement row names the LoRAs fused into that module (in list order) and
    no other row names any; `lora_counters` show matched layers and unmatched tensors per LoRA."""
    wide = _write(engine, tiny, "wide")
    narrow = _write(engine, tiny, "narrow", "loha", targets=("unet.*attn1.to_q",), seed=5)
    stray = {"lora_unet_down_blocks_9_resnets_0_conv1.lora_down.weight": torch.ones(4, 8, 3, 3, dtype=torch.float16),
             "lora_unet_down_blocks_9_resnets_0_conv1.lora_up.weight": torch.ones(8, 4, 1, 1, dtype=torch.float16)}
    save_file({**wide.tensors, **stray}, str(wide.path), metadata=wide.metadata)
    engine.load_model(CHECKPOINTS["sd15"])
    snap = engine.set_loras([LoraSpec("wide"), LoraSpec("narrow", 0.5)])
    expected = {}
    for name, adapter in (("wide", wide), ("narrow", narrow)):
        for target in adapter.layers:
            expected.setdefault(target, []).append(name)
    rows = {(r.component, r.module): r.loras for r in snap.placement}
    assert {k: v for k, v in rows.items() if v} == {k: tuple(v) for k, v in expected.items()}
    wide_count, narrow_count = snap.lora_counters["wide"], snap.lora_counters["narrow"]
    assert (wide_count.matched_layers, wide_count.unmatched_keys) == (len(wide.layers), len(stray))
    assert (narrow_count.matched_layers, narrow_count.unmatched_keys) == (len(narrow.layers), 0)
    assert wide_count.apply_errors == narrow_count.apply_errors == 0


def test_snapshot_says_how_many_originals_are_held_and_where(engine, tiny):
    """Diagnostics' "LoRA backups" line: one original per fused layer, its exact size, in CPU memory
    on the CPU; a re-weight holds no second copy; removing the LoRAs frees them all."""
    adapter = _write(engine, tiny, "wide")
    engine.load_model(CHECKPOINTS["sd15"])
    assert engine.snapshot().lora_backups == "none"
    engine.set_loras([LoraSpec("wide")])
    size = sum(getattr(engine.pipeline, c).get_submodule(path).weight.nbytes for c, path in adapter.layers)
    want = f"{len(adapter.layers)} layers, {size / 2**20:.2f} MiB ({size:,} bytes) in CPU memory"
    assert engine.snapshot().lora_backups == want
    assert engine.set_loras([LoraSpec("wide", 0.4)]).lora_backups == want
    assert engine.set_loras([]).lora_backups == "none"


@pytest.mark.gpu
def test_lora_backups_rest_beside_the_weights_unless_asked(gpu_data_dir, tiny):
    """On CUDA the originals of fused layers stay on the GPU by default, so a re-weight copies no byte
    of them over PCIe (issue 41: pinned host backups by default made an H100 re-weight 503 ms instead
    of 48); `lora_backups="cpu"` keeps them in pinned host memory (no VRAM for them, VRAM grows by at
    least their size less), and then a re-weight copies every touched layer's original across and the
    add waits for the device once, not once per layer. Either way a re-weight is in place and removing
    the LoRA restores the checkpoint bit for bit."""
    assert Settings(data_dir=gpu_data_dir).lora_backups == "gpu"
    grown, held_bytes, across = {}, {}, {}
    for where in ("cpu", "gpu"):
        eng = Engine(Settings(data_dir=gpu_data_dir, device="cuda", dtype="fp16", lora_backups=where))
        try:
            _write(eng, tiny, "wide")
            eng.load_model(CHECKPOINTS["sd15"])
            before = {n: p.detach().clone() for n, p in eng.pipeline.unet.named_parameters()}
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated()
            snap = eng.set_loras([LoraSpec("wide")])
            grown[where] = torch.cuda.memory_allocated() - allocated
            held = list(eng.lora_stack._backups.values())
            held_bytes[where] = sum(b.weight.nbytes for b in held)
            assert {b.weight.device.type for b in held} == ({"cpu"} if where == "cpu" else {"cuda"})
            assert all(b.weight.is_pinned() for b in held) == (where == "cpu")
            assert ("pinned CPU memory" if where == "cpu" else "CUDA memory") in snap.lora_backups
            assert eng.lora_stack.traffic.waits == (1 if where == "cpu" else 0)
            eng.set_loras([LoraSpec("wide", 0.3)])
            traffic = eng.lora_stack.traffic
            assert traffic.backup_bytes_read == held_bytes[where] and traffic.waits == 0
            across[where] = traffic.bytes_across
            eng.set_loras([])
            assert all(torch.equal(p, before[n]) for n, p in eng.pipeline.unet.named_parameters())
        finally:
            eng.close()
    assert held_bytes["cpu"] == held_bytes["gpu"] > 0
    assert across == {"cpu": held_bytes["cpu"], "gpu": 0}
    assert grown["gpu"] - grown["cpu"] >= held_bytes["gpu"], (grown, held_bytes)


def test_reweighting_rewrites_only_that_loras_layers(engine, tiny, monkeypatch):
    """A slider move recomputes only the layers of the LoRA that moved: the other LoRA's layers are
    not written at all (same values), and no tensor anywhere is replaced (same storage)."""
    moved = _write(engine, tiny, "moved", targets=ATTENTION)
    still = _write(engine, tiny, "still", "loha", targets=BIASED_CONVS, seed=6)
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([LoraSpec("moved"), LoraSpec("still")])
    storage = {(c, k): t.data_ptr() for c in ("unet", "text_encoder")
               for k, t in getattr(engine.pipeline, c).state_dict().items()}
    untouched = {t: engine.pipeline.unet.get_submodule(t[1]).weight.clone() for t in still.layers}
    written, real_write = [], LoraStack._write_layer

    def counting_write(self, target, *args):
        written.append(target)
        return real_write(self, target, *args)

    monkeypatch.setattr(LoraStack, "_write_layer", counting_write)
    engine.set_loras([LoraSpec("moved", 0.4), LoraSpec("still")])
    assert sorted(written) == sorted(moved.layers)
    assert all(torch.equal(engine.pipeline.unet.get_submodule(t[1]).weight, w) for t, w in untouched.items())
    assert storage == {(c, k): t.data_ptr() for c in ("unet", "text_encoder")
                       for k, t in getattr(engine.pipeline, c).state_dict().items()}


def test_reconcile_reports_progress_once_per_layer_it_rewrites(engine, tiny):
    """The "patching LoRA layers" progress counts the layers actually rewritten: every layer of a
    new LoRA, only the re-weighted LoRA's layers on a slider move."""
    a = _write(engine, tiny, "a", targets=ATTENTION)
    b = _write(engine, tiny, "b", targets=BIASED_CONVS, seed=5)
    engine.load_model(CHECKPOINTS["sd15"])
    stack = LoraStack(engine.pipeline, "sd15")
    files = {n: read_adapter(n, engine.library.path_for(n)) for n in ("a", "b")}
    calls: list[tuple[int, int]] = []
    stack.reconcile([LoraSpec("a"), LoraSpec("b")], files, progress=lambda *c: calls.append(c))
    total = len(a.layers) + len(b.layers)
    assert calls == [(i, total) for i in range(1, total + 1)]
    calls.clear()
    stack.reconcile([LoraSpec("a"), LoraSpec("b", 0.5)], files, progress=lambda *c: calls.append(c))
    assert calls == [(i, len(b.layers)) for i in range(1, len(b.layers) + 1)]
    stack.reconcile([], files)


def test_inspect_lora_reports_what_set_loras_would_without_applying(engine, tiny):
    """`inspect_lora` parses and shape-checks a LoRA against the loaded model: the same match counts
    set_loras reports and the same refusal for another architecture, with no weight written and
    no history row."""
    adapter = _write(engine, tiny, "a")
    _write(engine, tiny, "xl", family_name="sdxl")
    engine.load_model(CHECKPOINTS["sd15"])
    before, rows = adapter_state_digests(engine.pipeline), len(engine.snapshot().history)
    report = engine.inspect_lora("a")
    assert (report.matched_layers, report.unmatched_keys) == (len(adapter.layers), 0)
    with pytest.raises(LoraApplyError, match=r"made for SDXL"):
        engine.inspect_lora("xl")
    assert adapter_state_digests(engine.pipeline) == before and len(engine.snapshot().history) == rows
    assert engine.snapshot().state == EngineState.READY.value
    counters = engine.set_loras([LoraSpec("a")]).lora_counters["a"]
    assert (counters.matched_layers, counters.unmatched_keys) == (report.matched_layers, report.unmatched_keys)


# -------------------------------------------------------------------- refusals keep generating
def test_a_refused_lora_list_leaves_the_previous_list_for_the_next_generation(engine, tiny):
    """After set_loras is refused (here: an unreadable file), the engine is READY with the previous
    list; the next generation must run with that list — not retry the refused one and fail again."""
    _write(engine, tiny, "good")
    (engine.settings.lora_dir / "broken.safetensors").write_bytes(b"")
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([LoraSpec("good")])
    with_good = adapter_state_digests(engine.pipeline)
    with pytest.raises(ValueError, match="the file is empty"):
        engine.set_loras([LoraSpec("good"), LoraSpec("broken")])
    assert engine.snapshot().state == EngineState.READY.value
    assert _generate(engine)
    assert engine.snapshot().loras == (LoraSpec("good"),)
    assert adapter_state_digests(engine.pipeline) == with_good


def test_switching_to_a_model_the_lora_does_not_fit_keeps_generating(engine, tiny):
    """A LoRA list chosen on SD1.5 is re-applied after loading SDXL: the SD1.5 LoRA does not fit, so
    the load succeeds with it reported (counted, not fused) and SDXL generates without it; loading
    SD1.5 again brings it back."""
    _write(engine, tiny, "sd15-only")
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([LoraSpec("sd15-only")])
    fused_on_sd15 = adapter_state_digests(engine.pipeline)
    snap = engine.load_model(CHECKPOINTS["sdxl"])
    assert snap.state == EngineState.READY.value and snap.loras == ()
    aside = snap.lora_counters["sd15-only"]
    # set aside is not an apply error (issue 32: the bug-report card kept a stale "apply errors 1")
    assert aside.apply_errors == 0 and "does not fit" in aside.message
    assert [(s.name, s.status) for s in snap.lora_states] == [("sd15-only", "set aside")]
    assert _generate(engine)
    snap = engine.load_model(CHECKPOINTS["sd15"])
    assert adapter_state_digests(engine.pipeline) == fused_on_sd15
    assert snap.lora_counters["sd15-only"].apply_errors == 0 and snap.lora_counters["sd15-only"].matched_layers


# ---------------------------------------------------------------------------------- demo LoRAs
@pytest.mark.parametrize("family_name", ["sd15", "sdxl"])
def test_demo_loras_match_fully_carry_trigger_words_and_change_the_image(engine, tiny, family_name):
    """`write_demo_loras` (the demo's `lora_writer` hook) writes plain kohya LoRAs with base-model
    metadata and a trigger word; each matches every key of its architecture and visibly changes
    the tiny model's image."""
    paths = write_demo_loras(engine.settings.lora_dir, tiny(family_name), family_name)
    assert [p.stem for p in paths] == [f"demo-style-{family_name}", f"demo-detail-{family_name}"]
    engine.load_model(CHECKPOINTS[family_name])
    plain = _pixels(_generate(engine))
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
        assert ("xl" in metadata["ss_base_model_version"]) == (family_name == "sdxl")
        assert json.loads(metadata["ss_tag_frequency"])
        counters = engine.set_loras([LoraSpec(path.stem)]).lora_counters[path.stem]
        assert counters.unmatched_keys == 0 and counters.matched_layers > 10
        assert np.abs(_pixels(_generate(engine)) - plain).mean() > 8.0, f"{path.stem} barely changes the image"


def test_a_slider_move_costs_only_its_loras_layers_no_host_wait_and_one_walk_after(engine, tiny):
    """Issue 41, slider latency: a re-weight (and a remove) recomputes only the layers of the LoRA that
    moved, reads each of their originals once (the bytes a GPU with host backups copies over PCIe), never
    makes the host wait for the device, and dispatches a bounded number of ops per layer; the transition
    walks every tensor of the pipeline once (the placement verify before it): the verify after it and
    the Diagnostics rows cover the layers written (in-place writes cannot move anything else), and the
    rows published are those a full walk builds."""
    moved = _write(engine, tiny, "moved", targets=ATTENTION + ("unet.*resnets.*.conv1",))
    still = _write(engine, tiny, "still", "loha", targets=BIASED_CONVS, seed=6)  # shares the conv1 layers
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([LoraSpec("moved"), LoraSpec("still")])
    backups = engine.lora_stack._backups

    def originals(layers) -> int:
        return sum(backups[t].weight.nbytes + (0 if backups[t].bias is None else backups[t].bias.nbytes)
                   for t in layers)

    # ops per layer written: measured 5.6 for the re-weight, 2.4 for the remove and 1.0 (one copy) for the
    # remove of the last LoRA (11.6 and 4.1 with a `.detach()` per tensor read and the factors cast to
    # float32 per layer), so one more op per layer (a second float32 copy of W0, a ΔW built apart, a
    # detach, a cast) crosses the bound. The last step removes every LoRA (an empty list).
    steps = (([LoraSpec("moved", 0.4), LoraSpec("still")], moved, 6), ([LoraSpec("still")], moved, 3),
             ([], still, 1))
    for specs, changed, ops_per_layer in steps:
        read = originals(changed.layers)
        with counting() as costs:
            engine.set_loras(specs)
        assert costs.layers_written == len(changed.layers)
        assert costs.backup_bytes_read == read and costs.bytes_across == 0
        assert costs.host_syncs == 0, costs
        assert costs.tensor_walks == 1, costs
        assert costs.aten_ops <= ops_per_layer * len(changed.layers), costs
        lifecycle = engine._lifecycle
        full = placement_rows(engine.pipeline, lifecycle.plan, engine.lora_stack.patched_modules(), [],
                              lifecycle._loaded.hooks)
        assert engine.snapshot().placement == full + engine._upscaler.rows(())


def test_cuda_backups_stay_beside_the_weights_by_default_while_the_gpu_has_room():
    """Issue 41's regression: with backups in pinned host memory by default every re-weight copied each
    touched layer's original over PCIe (an H100 re-weight went from 48 to 503 ms). By default a CUDA
    weight's backup stays on the GPU while the room above the 2 GiB headroom holds it, and goes to
    pinned host memory past it, or always with `lora_backups="cpu"`; a host weight's stays beside it."""
    assert Settings().lora_backups == "gpu"
    keep = Settings().lora_backups == "gpu"
    assert backup_beside("cuda", keep, nbytes=2**20, room=2**30)
    assert not backup_beside("cuda", keep, nbytes=2**31, room=2**30)
    assert not backup_beside("cuda", False, nbytes=2**20, room=2**30)
    assert backup_beside("cpu", False, nbytes=2**31, room=0)
