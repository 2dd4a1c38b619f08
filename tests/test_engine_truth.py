"""What the engine reports is the truth the UI draws: per-LoRA states, previews, infotext, the queue.

What it protects (the page and the engine used to disagree about LoRAs): with `set_aside_unfit`
a LoRA that does not fit the loaded model is set aside with its reason, shown in `lora_states`,
and never blocks the others; switching SD1.5 → SDXL → SD1.5 keeps the wanted list, sets aside
and re-applies as the model changes, and Generate works at every step. While denoising, the
progress carries a live preview of the latents. A LoRA whose text-encoder weight differs is
written as A1111's `<lora:name:te:unet>`. A full command queue refuses new work at once.
"""

from __future__ import annotations

import threading
import time

import pytest
from tiny import CHECKPOINTS, FAST

from app.adapters.specs import LoraSpec
from app.engine.generate import GenerateParams
from app.engine.worker import Engine, EngineBusy
from app.infotext import parse_infotext
from app.settings import Settings

SD15_LORA, SDXL_LORA = LoraSpec("demo-style-sd15", 0.8), LoraSpec("demo-style-sdxl", 0.7)


def _states(engine) -> dict[str, tuple[str, str]]:
    return {s.name: (s.status, s.reason) for s in engine.snapshot().lora_states}


def test_a_lora_that_does_not_fit_is_set_aside_with_its_reason_and_blocks_nothing(engine):
    engine.load_model(CHECKPOINTS["sd15"])
    snap = engine.set_loras([SD15_LORA, SDXL_LORA], set_aside_unfit=True)
    assert snap.loras == (SD15_LORA,) and snap.history[-1].outcome == "ok"
    states = _states(engine)
    assert states[SD15_LORA.name] == ("applied", "")
    assert states[SDXL_LORA.name][0] == "set aside" and "SDXL" in states[SDXL_LORA.name][1]
    assert engine.generate(GenerateParams("a cat", seed=1, **FAST))


def test_switching_families_with_loras_selected_sets_aside_and_reapplies(engine):
    """SD1.5 → SDXL → SD1.5 with both LoRAs wanted: each model applies its own and shows the other
    set aside; Generate works on each; nothing the user asked for is dropped or invented."""
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([SD15_LORA, SDXL_LORA], set_aside_unfit=True)
    for model, fits, aside in (("sdxl", SDXL_LORA, SD15_LORA), ("sd15", SD15_LORA, SDXL_LORA)):
        snap = engine.load_model(CHECKPOINTS[model])
        assert snap.loras == (fits,), model
        assert [s.name for s in snap.lora_states] == [SD15_LORA.name, SDXL_LORA.name]
        assert _states(engine)[aside.name][0] == "set aside", model
        assert engine.generate(GenerateParams("a cat", seed=2, **FAST)), model


def test_progress_carries_a_live_preview_while_denoising(data_dir):
    engine = Engine(Settings(data_dir=data_dir, device="cpu", preview_every=2))
    try:
        engine.load_model(CHECKPOINTS["sd15"])
        seen = []
        done = threading.Event()
        worker = threading.Thread(target=lambda: (engine.generate(GenerateParams("a cat", **dict(FAST, steps=40))),
                                                  done.set()), daemon=True)
        worker.start()
        while not done.wait(0.005):
            progress = engine.snapshot().progress
            if progress is not None and progress.preview:
                seen.append(progress.preview)
        worker.join()
        assert seen, "no preview was published"
        (picture,) = seen[-1]
        assert picture.size == (8, 8) and picture.mode == "RGB"  # one pixel per latent of a 64² image
    finally:
        engine.close()


def test_a_different_text_encoder_weight_is_written_in_a1111_order(engine):
    engine.load_model(CHECKPOINTS["sd15"])
    engine.set_loras([LoraSpec(SD15_LORA.name, 0.6, te_weight=1.2)])
    (image,) = engine.generate(GenerateParams("a cat", seed=3, **FAST))
    prompt_line = image.infotext.partition("\n")[0]
    assert prompt_line == f"a cat <lora:{SD15_LORA.name}:1.2:0.6>"
    (read,) = parse_infotext(image.infotext).loras
    assert (read.unet_strength, read.te_strength) == (0.6, 1.2)


def test_a_full_queue_refuses_new_commands_at_once(data_dir):
    engine = Engine(Settings(data_dir=data_dir, device="cpu", queue_size=1))
    try:
        engine.load_model(CHECKPOINTS["sd15"])
        long_run = threading.Thread(target=engine.generate, args=(GenerateParams("a cat", **dict(FAST, steps=150)),),
                                    daemon=True)
        long_run.start()
        while not engine.snapshot().generating:
            time.sleep(0.01)
        waiting = threading.Thread(target=engine.set_offload, args=("model",), daemon=True)
        waiting.start()
        while engine.snapshot().queued < 1:
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(EngineBusy, match="1 commands waiting"):
            engine.set_offload("none")
        assert time.monotonic() - started < 1.0
        engine.interrupt()
        long_run.join(60)
        waiting.join(60)
        assert engine.snapshot().offload == "model"
    finally:
        engine.close()
