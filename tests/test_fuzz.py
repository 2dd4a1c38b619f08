"""Stateful fuzz of the public engine API: no sequence of user actions may reach a device/dtype
mismatch, leave a tensor out of place, or lose the model's weights.

A Hypothesis state machine drives one `Engine` through random sequences of load_model,
set_dtype, set_offload, set_loras (set / append / remove / re-weight, every adapter algorithm,
strengths 0, negative and above 1, separate text-encoder strengths), prompt `<lora:…>` tags (for one generation only),
set_debug toggles (strict included), generate, the stage workflows (txt2img with hires fix whose hires
prompt re-weights a LoRA for the second pass and whose upscaler may be the demo upscaler model, img2img,
inpaint; each stage its own transition), Extras upscales with that model (loaded on use, with or without a
checkpoint), unload_upscaler and unload, while a plain model of the desired
state predicts what the engine must show. Some actions must be refused: a list holding a LoRA
made for the other architecture or missing from the folder (refused whole, nothing changes), a
generation with no model loaded. Switching architecture with LoRAs set loads the model without
the ones that do not fit (set aside, re-applied on switching back). After every step:

* placement: `placement.verify` finds nothing against the plan for the snapshot's dtype and
  offload mode, the snapshot reports no violation found (none is ever injected here, so even a
  repaired one would mean some code path misplaced a tensor) and the last history row is `ok`
  (or, for an action the engine must refuse, `failed, rolled back` with the state intact);
* the snapshot equals the desired state: model, family, dtype (fp16 on the CPU is stored
  as fp32 by policy), requested dtype, offload mode, applied LoRAs;
* weights, bit for bit: with no LoRA every tensor equals a freshly loaded pipeline at that dtype
  (the checkpoint) and the LoRA stack holds no backup; with LoRAs every tensor equals a fresh
  fuse of the same list (a new `LoraStack` on a fresh load) — so no history of slider moves,
  offload switches, reloads and generations changes what the same list produces. Under a
  streamed offload mode LoRAs are bypass forwards: every stored tensor is the checkpoint's, the
  bypassed layers are the fresh fuse's patched layers, and each one's output on a probe input
  equals the fresh fuse's within the dtype's rounding;
* hooks: each module carries exactly the named hooks its offload mode plans (tests/hook_plan.py),
  plus `lora.bypass` on the bypassed layers — nothing piles up across switches;
* the upscaler: loaded exactly when the model of the desired state says (used since the last unload or
  dtype change), placed as its own plan says for the current offload mode and its dtype rule, with that
  mode's hooks, and its weights bit-equal to the file's cast to that dtype.

Runs are deterministic (`derandomize=True`, no example database) with a fixed budget of at
least 2,000 engine transitions on the CPU; the `gpu` variant runs at least 500 on CUDA across
every offload mode in fp16 and bf16.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import re
import shutil
import types
from pathlib import Path

import pytest
import torch
from gpu_form import pick
from hook_plan import actual_hooks, expected_hooks
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from layer_probe import layer_output
from PIL import Image

from app.adapters.errors import LoraApplyError
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.adapters.synthetic import ALGORITHMS, write_adapter
from app.demo import build_tiny_pipeline
from app.diagnostics import set_debug_logging
from app.engine import offload, placement, storage
from app.engine.generate import GenerateParams
from app.engine.stage_params import MASKED_CONTENT, RESIZE_MODES, HiresParams
from app.engine.upscaler_slot import COMPONENT
from app.engine.worker import Engine, EngineState
from app.families import family
from app.settings import DTYPE_CHOICES, OFFLOAD_CHOICES, Settings
from app.upscalers import arch as upscaler_arch
from app.upscalers import files as upscaler_files
from app.upscalers.demo import DEMO_FOLDER, DEMO_NAME
from app.upscalers.extras import ExtrasParams

FAMILY_NAMES = ("sd15", "sdxl", "flux-dev", "zimage-turbo", "flux2-klein-4b")
MODELS = {family_name: f"tiny-{family_name}.safetensors" for family_name in FAMILY_NAMES}
# Strengths a slider or the API can send: zero, negative, above one, beyond the slider range.
STRENGTHS = (0.0, 1.0, 0.5, -1.0, 1.1, 2.5, -0.3, 4.0)
# (file stem suffix, algorithm, key layout, stored dtype): every algorithm once, plain LoRA in
# three more spellings, and files stored in fp16/bf16 as well as fp32.
ADAPTERS = tuple(
    (algo, algo, "kohya" if algo in ("lora", "dora") else "lycoris", torch.bfloat16 if i % 3 == 1 else torch.float32)
    for i, algo in enumerate(ALGORITHMS)
) + (
    ("lora-peft", "lora", "peft", torch.float16),
    ("lora-ldm", "lora", "kohya_ldm", torch.float32),
    ("dora-peft", "dora", "peft", torch.float32),
)
FUZZ_STEPS = 2  # steps per generation: enough to run the scheduler twice, cheap on two CPU cores
SAMPLERS = ("Euler", "DDIM", "Euler a")
MAX_LORAS = 4  # appends beyond this remove one instead, so lists stay varied rather than full

# Relative frequency of each action. Reloads and generations cost ~10× a LoRA change on the
# CPU, so they are rarer; every action still occurs dozens of times across the budget.
# The stage workflows run two or three passes each, so generate gives them part of its share.
ACTION_WEIGHTS = {
    "set_loras": 5, "append_lora": 6, "remove_lora": 4, "reweight_lora": 6, "set_offload": 5,
    "set_debug": 3, "generate": 2, "set_dtype": 1, "set_weights": 1, "load_model": 1, "unload": 1,
    "refused_set_loras": 1, "hires": 1, "img2img": 1, "inpaint": 1,
    "upscale": 1, "unload_upscaler": 1,
}
HIRES_UPSCALERS = ("Latent", "Latent (nearest)", "Lanczos", DEMO_NAME)
WORKFLOW_ROWS = {"hires": ("txt2img_hires", "hires fix"), "img2img": ("img2img", "img2img"),
                 "inpaint": ("inpaint", "inpaint")}  # (command name, last stage's row)
WEIGHTED_ACTIONS = tuple(a for a, n in ACTION_WEIGHTS.items() for _ in range(n))


def make_fuzz_data(demo_dir: Path, target: Path) -> Path:
    """A data folder with the demo checkpoints (hard links) and one adapter file per entry of
    `ADAPTERS` and family, written against the same tiny pipelines the checkpoints hold
    (a DiT has no convolutions and no LDM names: the Tucker and LDM-named entries are left out)."""
    for sub in ("models/Stable-diffusion", "embeddings", f"models/{DEMO_FOLDER}"):
        shutil.copytree(demo_dir / sub, target / sub, copy_function=os.link)
    lora_dir = target / "models" / "Lora"
    for family_name in FAMILY_NAMES:
        pipe = build_tiny_pipeline(family_name)  # seed 0, like the demo checkpoints
        targets = family(family_name).test_kit.lora_targets
        for i, (stem, algo, layout, dtype) in enumerate(ADAPTERS):
            if family(family_name).denoiser != "unet" and ("tucker" in algo or layout == "kohya_ldm"):
                continue
            # A cyclic window of the default targets: adapters overlap partly, as real ones do,
            # and each touches ~10 layers (re-fusing cost grows with layers × stacked adapters).
            window = tuple(targets[(2 * i + k) % len(targets)] for k in range(5))
            kwargs = dict(seed=100 + i, alpha=2.0 if i % 2 else None, strength=0.5)
            path = lora_dir / f"{family_name}-{stem}.safetensors"
            for chosen in (window, targets):  # a window may hold no layer the algorithm applies to (norm, Tucker)
                try:
                    write_adapter(path, pipe, family_name, algo, layout, dtype, targets=chosen, **kwargs)
                    break
                except ValueError:
                    continue  # neither does the family (a norm adapter on Z-Image, whose norms are all RMSNorm)
    return target


def lora_names(data_dir: Path, family_name: str | None = None) -> tuple[str, ...]:
    """The adapter files of the fuzz's data folder (those written for `family_name`, or all)."""
    names = sorted(p.stem for p in (data_dir / "models" / "Lora").glob("*.safetensors"))
    return tuple(n for n in names if family_name is None or n.startswith(f"{family_name}-"))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers, so equality is bit-exact (NaN, -0.0 included)."""
    t = tensor.detach().cpu()
    if t.is_floating_point():
        t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _module_digest(module: torch.nn.Module) -> str:
    return _digest(module.weight, getattr(module, "bias", None))


def _digest(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
            h.update(_bits(t).reshape(-1).contiguous().numpy().tobytes())
    return h.hexdigest()


def _module(pipe, target: tuple[str, str]) -> torch.nn.Module:
    return getattr(pipe, target[0]).get_submodule(target[1])


class References:
    """Fresh loads per (model, dtype) and fresh fuses of LoRA lists on them, for comparison.

    A reference engine loads each (model, dtype request) once; its pipeline stays pristine (the
    checkpoint) between checks, and its tensors' bits are kept as the checkpoint's. A fresh fuse
    is a brand-new `LoraStack` on that pipeline: reconcile the list, digest each patched module,
    reconcile back to nothing, and prove the restore bit-exact before the next use.
    """

    def __init__(self, data_dir: Path, device: str) -> None:
        self.data_dir, self.device = data_dir, device
        self._engines: dict[tuple[str, str], Engine] = {}
        self._checkpoint: dict[tuple[str, str], list] = {}
        self._pristine: dict[tuple[str, str], dict[tuple[str, str], str]] = {}
        self._fused: dict[tuple, dict[tuple[str, str], str]] = {}
        self._probes: dict[tuple, dict[tuple[str, str], torch.Tensor]] = {}
        self.fuses = 0

    def engine(self, model: str, dtype: str, weights: str = "full") -> Engine:
        key = (model, dtype, weights)
        if key not in self._engines:
            eng = Engine(Settings(data_dir=self.data_dir, device=self.device, weights=weights))
            eng.load_model(model, dtype=dtype)
            self._engines[key] = eng
            self._pristine[key] = {}
            self._checkpoint[key] = [((c, p, n), t.dtype, t.shape, _bits(t).clone())
                                     for c, p, _m, n, t, _ in placement.iter_tensors(eng.pipeline)]
        return self._engines[key]

    def checkpoint(self, model: str, dtype: str, weights: str = "full") -> list:
        """[(component, module, tensor name), dtype, shape, bits] of a fresh load, in iteration order."""
        self.engine(model, dtype, weights)
        return self._checkpoint[(model, dtype, weights)]

    def fused_digests(self, model: str, dtype: str, family_name: str, specs: tuple[LoraSpec, ...],
                      weights: str = "full"):
        """{(component, module): digest of weight+bias} of a fresh fuse of `specs` (with fp8 weights, a
        fresh bypass: fusing into 8-bit weights is never done; the digests are then the checkpoint's)."""
        key = (model, dtype, specs, weights)
        if key in self._fused:
            return self._fused[key]
        eng = self.engine(model, dtype, weights)
        pipe, pristine = eng.pipeline, self._pristine[(model, dtype, weights)]
        # fusion math on the compute device, as the engine does
        stack = LoraStack(pipe, family_name, eng.device, bypass=offload.bypass_components(eng.placement_plan))
        files = {s.name: eng.library.open(s.name) for s in specs}
        for spec in specs:
            for target in stack.prepare(spec.name, files[spec.name]).layers:
                pristine.setdefault(target, _module_digest(_module(pipe, target)))
        stack.reconcile(specs, files)
        digests = {t: _module_digest(_module(pipe, t)) for t in stack.patched_modules()}
        self._probes[key] = {t: layer_output(_module(pipe, t), pipe.compute_dtypes[t[0]]) for t in digests}
        stack.reconcile((), {})
        assert all(_module_digest(_module(pipe, t)) == pristine[t] for t in digests), \
            "reference LoraStack did not restore exactly"
        self.fuses += 1
        self._fused[key] = digests
        return digests

    def probes(self, model: str, dtype: str, family_name: str, specs: tuple[LoraSpec, ...], weights: str = "full"):
        """{(component, module): output of the freshly fused layer on its probe input}."""
        self.fused_digests(model, dtype, family_name, specs, weights)
        return self._probes[(model, dtype, specs, weights)]

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()


def assert_weights(engine: Engine, refs: References, model: str, dtype: str, family_name: str,
                   specs: tuple[LoraSpec, ...], weights: str) -> None:
    """Every tensor of the engine's pipeline equals the checkpoint's bit for bit, except the
    weight and bias of modules a fresh fuse of `specs` patches, which equal that fuse bit for bit
    (fusion runs on the compute device in every offload mode, so on a GPU too the bits cannot
    depend on where a weight rested when it was fused). Under a streamed offload mode LoRAs are
    bypass forwards: then every stored tensor is the checkpoint's, the bypassed layers are the
    fresh fuse's, and their outputs on a probe input equal the fresh fuse's within rounding."""
    fused = refs.fused_digests(model, dtype, family_name, specs, weights) if specs else {}
    stack = engine.lora_stack
    bypass = bool(stack.bypass_components)
    checkpoint = refs.checkpoint(model, dtype, weights)
    mine = [((c, p, n), t) for c, p, _m, n, t, _ in placement.iter_tensors(engine.pipeline)]
    assert [(k, t.dtype, t.shape) for k, t in mine] == [(k, d, s) for k, d, s, _ in checkpoint], \
        "pipeline structure differs from a fresh load"
    for (key, tensor), (*_, bits) in zip(mine, checkpoint, strict=True):
        if key[:2] in fused and key[2] in ("weight", "bias") and not bypass:
            continue
        assert torch.equal(_bits(tensor), bits), f"{'.'.join(key)} differs from the checkpoint"
    assert set(stack.patched_modules()) == set(fused), "patched layers differ from a fresh fuse's"
    if not bypass:
        for target, digest in fused.items():
            assert _module_digest(_module(engine.pipeline, target)) == digest, f"{target} differs from a fresh fuse"
        return
    assert set(stack.bypassed()) == set(fused), "bypassed layers differ from a fresh fuse's patched layers"
    tolerance = {torch.float32: 2e-5}.get(placement.DTYPES[dtype], 4e-2)
    for target, want in (refs.probes(model, dtype, family_name, specs, weights) if specs else {}).items():
        got = layer_output(_module(engine.pipeline, target), engine.pipeline.compute_dtypes[target[0]])
        assert float((got - want).abs().max()) <= tolerance * float(want.abs().max()), f"{target}: bypass != fuse"


@dataclasses.dataclass
class FuzzConfig:
    data_dir: Path
    device: str
    dtypes: tuple[str, ...]
    refs: References
    stats: collections.Counter
    usable: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    refused: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    upscaler_file: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # the demo upscaler's tensors
    upscaler_model: object = None  # spandrel's descriptor of it (for its dtype rule)
    # The families loads draw from, in this order: the two halves of the CPU budget draw the same
    # random choices, so each half lists them in its own order to walk different sequences.
    families: tuple[str, ...] = FAMILY_NAMES

    def __post_init__(self) -> None:
        """Sort every adapter file, per loaded family, into usable or refused by asking the
        engine (`inspect_lora`): the synthetic SDXL files that touch only layers SD1.5 has with the
        same shapes (Tucker convs, say) legitimately fit both, and are usable on both."""
        for family_name in FAMILY_NAMES:
            dtype = placement.dtype_name(placement.resolve_dtype(self.dtypes[0], torch.device(self.device)))
            eng = self.refs.engine(MODELS[family_name], dtype)
            usable, refused = [], []
            for name in lora_names(self.data_dir):
                try:
                    eng.inspect_lora(name)
                    usable.append(name)
                except LoraApplyError:
                    refused.append(name)
            assert set(lora_names(self.data_dir, family_name)) <= set(usable), refused
            self.usable[family_name], self.refused[family_name] = tuple(usable), tuple(refused)
        path = self.data_dir / "models" / DEMO_FOLDER / f"{DEMO_NAME}.safetensors"
        self.upscaler_file = upscaler_files.read_state_dict(path)
        self.upscaler_model = upscaler_arch.describe(self.upscaler_file, DEMO_NAME)


class EngineMachine(RuleBasedStateMachine):
    """The desired state (what the user asked for) beside the engine that must realise it."""

    config: FuzzConfig  # set by the test before the run

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        # Strict forwards: every module's forward checks its tensors' placement (app/engine/strict.py).
        self.engine = Engine(Settings(data_dir=cfg.data_dir, device=cfg.device, strict_forwards=True))
        self.model: str | None = None
        self.family = "sd15"  # the family LoRA choices are made for (kept across unload)
        self.requested = "auto"
        self.offload = "none"
        self.weights = "full"
        self.desired: tuple[LoraSpec, ...] = ()
        # What must be fused: desired (plus the last generation's prompt tags), minus what cannot fit.
        self.applied: tuple[LoraSpec, ...] = ()
        self.debug = {"lora_debug": False, "move_debug": False, "strict": False}
        self.expect_failure = False
        self.last_command = ""
        self.upscaler_for: str | None = None  # the dtype request the upscaler was loaded under; None: not loaded

    def teardown(self) -> None:
        try:
            self.engine.unload()  # a retained log record may pin this engine object; never its pipeline
        finally:
            self.engine.close()
            set_debug_logging(False, False)

    # ------------------------------------------------------------------ helpers
    def _count(self, command: str, expect_failure: bool = False, row: str | None = None) -> None:
        """Count an action; `row` is the history row it must end with when that is not `command`."""
        self.config.stats[command] += 1
        self.config.stats["transitions"] += 1
        self.last_command, self.expect_failure = row or command, expect_failure

    def _requested(self, dtype: str) -> None:
        """A new dtype request drops the upscaler (it is read again in the new dtype at its next use)."""
        if self.upscaler_for is not None and self.upscaler_for != dtype:
            self.upscaler_for = None
        self.requested = dtype

    def _usable(self) -> tuple[str, ...]:
        return self.config.usable[self.family]

    def _sampler(self, data) -> str:
        """A sampler the family has (Flux: flow-match Euler only)."""
        own = family(self.family).sampling.samplers
        return data.draw(st.sampled_from([s for s in SAMPLERS if s in own]), label="sampler")

    def _spec(self, data, name: str) -> LoraSpec:
        weight = data.draw(st.sampled_from(STRENGTHS), label="weight")
        te = data.draw(st.one_of(st.none(), st.sampled_from(STRENGTHS)), label="te_weight")
        return LoraSpec(name, weight=weight, te_weight=te)

    def _fitting(self, specs: tuple[LoraSpec, ...], family_name: str) -> tuple[LoraSpec, ...]:
        return tuple(s for s in specs if s.name in self.config.usable[family_name])

    def _set(self, specs: tuple[LoraSpec, ...]) -> None:
        """set_loras: with a model loaded, a list holding a LoRA that cannot apply to it (made for
        the other architecture, or missing from the folder) must be refused whole, leaving model,
        stack and desired list as they were; otherwise the list becomes desired and applied."""
        unusable = [s.name for s in specs if s.name not in self._usable()]
        if self.model is not None and unusable:
            self._count("set_loras", expect_failure=True)
            self.config.stats["refused"] += 1
            blamed = "|".join(re.escape(n) for n in unusable)
            # "LoRA 'x': <why>", or the library's own "LoRA 'x' not found in <folder>" for a missing file
            with pytest.raises(LoraApplyError, match=rf"LoRA '({blamed})'(: | not found in )"):
                self.engine.set_loras(list(specs))
            return
        self._count("set_loras")
        self.engine.set_loras(list(specs))
        self.desired = specs
        self.applied = specs if self.model else ()

    def _load(self, family_name: str, dtype: str | None) -> None:
        """load_model: the desired list is re-applied minus what does not fit the new model (set
        aside, not fatal: switching back re-applies it)."""
        self._count("load_model")
        self.engine.load_model(MODELS[family_name], dtype=dtype)
        self.model, self.family = MODELS[family_name], family_name
        self._requested(dtype or self.requested)
        self.applied = self._fitting(self.desired, family_name)
        if len(self.applied) < len(self.desired):
            self.config.stats["set_aside"] += 1

    # ------------------------------------------------------------------ actions
    @initialize(data=st.data())
    def first_load(self, data) -> None:
        family_name = data.draw(st.sampled_from(self.config.families), label="family")
        self.requested = data.draw(st.sampled_from(self.config.dtypes), label="dtype")
        self._load(family_name, self.requested)

    @rule(action=st.sampled_from(WEIGHTED_ACTIONS), data=st.data())
    def act(self, action: str, data) -> None:
        getattr(self, f"_do_{action}")(data)

    def _do_set_loras(self, data) -> None:
        names = data.draw(st.lists(st.sampled_from(self._usable()), unique=True, max_size=4), label="names")
        self._set(tuple(self._spec(data, n) for n in names))

    def _do_append_lora(self, data) -> None:
        if len(self.desired) >= MAX_LORAS:
            return self._do_remove_lora(data)
        free = [n for n in self._usable() if n not in {s.name for s in self.desired}]
        self._set(self.desired + (self._spec(data, data.draw(st.sampled_from(free), label="append")),))

    def _do_remove_lora(self, data) -> None:
        if not self.desired:
            return self._set(())
        i = data.draw(st.integers(0, len(self.desired) - 1), label="remove index")
        self._set(self.desired[:i] + self.desired[i + 1:])

    def _do_reweight_lora(self, data) -> None:
        if not self.desired:
            return self._do_append_lora(data)
        i = data.draw(st.integers(0, len(self.desired) - 1), label="reweight index")
        self._set(self.desired[:i] + (self._spec(data, self.desired[i].name),) + self.desired[i + 1:])

    def _do_refused_set_loras(self, data) -> None:
        """Insert a LoRA the loaded model cannot take (other architecture, or a missing file) into
        the current list; with no model loaded the list is simply stored."""
        listed = {s.name for s in self.desired}  # a duplicate would be refused before queueing
        bad = data.draw(st.sampled_from([n for n in (*self.config.refused[self.family], "missing-lora")
                                         if n not in listed]), label="refused")
        specs = list(self.desired)
        specs.insert(data.draw(st.integers(0, len(specs)), label="at"), LoraSpec(bad, 1.0))
        self._set(tuple(specs))

    def _do_set_offload(self, data) -> None:
        mode = data.draw(st.sampled_from(OFFLOAD_CHOICES), label="offload")
        self._count("set_offload")
        self.engine.set_offload(mode)
        self.offload = mode

    def _do_set_weights(self, data) -> None:
        weights = data.draw(st.sampled_from(("full", "fp8")), label="weights")
        self._count("set_weights")
        self.engine.set_weights(weights)
        self.weights = weights
        self.applied = self._fitting(self.desired, self.family) if self.model else ()

    def _do_set_dtype(self, data) -> None:
        dtype = data.draw(st.sampled_from(self.config.dtypes), label="dtype")
        self._count("set_dtype")
        self.engine.set_dtype(dtype)
        self._requested(dtype)
        self.applied = self._fitting(self.desired, self.family) if self.model else ()

    def _do_load_model(self, data) -> None:
        family_name = data.draw(st.sampled_from(self.config.families), label="family")
        dtype = data.draw(st.one_of(st.none(), st.sampled_from(self.config.dtypes)), label="dtype")
        self._load(family_name, dtype)

    def _do_unload(self, data) -> None:
        self._count("unload")
        self.engine.unload()
        self.model, self.applied = None, ()

    def _do_set_debug(self, data) -> None:
        changes = {k: data.draw(st.booleans(), label=k) for k in self.debug}
        self.engine.set_debug(**changes)
        self.debug = changes
        self.config.stats["set_debug"] += 1

    def _do_generate(self, data) -> None:
        tagged = data.draw(st.lists(st.sampled_from(self._usable()), unique=True, max_size=2), label="tags")
        tags = tuple(LoraSpec(n, weight=data.draw(st.sampled_from(STRENGTHS), label="tag weight")) for n in tagged)
        prompt = "a cat " + " ".join(f"<lora:{s.name}:{s.weight!r}>" for s in tags)
        params = GenerateParams(prompt, steps=FUZZ_STEPS, width=64, height=64, cfg=5.0, sampler=self._sampler(data),
                                seed=data.draw(st.integers(0, 2**32 - 1), label="seed"))
        if self.model is None:
            self._count("generate", expect_failure=True)
            with pytest.raises(RuntimeError, match="no model loaded"):
                self.engine.generate(params)
            return
        self._count("generate")
        images = self.engine.generate(params)
        assert len(images) == 1 and images[0].image.size == (64, 64)
        merged = {s.name: s for s in self.desired}
        merged.update({s.name: s for s in tags})
        for spec in self._fitting(tuple(merged.values()), self.family):  # the run carried every fitting tag
            assert f"{spec.name}: {spec.unet_strength:g}" in images[0].infotext, (spec, images[0].infotext)

    def _workflow(self, data, action: str, run) -> None:
        """Run a stage workflow: refused without a model; otherwise its last row is its last stage's,
        or `restore_loras` when prompt tags changed the LoRAs for a pass."""
        command, last_stage = WORKFLOW_ROWS[action]
        seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
        params = GenerateParams("a cat", steps=FUZZ_STEPS, width=64, height=64, cfg=5.0, seed=seed,
                                sampler=self._sampler(data))
        tags = ()
        if self._usable() and data.draw(st.booleans(), label="tagged"):
            name = data.draw(st.sampled_from(self._usable()), label="tag")
            tags = (LoraSpec(name, weight=data.draw(st.sampled_from(STRENGTHS), label="tag weight")),)
        if self.model is None:
            self._count(action, expect_failure=True, row=command)
            with pytest.raises(RuntimeError, match="no model loaded"):
                run(params, tags)
            return
        merged = {s.name: s for s in self.desired}
        merged.update({s.name: s for s in tags})
        retagged = bool(tags) and tuple(merged.values()) != self.desired
        self._count(action, row="restore_loras" if retagged else last_stage)
        images = run(params, tags)
        assert len(images) == 1 and images[0].image.size in ((64, 64), (80, 80)), images

    def _do_hires(self, data) -> None:
        """Hires fix; a tag in the hires prompt sets that LoRA's strength for the second pass only."""
        upscaler = data.draw(st.sampled_from(HIRES_UPSCALERS), label="upscaler")

        def run(params, tags):
            prompt = _tagged(params, tags).prompt if tags else ""
            return self.engine.generate(params, hires=HiresParams(1.25, upscaler, 0, 0.5, prompt=prompt))
        self._workflow(data, "hires", run)
        if upscaler == DEMO_NAME and self.model is not None:
            self.upscaler_for = self.requested
            self.config.stats["hires_model"] += 1

    def _do_upscale(self, data) -> None:
        """Extras with the demo upscaler model (loaded on use, checkpoint or not): by a factor or to a
        size (cropped), sometimes blended with Lanczos."""
        to_size = data.draw(st.booleans(), label="scale to")
        factor = data.draw(st.sampled_from((1.5, 2.0, 4.0)), label="factor")
        second = data.draw(st.sampled_from(("None", "Lanczos")), label="upscaler 2")
        params = ExtrasParams(DEMO_NAME, int(to_size), factor, 96, 80, True, second, 0.5)
        self._count("upscale")
        [result] = self.engine.extras([INIT_IMAGE], params)
        width, height = INIT_IMAGE.size
        want = (96, 80) if to_size else (int(width * factor) // 8 * 8, int(height * factor) // 8 * 8)
        assert result.image.size == want and f"Postprocess upscaler: {DEMO_NAME}" in result.infotext
        self.upscaler_for = self.requested

    def _do_unload_upscaler(self, data) -> None:
        self._count("unload_upscaler")
        self.engine.unload_upscaler()
        self.upscaler_for = None

    def _do_img2img(self, data) -> None:
        mode = data.draw(st.sampled_from(RESIZE_MODES), label="resize mode")
        self._workflow(data, "img2img", lambda params, tags: self.engine.img2img(
            _tagged(params, tags), [INIT_IMAGE], denoising_strength=0.5, resize_mode=mode))

    def _do_inpaint(self, data) -> None:
        fill = data.draw(st.sampled_from(MASKED_CONTENT), label="masked content")
        self._workflow(data, "inpaint", lambda params, tags: self.engine.inpaint(
            _tagged(params, tags), INIT_IMAGE, MASK, denoising_strength=1.0, inpainting_fill=fill))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def engine_matches_desired_state(self) -> None:
        snap = self.engine.snapshot()
        if self.last_command:
            row = snap.history[-1]
            want = "failed, rolled back" if self.expect_failure else "ok"
            assert (row.command, row.outcome) == (self.last_command, want), row
        assert snap.violations == () and snap.violations_found_total == 0, snap.violations
        assert snap.requested_dtype == self.requested and snap.offload == self.offload
        assert snap.weights == self.weights
        assert {k: getattr(self.engine.settings, k) for k in self.debug} == self.debug
        if self.model is None:
            assert snap.state == EngineState.EMPTY.value and snap.model is None and self.engine.pipeline is None
            return
        dtype = placement.dtype_name(placement.resolve_dtype(self.requested, self.engine.device))
        assert snap.state == EngineState.READY.value
        assert (snap.model, snap.family, snap.dtype) == (self.model, self.family, dtype)
        assert snap.loras == self.applied, (snap.loras, self.applied)
        for spec in self.applied:
            counters = snap.lora_counters[spec.name]
            assert counters.matched_layers > 0 and not counters.disabled, (spec.name, counters)

    @invariant()
    def every_tensor_where_the_plan_says(self) -> None:
        if self.model is None:
            return
        snap = self.engine.snapshot()
        stored = storage.layers_to_store(self.engine.pipeline, family(self.family), self.weights)
        plan = offload.plan_for(self.engine.pipeline, placement.DTYPES[snap.dtype], self.engine.device,
                                snap.offload, stored=storage.dtypes(stored))
        # Which components an offload strategy keeps on the GPU between commands is its own call
        # (balanced mode); everything else about the plan is recomputed here from the snapshot.
        resident = self.engine.placement_plan.resident
        assert snap.offload in ("none", "balanced") or not resident, (snap.offload, resident)
        assert placement.verify(self.engine.pipeline, plan.with_resident(resident)) == []

    @invariant()
    def weights_equal_checkpoint_or_fresh_fuse(self) -> None:
        if self.model is None:
            return
        dtype = placement.dtype_name(placement.resolve_dtype(self.requested, self.engine.device))
        assert_weights(self.engine, self.config.refs, self.model, dtype, self.family, self.applied, self.weights)
        stack = self.engine.lora_stack
        bypass = offload.MODES[self.offload].streams_weights or self.weights != "full"
        assert bool(stack.bypass_components) == bypass, (stack.bypass_components, self.offload, self.weights)
        if not self.applied or bypass:
            assert stack._backups == {}, "backups kept after every LoRA was removed or while bypassed"
        if not self.applied:
            assert stack.bypassed() == {}, "bypass hooks kept after every LoRA was removed"

    @invariant()
    def every_module_carries_the_hooks_its_mode_plans(self) -> None:
        if self.model is None:
            return
        snap = self.engine.snapshot()
        refs, specs = self.config.refs, self.applied
        fused = refs.fused_digests(self.model, snap.dtype, self.family, specs, self.weights) if specs else {}
        bypass = offload.MODES[self.offload].streams_weights or self.weights != "full"
        stored = storage.layers_to_store(self.engine.pipeline, family(self.family), self.weights)
        model_hooks = {where: names for where, names in actual_hooks(snap).items() if where[0] != COMPONENT}
        assert model_hooks == expected_hooks(self.engine.pipeline, self.offload, set(fused) if bypass else set(),
                                             {(c, p) for c, paths in stored.items() for p in paths}, strict=True)

    @invariant()
    def the_upscaler_is_loaded_placed_and_hooked_as_planned(self) -> None:
        """Loaded exactly when used since the last unload or dtype change; every tensor at its plan's
        placement for the current offload mode in its dtype rule's dtype, bit-equal to the file's cast to
        it; the mode's hooks and no others."""
        snap, slot = self.engine.snapshot(), self.engine.upscaler_slot
        if self.upscaler_for is None:
            assert snap.upscaler is None and slot.model is None, snap.upscaler
            return
        wanted = placement.resolve_dtype(self.upscaler_for, self.engine.device)
        dtype = upscaler_arch.compute_dtype(self.config.upscaler_model, wanted)
        assert (snap.upscaler.name, snap.upscaler.offload, snap.upscaler.dtype) == \
            (DEMO_NAME, self.offload, placement.dtype_name(dtype))
        compute = placement.Placement(self.engine.device, dtype)
        rest = placement.Placement(torch.device("cpu"), dtype) if offload.MODES[self.offload].moves_weights else compute
        plan = placement.PlacementPlan(self.engine.device, dtype, self.offload,
                                       {COMPONENT: placement.ComponentPlan(rest=rest, compute=compute)})
        holder = types.SimpleNamespace(components={COMPONENT: slot.model})
        assert placement.verify(holder, plan.with_resident(slot.plan.resident)) == []
        for name, tensor in slot.model.state_dict().items():
            assert torch.equal(_bits(tensor), _bits(self.config.upscaler_file[name].to(dtype))), name
        upscaler_hooks = {where: names for where, names in actual_hooks(snap).items() if where[0] == COMPONENT}
        assert upscaler_hooks == expected_hooks(holder, self.offload)


INIT_IMAGE = Image.new("RGB", (80, 48), (40, 140, 90))
MASK = Image.new("L", (80, 48), 0)
MASK.paste(255, (20, 8, 60, 40))


def _tagged(params: GenerateParams, tags: tuple[LoraSpec, ...]) -> GenerateParams:
    """`params` with a `<lora:name:w>` tag per spec in the prompt."""
    tagged = " ".join([params.prompt, *(f"<lora:{t.name}:{t.weight!r}>" for t in tags)])
    return dataclasses.replace(params, prompt=tagged)


def run_fuzz(config: FuzzConfig, examples: int, steps: int) -> None:
    EngineMachine.config = config
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, derandomize=True, database=None, deadline=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
        print_blob=False))


@pytest.fixture(scope="module")
def fuzz_data(demo_dir, tmp_path_factory) -> Path:
    return make_fuzz_data(demo_dir, tmp_path_factory.mktemp("fuzz"))


# The fixed CI budget, in two halves (this module and test_fuzz_second_half.py), so the two xdist
# workers can run them at once instead of one worker running the whole fuzz alone at the end of the
# suite. derandomize=True replays the same examples on every run (~1,200 transitions a half; it shifts
# only when the state machine, these settings or Hypothesis change: hence the margin).
CPU_EXAMPLES, CPU_STEPS, CPU_MIN_TRANSITIONS = 16, 110, 1000


def run_cpu_fuzz(fuzz_data: Path, record_property, family_names: tuple[str, ...]) -> None:
    """One half of the CPU budget, its loads drawn from `family_names` in that order; the invariants hold after
    every transition, and every action ran often enough to mean something."""
    refs = References(fuzz_data, "cpu")
    config = FuzzConfig(fuzz_data, "cpu", DTYPE_CHOICES, refs, collections.Counter(), families=family_names)
    try:
        run_fuzz(config, CPU_EXAMPLES, CPU_STEPS)
    finally:
        refs.close()
    record_property("fuzz_stats", dict(config.stats))
    print(f"fuzz cpu: {dict(config.stats)}, reference fuses {refs.fuses}")
    assert config.stats["transitions"] >= CPU_MIN_TRANSITIONS, dict(config.stats)
    for action in ("set_loras", "set_offload", "set_dtype", "set_weights", "load_model", "unload", "generate",
                   "set_debug", "refused", "hires", "img2img", "inpaint", "upscale", "unload_upscaler"):
        assert config.stats[action] >= 10, (action, dict(config.stats))
    assert config.stats["set_aside"] >= 3, dict(config.stats)  # loads that set foreign LoRAs aside
    assert config.stats["hires_model"] >= 2, dict(config.stats)


@pytest.mark.timeout(1200)  # passing: ~230 s in an xdist worker; a failure adds up to 5 min of shrinking
def test_fuzz_engine_api_cpu(fuzz_data, record_property):
    """First half of ≥2,000 random transitions on the CPU (every fuzzed family, every dtype request,
    every offload mode, every adapter algorithm, strengths 0/negative/>1, prompt tags, debug and
    strict toggles) keep placement clean, the snapshot equal to the desired state and the weights
    bit-equal to the checkpoint or to a fresh fuse of the same LoRA list."""
    run_cpu_fuzz(fuzz_data, record_property, FAMILY_NAMES)


@pytest.mark.gpu
@pytest.mark.timeout(1200)
def test_fuzz_engine_api_gpu(fuzz_data, record_property):
    """≥500 random transitions (60 in the fast form) on CUDA across every offload mode in fp16 and bf16: the same
    invariants, bit-exact too — weights rest on the CPU or the GPU depending on the mode, but
    fusion always runs on the GPU, so the same list must give the same bits in every mode."""
    refs = References(fuzz_data, "cuda")
    config = FuzzConfig(fuzz_data, "cuda", ("fp16", "bf16"), refs, collections.Counter())
    try:
        run_fuzz(config, *pick((14, 70), (3, 30)))
    finally:
        refs.close()
    record_property("fuzz_stats", dict(config.stats))
    print(f"fuzz gpu: {dict(config.stats)}")
    assert config.stats["transitions"] >= pick(500, 60), dict(config.stats)
