"""LoRAs that match the model only in part: never quiet, and refused below half unless allowed.

A file of 60 tensors (kohya `lora_down`/`lora_up` pairs on the tiny SD1.5 UNet, plus pairs naming a
block the model lacks) is applied with 10 or with 40 of its tensors matching nothing. Weights are
checked against the float64 formula W0 + w·B@A (no alpha: scale 1) and removal bit for bit.
"""

from __future__ import annotations

import logging
import re

import gradio as gr
import pytest
import torch
from safetensors.torch import save_file

from app.adapters.errors import LoraApplyError
from app.adapters.files import read_adapter
from app.adapters.patcher import LoraStack
from app.adapters.specs import LoraSpec
from app.demo import build_tiny_pipeline
from app.engine import lora_options
from app.settings import Settings
from app.ui import views
from app.ui.common import MAX_LORAS, UiContext
from app.ui.lora_panel import allow_partial_event, build_lora_panel, slot_updates

TOTAL, RANK = 60, 4


@pytest.fixture(scope="module")
def sd15():
    """A tiny fp32 SD1.5 pipeline and its original UNet tensors (each test restores them bit for bit)."""
    pipe = build_tiny_pipeline("sd15")
    return pipe, {k: v.clone() for k, v in pipe.unet.state_dict().items()}


def _write(path, unet, unmatched: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoRA of TOTAL tensors of which `unmatched` name a block the UNet lacks; returns the float64
    ΔW = up@down of each Linear it reaches, by module path."""
    g = torch.Generator().manual_seed(seed)
    linears = [(p, m) for p, m in unet.named_modules() if isinstance(m, torch.nn.Linear)]
    tensors, expected = {}, {}
    for path_, module in linears[: (TOTAL - unmatched) // 2]:
        down = torch.randn(RANK, module.in_features, generator=g, dtype=torch.float64) * 0.1
        up = torch.randn(module.out_features, RANK, generator=g, dtype=torch.float64) * 0.1
        key = f"lora_unet_{path_.replace('.', '_')}"
        tensors.update({f"{key}.lora_down.weight": down.float(), f"{key}.lora_up.weight": up.float()})
        expected[path_] = up @ down
    for i in range(unmatched // 2):
        key = f"lora_unet_down_blocks_9_attentions_0_proj_{i:02d}"
        tensors.update({f"{key}.lora_down.weight": torch.ones(RANK, 8), f"{key}.lora_up.weight": torch.ones(8, RANK)})
    assert len(tensors) == TOTAL
    save_file(tensors, str(path))
    return expected


def _assert_formula(unet, pristine, expected: dict[str, torch.Tensor], strength: float) -> None:
    for key, original in pristine.items():
        path, now = key.removesuffix(".weight"), unet.state_dict()[key]
        if path not in expected or not key.endswith(".weight"):
            assert torch.equal(now, original), f"{key} changed but no layer targets it"
            continue
        reference = original.double() + strength * expected[path]
        assert float((now.double() - reference).abs().max()) <= 4 * torch.finfo(torch.float32).eps * float(
            reference.abs().max()), key


def _assert_restored(unet, pristine) -> None:
    for key, original in pristine.items():
        assert torch.equal(unet.state_dict()[key], original), f"{key} not restored"


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_ten_unmatched_of_sixty_apply_with_exactly_one_warning(sd15, tmp_path, caplog):
    """At default log settings, a LoRA that applies with 10 of its 60 tensors matching nothing logs one
    WARNING line naming the count, the total and the first keys — once for this LoRA on this model:
    a re-weight, a removal and adding it back say nothing new. The 50 that match land on the formula."""
    pipe, pristine = sd15
    expected = _write(tmp_path / "most.safetensors", pipe.unet, unmatched=10)
    file = read_adapter("most", tmp_path / "most.safetensors")
    stack = LoraStack(pipe, "sd15")
    report = stack.reconcile([LoraSpec("most", 0.8)], {"most": file})["most"]
    assert (report.matched_layers, report.unmatched_keys, report.total_keys, report.partial) == (25, 10, 60, False)
    _assert_formula(pipe.unet, pristine, expected, 0.8)
    stack.reconcile([LoraSpec("most", 0.5)], {"most": file})
    stack.reconcile([], {})
    stack.reconcile([LoraSpec("most", 0.8)], {"most": file})
    (line,) = _warnings(caplog)
    assert line.levelno == logging.WARNING and line.name == "app.adapters.patcher"
    assert re.fullmatch(r"LoRA most applied in part: 10 of its 60 tensors matched nothing in this SD15 model, "
                        r"e\.g\. lora_unet_down_blocks_9_attentions_0_proj_00\.lora_down\.weight, \S+, \S+",
                        line.getMessage()), line.getMessage()
    stack.reconcile([], {})
    _assert_restored(pipe.unet, pristine)


def test_forty_unmatched_of_sixty_are_refused_unless_partial_application_is_allowed(sd15, tmp_path, caplog):
    """A LoRA of which only 20 of 60 tensors match is refused with the reason (counts, first keys, how
    to allow it) and nothing is written; where the user allows this LoRA to apply in part, its 10
    layers land on the formula, the report says so, the warning too, and removal restores every bit."""
    pipe, pristine = sd15
    expected = _write(tmp_path / "few.safetensors", pipe.unet, unmatched=40, seed=1)
    file = read_adapter("few", tmp_path / "few.safetensors")
    with pytest.raises(LoraApplyError, match=r"LoRA 'few': only 20 of its 60 tensors match this SD15 model \(40 "
                                             r"match nothing, e\.g\. lora_unet_down_blocks_9.*Allow partial "
                                             r"application for this LoRA to apply the 10 layers that match"):
        LoraStack(pipe, "sd15").reconcile([LoraSpec("few")], {"few": file})
    _assert_restored(pipe.unet, pristine)
    stack = LoraStack(pipe, "sd15", allows_partial=lambda name: name == "few")
    report = stack.reconcile([LoraSpec("few", 0.7)], {"few": file})["few"]
    assert (report.matched_layers, report.unmatched_keys, report.partial) == (10, 40, True)
    _assert_formula(pipe.unet, pristine, expected, 0.7)
    (line,) = _warnings(caplog)
    assert "few applied in part (partial application allowed for this LoRA): 40 of its 60" in line.getMessage()
    stack.reconcile([], {})
    _assert_restored(pipe.unet, pristine)


def test_the_allowance_is_remembered_per_lora_and_shown(engine):
    """Through the engine: the refused LoRA is set aside with the reason; `set_lora_partial` remembers
    the allowance in the data folder (a new engine reads it), applies the wanted list again (the LoRA
    now applies, the status line and Diagnostics name what it lost); the LoRA card's box shows the
    choice and, unticked, withdraws it: the LoRA is set aside again and the checkpoint's weights come
    back bit for bit. A name outside the library is not stored."""
    engine.load_model("tiny-sd15.safetensors")
    pristine = {k: v.clone() for k, v in engine.pipeline.unet.state_dict().items()}
    _write(engine.settings.lora_dir / "few.safetensors", engine.pipeline.unet, unmatched=40, seed=2)
    with pytest.raises(LoraApplyError, match="only 20 of its 60 tensors match"):
        engine.set_loras([LoraSpec("few")])
    snap = engine.set_loras([LoraSpec("few")], set_aside_unfit=True)
    assert snap.lora_states[0].status == "set aside" and "Allow partial application" in snap.lora_states[0].reason
    snap = engine.set_lora_partial("few", True)
    assert [s.name for s in snap.loras] == ["few"] and snap.lora_states[0].status == "applied"
    assert "⚠ few applied in part: 40 of its 60 tensors (20 layers) matched nothing" in views.status_html(snap)
    assert [row[3:5] for row in views.lora_rows(snap)] == [[10, 40]]
    assert engine.lora_partial_allowed("few") and lora_options.allows_partial(
        Settings(data_dir=engine.settings.data_dir), "few")
    with gr.Blocks():
        ctx = UiContext(engine, engine.settings)
        slots = build_lora_panel(ctx)
    box = slot_updates(ctx, ["few"], {})[-1 - MAX_LORAS]
    assert isinstance(box, gr.Checkbox) and box.value is True
    # allowed, request (none: the local admin), progress, the slots' names and sliders
    cards = allow_partial_event(ctx, slots, 0)["fn"](False, None, None, ["few"], *[1.0] * (2 * MAX_LORAS))
    assert "set aside" in cards[0].value and "Allow partial application" in cards[0].value
    snap = engine.snapshot()
    assert snap.loras == () and snap.lora_states[0].status == "set aside"
    _assert_restored(engine.pipeline.unet, pristine)
    assert not (engine.settings.lora_options_file.exists()
                and "few" in engine.settings.lora_options_file.read_text())
    with pytest.raises(FileNotFoundError):
        engine.set_lora_partial("no-such-lora", True)
