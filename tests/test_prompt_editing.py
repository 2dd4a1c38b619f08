"""A1111's prompt editing (`[from:to:when]`, `[to:when]`, `[from::when]`) and alternation (`[a|b]`).

Where the expected values come from (never from `app.prompts.schedule`): the schedules are worked out
by hand from A1111's rules (wiki "Prompt editing", "Alternating words"; `prompt_parser.py`'s new
scheduling: a decimal `when` is a fraction of the pass, an integer a step, the sampler's step `s`
counted from 0 reads the first entry whose end is at least `s`, a hires pass counts fractions from 1.0
and steps from the end of the first pass). The denoising oracle swaps the embeddings in a step
callback written here, on the same pipeline, at the step those rules name.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from PIL import Image
from tiny import CHECKPOINTS

from app.engine.generate import GenerateParams, denoise, params_from_form, scheduler_for, seed_generators
from app.engine.stage_params import HiresParams
from app.prompts.encode import encode_prompts
from app.prompts.schedule import schedule, text_at

SCHEDULES = [
    # (prompt, steps, first pass steps, expected [(end, text)])
    ("a [cat:dog:0.5] in a field", 20, None, [(10, "a cat in a field"), (20, "a dog in a field")]),
    ("[cat:dog:10]", 20, None, [(10, "cat"), (20, "dog")]),
    ("a [dog:0.25]", 20, None, [(5, "a "), (20, "a dog")]),  # added after step 5
    ("a [cat::0.25]", 20, None, [(5, "a cat"), (20, "a ")]),  # removed after step 5
    ("[cat:dog:30]", 20, None, [(20, "cat")]),  # past the last step: never switches
    ("[cat:dog:0]", 20, None, [(20, "dog")]),  # before the first: the second all along
    ("[cat|dog]", 4, None, [(1, "cat"), (2, "dog"), (3, "cat"), (4, "dog")]),
    ("([cat:dog:0.5]:1.2) [x]", 10, None, [(5, "(cat:1.2) [x]"), (10, "(dog:1.2) [x]")]),  # emphasis kept
    ("[[a:b:3]:c:6]", 10, None, [(3, "a"), (6, "b"), (10, "c")]),  # nested
    ("[ cat : dog : 2 ]", 4, None, [(2, " cat "), (4, " dog ")]),  # spaces around the number
    ("\\[a:b:2\\] [a:b] (c:d) [e:f:g]", 4, None, [(4, "\\[a:b:2\\] [a:b] (c:d) [e:f:g]")]),  # no construct
    ("[cat:dog:0.5]", 10, 20, [(10, "dog")]),  # hires: the first pass switched already
    ("[cat:dog:1.5]", 10, 20, [(5, "cat"), (10, "dog")]),  # hires: half-way through the hires pass
    ("[cat:dog:25]", 10, 20, [(5, "cat"), (10, "dog")]),  # hires: step 25 is the hires pass's 5th
]


@pytest.mark.parametrize(("prompt", "steps", "first", "expected"), SCHEDULES)
def test_the_schedule_is_a1111s(prompt, steps, first, expected):
    assert schedule(prompt, steps, first) == expected


def test_step_s_reads_the_first_entry_ending_at_or_after_it():
    """A1111 reads `[a:b:10]` over 20 steps as `a` for sampler steps 0-10 (eleven steps), then `b`."""
    entries = schedule("[a:b:10]", 20)
    assert [text_at(entries, s) for s in (0, 10, 11, 19)] == ["a", "a", "b", "b"]


@pytest.mark.parametrize("prompt", ["[a:" * 5333, "[a|" * 5333, "[" * 16000, "[a " * 5333])
def test_brackets_that_never_close_are_read_as_written_in_linear_time(prompt):
    """A share-link prompt at the 16,000-character cap made of openers costs a bounded scan."""
    started = time.perf_counter()
    assert schedule(prompt, 20) == [(20, prompt)]
    assert time.perf_counter() - started < 2.0


def _reference_latents(pipe, texts: list[str], switch_after: int, params: GenerateParams, seed: int):
    """The pass with the conditioning of `texts[0]` until step `switch_after` (from 0) is done, then
    `texts[1]`: diffusers' own loop, the swap made here, as the CFG batch lays it out."""
    first, second = (encode_prompts(pipe, text, params.negative_prompt) for text in texts)
    pipe.scheduler = scheduler_for(pipe, params.sampler)

    def swap(_pipe, step, _timestep, kwargs):
        if step == switch_after:
            kwargs["prompt_embeds"] = torch.cat([second.negative_embeds, second.prompt_embeds]).repeat_interleave(
                params.batch, dim=0).to(kwargs["prompt_embeds"])
            if "add_text_embeds" in kwargs:
                kwargs["add_text_embeds"] = torch.cat([second.negative_pooled, second.pooled]).repeat_interleave(
                    params.batch, dim=0).to(kwargs["add_text_embeds"])
        return kwargs

    inputs = ["latents", "prompt_embeds", *(["add_text_embeds"] if first.pooled is not None else [])]
    with torch.no_grad():
        return pipe(num_inference_steps=params.steps, num_images_per_prompt=params.batch, guidance_scale=params.cfg,
                    generator=seed_generators(seed, params.batch), output_type="latent", width=params.width,
                    height=params.height, callback_on_step_end=swap, callback_on_step_end_tensor_inputs=inputs,
                    **first.call_arguments()).images


@pytest.mark.parametrize("family_name", ["sd15", "sdxl"])
def test_a_prompt_edit_switches_the_conditioning_after_its_step(engine, family_name):
    """`a [cat:dog:2] x` over 5 steps, batch 2: the latents equal the pass that reads `a cat x` for steps
    0-2 and `a dog x` for 3-4 (bit for bit), and differ from each prompt alone."""
    engine.load_model(CHECKPOINTS[family_name])
    pipe = engine.pipeline
    params = GenerateParams("a [cat:dog:2] x", "blurry", steps=5, width=64, height=64, cfg=5.0, sampler="Euler",
                            batch=2, seed=7)
    ours = denoise(pipe, params, 7, width=64, height=64)
    expected = _reference_latents(pipe, ["a cat x", "a dog x"], 2, params, 7)
    assert torch.equal(ours, expected)
    for plain in ("a cat x", "a dog x"):
        alone = denoise(pipe, GenerateParams(**{**params.__dict__, "prompt": plain}), 7, width=64, height=64)
        assert not torch.equal(ours, alone), plain


def test_an_edited_prompt_through_the_engine_keeps_its_text_in_the_infotext(engine):
    """The saved prompt is the one typed (A1111 writes it so); the image is the edited one's."""
    engine.load_model(CHECKPOINTS["sd15"])
    fast = dict(steps=4, width=64, height=64, cfg=5.0, sampler="Euler", seed=3)
    (edited,) = engine.generate(GenerateParams("a [cat:dog:0.5]", **fast))
    (plain,) = engine.generate(GenerateParams("a cat", **fast))
    assert edited.infotext.startswith("a [cat:dog:0.5]\n")
    assert not np.array_equal(np.asarray(edited.image), np.asarray(plain.image))
    engine.set_dtype("bf16")  # the swapped embeddings take the pipeline's dtype: no mixed-dtype matmul
    engine.set_offload("sequential")
    engine.generate(GenerateParams("a [cat|dog] [bird:fish:1]", **fast))
    assert engine.snapshot().violations == ()


def test_a_family_that_cannot_follow_an_edit_says_what_it_reads():
    """FLUX.1's pooled input is out of its step callback's reach: the note names the text it reads;
    SD1.5 follows the edit and says nothing."""
    form = {"prompt": "a [cat:dog:0.5]", "negative_prompt": "", "sampler": "Euler", "steps": 8, "cfg": 3.5,
            "seed": 1, "width": 64, "height": 64, "batch": 1}
    _params, notes = params_from_form(form, "flux-dev")
    assert any("cannot change its prompt during a pass" in n and '"a cat"' in n for n in notes), notes
    assert not any("prompt editing" in n for n in params_from_form(form, "sd15")[1])
    for family_name in ("flux2-klein-4b", "zimage-turbo"):  # they read the prompt as text: the first step's, unweighted
        notes = params_from_form(form, family_name)[1]
        assert any('"a cat"' in n for n in notes) and not any("emphasis weights" in n for n in notes), notes


def test_the_stage_passes_follow_the_edit(engine):
    """Hires fix: `[cat:dog:0.5]` switched half-way through the first pass, so the hires pass reads `dog`
    throughout (A1111 counts its fractions from 1.0): the image equals the one whose hires prompt is
    the `dog` text, bit for bit. img2img and inpaint swap on their own pipelines, counting from their
    first run step as A1111 does: 8 steps at strength 0.5 run the schedule's steps 0-3, so
    `[cat:dog:2]` differs from each text alone and `[cat:dog:3]` reads `cat` at all four, bit for bit."""
    engine.load_model(CHECKPOINTS["sd15"])
    base = GenerateParams("a [cat:dog:0.5] x", seed=5, steps=4, width=64, height=64, cfg=5.0, sampler="Euler")
    hires = HiresParams(scale=1.5, steps=4, denoising_strength=0.6)
    (got,) = engine.generate(base, hires=hires)
    (expected,) = engine.generate(base, hires=dataclasses.replace(hires, prompt="a dog x"))
    assert np.array_equal(np.asarray(got.image), np.asarray(expected.image))
    init, mask = got.image.resize((64, 64)), Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    for extra in ({}, {"mask": mask}):
        def run(prompt: str, extra=extra):
            (image,) = engine.img2img(dataclasses.replace(base, prompt=prompt, steps=8), [init],
                                      denoising_strength=0.5, **extra)
            return np.asarray(image.image)

        edited, cat = run("a [cat:dog:2] x"), run("a cat x")
        assert not np.array_equal(edited, cat) and not np.array_equal(edited, run("a dog x")), extra
        assert np.array_equal(run("a [cat:dog:3] x"), cat), extra


def test_the_refiner_goes_on_counting_the_base_passs_steps(engine):
    """With the base as its own refiner and a deterministic sampler, switching at 0.5 gives the base's
    image bit for bit (`test_a1111_extras`); with `[cat:dog:1]` that holds only if the refiner's pass
    reads the schedule from the base pass's step count on (A1111 runs one sampler loop): steps 0-1
    `cat` in the base pass, 2-3 `dog` in the refiner's."""
    engine.load_model(CHECKPOINTS["sdxl"])
    params = GenerateParams("a [cat:dog:1] x", seed=5, steps=4, width=64, height=64, cfg=5.0, sampler="Euler")
    (alone,) = engine.generate(params)
    (refined,) = engine.generate(dataclasses.replace(params, refiner_checkpoint=CHECKPOINTS["sdxl"],
                                                     refiner_switch_at=0.5))
    assert np.array_equal(np.asarray(refined.image), np.asarray(alone.image))


def test_a_pass_going_on_after_earlier_steps_encodes_only_what_it_reads(monkeypatch):
    """The SDXL refiner goes on from the base pass's step count (`steps_before`): with `[a fox:a cat:4]`
    over 10 steps and 6 before, it reads "a cat" only, so "a fox" is not encoded (it was, for nothing)."""
    from types import SimpleNamespace

    from app.families import family
    from app.prompts import editing

    class Pipe:
        _callback_tensor_inputs = ["latents", "prompt_embeds", editing.POOLED_INPUT]

    encoded = []
    monkeypatch.setattr(editing, "encode_prompts",
                        lambda _pipe, prompt, negative, _clip: encoded.append(prompt) or SimpleNamespace(pooled=None))
    later = editing.EditedPass(Pipe(), family("sdxl"), "[a fox:a cat:4]", "", 0, 10, 1, steps_before=6)
    assert later.first.pooled is None and encoded == ["a cat"]
    encoded.clear()
    whole = editing.EditedPass(Pipe(), family("sdxl"), "[a fox:a cat:4]", "", 0, 10, 1)
    assert whole.first.pooled is None and encoded == ["a fox", "a cat"]  # both, before the denoiser runs
