"""Infotext: what we write, A1111/Forge write, and the reader make of each; the shared input rules."""

from __future__ import annotations

import math
import random
import re
import time

import pytest

from app.adapters.specs import LoraSpec
from app.engine.generate import GenerateParams, RunContext, infotext, params_from_form
from app.infotext import _PAIR, MAX_INFOTEXT_CHARS, LoraUse, format_infotext, lora_tag, parse_infotext

A1111 = """masterpiece, a fox in the snow, <lora:styleA:0.8>, <lora:detailB:0.5:1.2>
second prompt line
Negative prompt: blurry, lowres
bad hands
Steps: 28, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, Seed: 1234567, Size: 832x1216, \
Model hash: 31e35c80fc, Model: sd_xl_base_1.0, Lora hashes: "styleA: 1a2b3c4d5e6f, detailB: 0f9e8d7c6b5a", \
Version: v1.10.1"""

FORGE = """a watercolour lighthouse <lora:sketch:0.7>
Steps: 20, Sampler: Euler a, Schedule type: Automatic, CFG scale: 7, Seed: 42, Size: 512x768, \
Model hash: e60e930aa2, Model: dreamshaper_8, Lora hashes: "sketch: abcdef123456", \
Version: f2.0.1v1.10.1-previous-519"""


def test_a1111_text_with_multiline_prompts_quoted_values_and_swapped_lora_order():
    info = parse_infotext(A1111)
    assert info.prompt == "masterpiece, a fox in the snow, , second prompt line"  # tags cut as A1111 cuts them
    assert info.negative_prompt == "blurry, lowres\nbad hands"
    assert info.settings["Schedule type"] == "Karras" and info.settings["CFG scale"] == "6.5"
    assert info.settings["Lora hashes"] == "styleA: 1a2b3c4d5e6f, detailB: 0f9e8d7c6b5a"
    assert info.settings["Version"] == "v1.10.1" and not info.ours
    weights = {s.name: (s.unet_strength, s.te_strength) for s in info.loras}
    # A1111 reads <lora:name:a:b> as text encoder a, UNet b.
    assert weights == {"styleA": (0.8, 0.8), "detailB": (1.2, 0.5)}


def test_forge_text():
    info = parse_infotext(FORGE)
    assert info.prompt == "a watercolour lighthouse"
    assert info.settings["Size"] == "512x768" and info.settings["Sampler"] == "Euler a"
    assert [(s.name, s.unet_strength) for s in info.loras] == [("sketch", 0.7)]


def test_our_text_round_trips_with_both_weights():
    loras = (LoraUse("style", 0.6, "aaaabbbbcccc", 1.4), LoraUse("detail", -1.0, "ddddeeeeffff"))
    text = format_infotext("a fox, in snow", "blurry", [("Steps", 2), ("Sampler", "Euler"), ("Seed", 7),
                                                        ("Model", "tiny: sd15, v2")], loras)
    first_line = text.split("\n")[0]
    assert first_line == "a fox, in snow <lora:style:1.4:0.6> <lora:detail:-1>"  # A1111's order: te, then unet
    assert 'Model: "tiny: sd15, v2"' in text and "Version: steady-diffusion" in text
    info = parse_infotext(text)
    assert info.ours and info.prompt == "a fox, in snow" and info.negative_prompt == "blurry"
    assert info.settings["Model"] == "tiny: sd15, v2"
    assert [(s.name, s.unet_strength, s.te_strength) for s in info.loras] == [("style", 0.6, 1.4),
                                                                              ("detail", -1.0, -1.0)]


def test_writer_keeps_tags_the_prompt_already_carries_and_adds_only_the_missing_ones():
    params = GenerateParams("a cat <lora:style:0.5>", steps=2, seed=1, width=64, height=64)
    ctx = RunContext("m.safetensors", "0123456789", (("style", 0.5, "h1"), ("detail", 1.0, "h2")))
    text = infotext(params, 1, ctx)
    assert text.split("\n")[0] == "a cat <lora:style:0.5> <lora:detail:1>"
    assert lora_tag("x", 1.0, 1.0) == "<lora:x:1>" and lora_tag("x", 0.25, 2.0) == "<lora:x:2:0.25>"


def test_older_text_of_ours_with_weights_but_no_tags():
    text = 'a cat\nSteps: 2, Sampler: Euler, Seed: 3, Lora weights: "style: 1.5, detail: -1", Version: steady-diffusion'
    assert parse_infotext(text).loras == (LoraSpec("style", 1.5), LoraSpec("detail", -1.0))


@pytest.mark.parametrize("text", ["", "just a prompt", "a cat\nSteps: 20"])
def test_text_without_a_settings_line_is_refused(text):
    with pytest.raises(ValueError, match="no generation settings"):
        parse_infotext(text)


# ------------------------------------------------------------------------------ the input rules
FORM = dict(prompt="a", negative_prompt="", sampler="Euler", steps=20, cfg=7.0, seed=-1, width=512, height=512,
            batch=1)


@pytest.mark.parametrize("field, value, message", [
    ("steps", 0, "steps must be a whole number in 1…150, got 0"),
    ("steps", 100000, "steps must be a whole number in 1…150, got 100000"),
    ("width", 7, "width must be a whole number in 64…2048, got 7"),
    ("seed", 1.5, "seed must be a whole number in -1…4294967295 (-1 = random), got 1.5"),
    ("cfg", math.nan, "cfg must be a number in 1…30, got nan"),
    ("cfg", math.inf, "cfg must be a number in 1…30, got inf"),
    ("batch", None, "batch must be a whole number in 1…16, got None"),
])
def test_out_of_range_values_are_refused_with_the_range(field, value, message):
    with pytest.raises(ValueError) as refused:
        params_from_form(dict(FORM, **{field: value}), "sd15")
    assert str(refused.value) == message


def test_every_refusal_is_reported_at_once_and_sizes_round_down_with_a_note():
    with pytest.raises(ValueError, match=r"steps .* got 0;\nwidth .* got 7"):
        params_from_form(dict(FORM, steps=0, width=7), "sd15")
    params, notes = params_from_form(dict(FORM, width=100, height=1023.0, seed=5.0), "sdxl")
    assert (params.width, params.height, params.seed) == (96, 1016, 5)
    assert notes == ("width 100 → 96: SDXL sizes are multiples of 8 (rounded down, as A1111 does)",
                     "height 1023 → 1016: SDXL sizes are multiples of 8 (rounded down, as A1111 does)")
    assert params_from_form(FORM, None)[1] == ()


# ------------------------------------------------------------------ hostile texts (issue 28, finding 3)
A1111_PAIR = re.compile(r'\s*(\w[\w \-/]*):\s*("(?:\\.|[^\\"])*"|[^,]*)(?:,|$)')  # A1111's own reader


def test_settings_pairs_are_the_ones_a1111s_regex_finds():
    """The linear reader finds exactly A1111's pairs: 20,000 random lines over the characters that
    matter (word characters, spaces, tabs, colons, commas, quotes, backslashes, dashes, slashes)."""
    rng = random.Random(28)
    for _ in range(20_000):
        line = "".join(rng.choice('ab :,"\\-/\t_1é') for _ in range(rng.randrange(40)))
        assert [(k, v) for k, colon, v in _PAIR.findall(line) if colon] == A1111_PAIR.findall(line), line


@pytest.mark.parametrize("line", ["a " * 500_000, 'Steps: "x\\' * 110_000, "\t ," * 330_000, "a: b, " * 160_000],
                         ids=["words", "unclosed-quotes", "separators", "dense-pairs"])
def test_a_megabyte_line_is_read_in_linear_time(line):
    """A1111's regex took 5.3 s for 20 KB and 43.8 s for 50 KB of `a a a …` (quadratic), with every
    other request waiting. A 1 MB line now takes well under 0.1 s on its own and under 1 s for the
    densest text of pairs (measured: 0.01 s and 0.4 s on a loaded 2-core machine); a text over
    `MAX_INFOTEXT_CHARS` is refused unread."""
    start = time.process_time()
    try:
        parse_infotext(line)
    except ValueError:
        pass
    limit = 0.1 if line.startswith(("a ", "Steps")) else 1.0
    assert time.process_time() - start < limit
    with pytest.raises(ValueError, match="the most read is 1,048,576"):
        parse_infotext("a" * (MAX_INFOTEXT_CHARS + 1))
