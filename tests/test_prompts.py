"""A1111 prompt semantics (`app.prompts`): the emphasis parse, the chunks, and the embeddings each encoder gives.

Where the expected values come from (never from our own code):

* the parses marked "doctest" are the examples in the docstring of A1111's `parse_prompt_attention`
  (modules/prompt_parser.py, v1.10), restated as data; the others follow the rules that docstring and
  the A1111 wiki ("Attention/emphasis", "BREAK") state, worked out by hand in the comments;
* the embeddings are computed here, independently of `app.prompts`, from those expected parts with the
  tiny encoders, by A1111's documented procedure (`_reference`): tokens of each part, 75 per chunk,
  BOS + chunk + EOS padding, one forward per chunk, hidden states × weights rescaled to the unweighted
  mean, chunks concatenated. The 20 prompts avoid a comma near a chunk's end, so the comma backtrack
  (tested on its own below, with the chunks written out) does not apply to them.
"""

from __future__ import annotations

import pytest
import torch

from app.demo import build_tiny_pipeline
from app.engine.embeddings import load_embedding, token_runs
from app.families import family
from app.prompts.attention import parse_attention
from app.prompts.chunks import chunk_tokens
from app.prompts.encode import encode_prompts
from app.prompts.notes import prompt_notes

R, S = 1.1, 1 / 1.1
WORDS = " ".join(["red"] * 80)  # "red" is one CLIP token: 80 tokens
LONG = " ".join(["blue"] * 160)  # 160 tokens, three chunks

# prompt -> the parts A1111 makes of it
PARSES: dict[str, list[tuple[str, float]]] = {
    "normal text": [("normal text", 1.0)],  # doctest
    "an (important) word": [("an ", 1.0), ("important", 1.1), (" word", 1.0)],  # doctest
    "(unbalanced": [("unbalanced", 1.1)],  # doctest
    "\\(literal\\]": [("(literal]", 1.0)],  # doctest
    "(unnecessary)(parens)": [("unnecessaryparens", 1.1)],  # doctest
    "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).": [  # doctest
        ("a ", 1.0), ("house", 1.5730000000000004), (" ", 1.1), ("on", 1.0), (" a ", 1.1), ("hill", 0.55),
        (", sun, ", 1.1), ("sky", 1.4641000000000006), (".", 1.1)],
    "a cat": [("a cat", 1.0)],
    "a (cat:1.0)": [("a cat", 1.0)],  # weight 1 merges with its neighbour: the same parts as "a cat"
    "a (cat:1.5)": [("a ", 1.0), ("cat", 1.5)],
    "[[dog]] and cat": [("dog", 1.0 * S * S), (" and cat", 1.0)],  # each [] divides by 1.1
    "((a (b:0.5) c))": [("a ", 1.0 * R * R), ("b", 1.0 * 0.5 * R * R), (" c", 1.0 * R * R)],  # inner closes first
    "a BREAK b": [("a", 1.0), ("BREAK", -1.0), ("b", 1.0)],  # whitespace around BREAK goes
    "(red BREAK blue)": [("red", 1.1), ("BREAK", -1.1), ("blue", 1.1)],  # weighted: the word, not a break
    "\\\\back \\[x\\]": [("\\back [x]", 1.0)],  # \\ \[ \] are literal
    "a :1.2) b ] c": [("a :1.2) b ] c", 1.0)],  # closers with nothing open are text
    "(a:1.2": [("a:1.2", 1.1)],  # no ")" after the number: ":1.2" is text; the "(" never closes
    "BREAK a": [("", 1.0), ("BREAK", -1.0), ("a", 1.0)],  # a first chunk of padding only
    "a photo BREAK BREAK (of:0.8) a cat": [("a photo", 1.0), ("BREAK", -1.0), ("", 1.0), ("BREAK", -1.0),
                                           ("", 1.0), ("of", 0.8), (" a cat", 1.0)],
    f"a photo of {WORDS} (cat:1.3)": [(f"a photo of {WORDS} ", 1.0), ("cat", 1.3)],  # 84 tokens: 2 chunks
    f"{LONG} [sky] ((sea))": [(f"{LONG} ", 1.0), ("sky", S), (" ", 1.0), ("sea", 1.0 * R * R)],  # 162: 3 chunks
}


@pytest.fixture(scope="module")
def pipes():
    out = {}
    for family_name in ("sd15", "sdxl", "flux-dev"):
        pipe = build_tiny_pipeline(family_name)
        pipe.family = family(family_name)
        out[family_name] = pipe
    return out


def _chunks_of(tokenizer, parts):
    """A1111's chunks of `parts` (no comma near a chunk's end): lists of (token, weight), 75 at most."""
    chunks, current = [], []
    for text, weight in parts:
        if (text, weight) == ("BREAK", -1.0):
            chunks.append(current)
            current = []
            continue
        for token in tokenizer(text, add_special_tokens=False).input_ids:
            if len(current) == 75:
                chunks.append(current)
                current = []
            current.append((token, weight))
    if current or not chunks:
        chunks.append(current)
    return chunks


def _reference(pipe, parts, encoder="text_encoder", tokenizer="tokenizer", hidden=lambda out: out.last_hidden_state,
               chunks=None):
    tok, enc = getattr(pipe, tokenizer), getattr(pipe, encoder)
    found = _chunks_of(tok, parts)
    found += [[]] * ((chunks or len(found)) - len(found))
    pad = tok.pad_token_id
    states = []
    for chunk in found:
        ids = [tok.bos_token_id] + [t for t, _w in chunk] + [tok.eos_token_id] + [pad] * (75 - len(chunk))
        weights = torch.tensor([1.0] + [w for _t, w in chunk] + [1.0] * (76 - len(chunk))).view(1, -1, 1)
        with torch.no_grad():
            z = hidden(enc(torch.tensor([ids]), output_hidden_states=True))
        weighted = z * weights
        states.append(weighted * (z.mean() / weighted.mean()) if (weights != 1).any() else z)
    return torch.cat(states, dim=1)


@pytest.mark.parametrize("prompt", list(PARSES))
def test_the_parse_is_a1111s(prompt):
    """`(word)`, `(word:1.3)`, `[word]`, escapes and BREAK weigh the words exactly as A1111 does."""
    assert parse_attention(prompt) == PARSES[prompt]


def test_embeddings_of_twenty_a1111_prompts_match_the_reference(pipes):
    """Each prompt's SD1.5 embeddings are A1111's: its parts, chunked and weighted as documented."""
    pipe = pipes["sd15"]
    assert len(PARSES) == 20
    for prompt, parts in PARSES.items():
        got = encode_prompts(pipe, prompt, "").prompt_embeds
        assert torch.equal(got, _reference(pipe, parts)), prompt
    counts = {p: encode_prompts(pipe, p, "").prompt_embeds.shape[1] // 77 for p in PARSES}
    assert counts["a BREAK b"] == 2 and counts["a photo BREAK BREAK (of:0.8) a cat"] == 3
    assert counts[f"a photo of {WORDS} (cat:1.3)"] == 2 and counts[f"{LONG} [sky] ((sea))"] == 3


def test_a_weight_of_one_is_the_plain_prompt_and_others_are_not(pipes):
    """`a (cat:1.0)` is `a cat` bit for bit (and diffusers' own encoding of it); `(cat:1.5)` is not."""
    pipe = pipes["sd15"]
    plain = encode_prompts(pipe, "a cat", "")
    assert torch.equal(encode_prompts(pipe, "a (cat:1.0)", "").prompt_embeds, plain.prompt_embeds)
    with torch.no_grad():
        diffusers_own, _ = pipe.encode_prompt("a cat", "cpu", 1, False)
    assert torch.equal(plain.prompt_embeds, diffusers_own)
    assert not torch.equal(encode_prompts(pipe, "a (cat:1.5)", "").prompt_embeds, plain.prompt_embeds)


def test_the_negative_prompt_is_padded_with_empty_prompt_chunks(pipes):
    """The pipeline runs both prompts in one batch: the shorter gets chunks of the empty prompt."""
    pipe = pipes["sd15"]
    made = encode_prompts(pipe, LONG, "ugly")
    assert made.prompt_embeds.shape == made.negative_embeds.shape == (1, 3 * 77, 32)
    expected = torch.cat([_reference(pipe, [("ugly", 1.0)]), _reference(pipe, [("", 1.0)]),
                          _reference(pipe, [("", 1.0)])], dim=1)
    assert torch.equal(made.negative_embeds, expected)


def test_clip_skip_reads_an_earlier_layer_through_the_final_norm(pipes):
    """Clip skip N is layer -N through the final layer norm (A1111 on SD1.5); past the encoder's
    depth it is refused, naming the layer count."""
    pipe = pipes["sd15"]
    enc = pipe.text_encoder
    expected = _reference(pipe, [("a ", 1.0), ("cat", 1.5)],
                          hidden=lambda out: enc.final_layer_norm(out.hidden_states[-3]))
    assert torch.equal(encode_prompts(pipe, "a (cat:1.5)", "", clip_skip=3).prompt_embeds, expected)
    assert not torch.equal(expected, encode_prompts(pipe, "a (cat:1.5)", "").prompt_embeds)
    with pytest.raises(ValueError, match="text encoder has 5 layers"):
        encode_prompts(pipe, "a cat", "", clip_skip=6)


def test_sdxl_chunks_both_encoders_alike_and_pools_the_first_chunk(pipes):
    """SDXL as A1111: both encoders' penultimate layers, chunked alike and joined on the features; the
    pooled vector is the second encoder's for the first chunk; an empty negative is zeros."""
    pipe = pipes["sdxl"]
    prompt = f"a photo of {WORDS} (cat:1.3)"
    made = encode_prompts(pipe, prompt, "")
    penultimate = dict(hidden=lambda out: out.hidden_states[-2])
    first = _reference(pipe, PARSES[prompt], **penultimate)
    second = _reference(pipe, PARSES[prompt], "text_encoder_2", "tokenizer_2", **penultimate)
    assert torch.equal(made.prompt_embeds, torch.cat([first, second], dim=-1))
    chunk = pipe.tokenizer_2(f"a photo of {WORDS} cat", padding="max_length", max_length=77, truncation=True,
                             return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(made.pooled, pipe.text_encoder_2(chunk).text_embeds)
    empty_pad = torch.cat([_reference(pipe, [("", 1.0)], **penultimate),
                           _reference(pipe, [("", 1.0)], "text_encoder_2", "tokenizer_2", **penultimate)], dim=-1)
    assert made.negative_embeds[:, :77].abs().max() == 0 and torch.equal(made.negative_embeds[:, 77:], empty_pad)
    assert made.negative_pooled.abs().max() == 0


def test_flux_reads_clip_l_pooled_and_t5_cut_at_its_length_with_a_note(pipes):
    """Flux: CLIP-L gives the pooled vector of the prompt's first chunk, T5 the sequence of the
    family's length; a longer prompt is cut, and the note says by how much and where."""
    pipe = pipes["flux-dev"]
    fam = family("flux-dev")
    made = encode_prompts(pipe, "a (cat:1.0)", "")
    with torch.no_grad():
        embeds, pooled, _ids = pipe.encode_prompt("a cat", None, device="cpu", max_sequence_length=512)
    assert torch.equal(made.prompt_embeds, embeds) and torch.equal(made.pooled, pooled) and made.notes == ()
    long = "fox " * 520 + "zebra crossing"
    notes = encode_prompts(pipe, long, "").notes
    assert len(notes) == 1 and "511" in notes[0] and "zebra" not in notes[0]
    assert prompt_notes(fam, long + " <lora:style:1>", "") == list(notes)  # counted before queueing too
    assert prompt_notes(family("sd15"), long, "") == []  # CLIP reads any length: nothing to say


def test_comma_backtrack_moves_the_words_after_a_late_comma(pipes):
    """A full chunk with a comma among its last 20 tokens ends at the comma; the words after it open
    the next chunk (A1111's default comma padding backtrack of 20)."""
    tok = pipes["sd15"].tokenizer
    red, comma, blue = (tok(w, add_special_tokens=False).input_ids[0] for w in ("red", ",", "blue"))
    made = chunk_tokens(tok, " ".join(["red"] * 70) + ", " + " ".join(["blue"] * 10))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert made.ids == ((bos, *[red] * 70, comma, *[eos] * 5), (bos, *[blue] * 10, *[eos] * 66))


def test_an_embedding_is_never_split_across_chunks_and_takes_its_weight(pipes, demo_paths, tmp_path):
    """A two-vector embedding that would straddle a chunk's end moves whole into the next chunk, and
    weighted `(name:1.2)` weighs both its vectors."""
    pipe = build_tiny_pipeline("sd15")
    pipe.family = family("sd15")
    name = load_embedding(pipe, "sd15", demo_paths["sd15_embedding"])
    tok = pipe.tokenizer
    vectors = [tok.convert_tokens_to_ids(t) for t in (name, f"{name}_1")]
    assert token_runs(tok) == {vectors[0]: tuple(vectors)}
    made = chunk_tokens(tok, " ".join(["red"] * 74) + f" ({name}:1.2) cat", token_runs(tok))
    assert made.chunks == 2 and made.ids[0][75] == tok.eos_token_id  # 74 words, then padding
    assert made.ids[1][1:4] == (*vectors, tok("cat", add_special_tokens=False).input_ids[0])
    assert made.weights[1][1:4] == (1.2, 1.2, 1.0)
    assert encode_prompts(pipe, f"a ({name}:1.2)", "").prompt_embeds.shape == (1, 77, 32)
