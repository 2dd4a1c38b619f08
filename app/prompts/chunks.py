"""Parsed prompt parts -> the token ids an encoder reads, with one weight per token.

CLIP encoders (`chunked`), as A1111 fills them: the parts are tokenized one by one (no special
tokens, no truncation) and poured into chunks of 75 tokens; each chunk becomes BOS + 75 + EOS,
padded with EOS (and, where the tokenizer's pad token differs, everything after the first EOS is the
pad token, as A1111 pads OpenCLIP). A `BREAK` starts a new chunk. When a chunk is full and a comma
came within the last `COMMA_BACKTRACK` tokens, the words after that comma move to the next chunk
(A1111's "comma padding backtrack", 20 by default). A textual-inversion embedding is never split
across two chunks. BOS, EOS and padding weigh 1.

Encoders with a fixed length (`chunked` False: T5) read one sequence: the parts' tokens, cut at the
family's length minus the EOS, then EOS and padding, as diffusers tokenizes them. What was cut is
counted, so the caller can say so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.prompts.attention import is_break, parse_attention

CHUNK = 75  # prompt tokens per chunk; with BOS and EOS a chunk is 77 tokens, CLIP's length
COMMA_BACKTRACK = 20  # A1111's default `comma_padding_backtrack`


@dataclass(frozen=True)
class Tokens:
    """What one encoder reads for one prompt: `chunks` rows of token ids and their weights (one row
    for a fixed-length encoder), and how many prompt tokens did not fit (0 for CLIP: none are cut)."""

    ids: tuple[tuple[int, ...], ...]
    weights: tuple[tuple[float, ...], ...]
    cut: int = 0
    cut_at: str = ""  # the first words that did not fit

    @property
    def chunks(self) -> int:
        return len(self.ids)


def _tokenize(tokenizer, parts: list[tuple[str, float]], runs: Mapping[int, tuple[int, ...]]) -> list[list]:
    """Per part: a list of units (tuples of ids: a word piece, or an embedding's whole run of vectors)."""
    texts = [text for text, _w in parts]
    if not texts:
        return []
    tokenized = tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
    return [[runs.get(token, (token,)) for token in ids] for ids in tokenized]


class _Filler:
    """A1111's chunk filling (see the module docstring)."""

    def __init__(self, tokenizer, comma: int | None) -> None:
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad = self.eos if pad is None else pad
        self.comma = comma
        self.done: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
        self.ids: list[int] = []
        self.weights: list[float] = []
        self.last_comma = -1

    def close(self) -> None:
        """Pad the current chunk to 75, wrap it in BOS/EOS, start an empty one."""
        fill = CHUNK - len(self.ids)
        ids = [self.bos, *self.ids, *[self.eos] * (fill + 1)]
        if self.pad != self.eos:
            first_end = ids.index(self.eos)
            ids[first_end + 1:] = [self.pad] * (len(ids) - first_end - 1)
        self.done.append((tuple(ids), (1.0, *self.weights, *[1.0] * (fill + 1))))
        self.ids, self.weights, self.last_comma = [], [], -1

    def add(self, unit: tuple[int, ...], weight: float) -> None:
        if len(unit) == 1 and unit[0] == self.comma:
            self.last_comma = len(self.ids)
        elif len(self.ids) == CHUNK and self.last_comma != -1 and len(self.ids) - self.last_comma <= COMMA_BACKTRACK:
            keep = self.last_comma + 1
            moved = self.ids[keep:], self.weights[keep:]
            self.ids, self.weights = self.ids[:keep], self.weights[:keep]
            self.close()
            self.ids, self.weights = list(moved[0]), list(moved[1])
        if len(self.ids) == CHUNK or len(self.ids) + len(unit) > CHUNK:
            self.close()
        self.ids.extend(unit)
        self.weights.extend([weight] * len(unit))


def chunk_tokens(tokenizer, text: str, runs: Mapping[int, tuple[int, ...]] = {}) -> Tokens:  # noqa: B006 - read only
    """A CLIP encoder's chunks for `text` (A1111's emphasis syntax); `runs` maps an embedding's token
    to all its vector tokens (`app.engine.embeddings.token_runs`)."""
    parts = parse_attention(text)
    comma = tokenizer.convert_tokens_to_ids(",</w>")  # CLIP's comma; an unknown token gives the unk id
    filler = _Filler(tokenizer, None if comma == tokenizer.unk_token_id else comma)
    for (text_part, weight), units in zip(parts, _tokenize(tokenizer, parts, runs), strict=True):
        if is_break(text_part, weight):
            filler.close()
            continue
        for unit in units:
            filler.add(unit, weight)
    if filler.ids or not filler.done:
        filler.close()
    ids, weights = zip(*filler.done, strict=True)
    return Tokens(ids, weights)


def sequence_tokens(tokenizer, text: str, length: int, runs: Mapping[int, tuple[int, ...]] = {}) -> Tokens:  # noqa: B006
    """A fixed-length encoder's one row for `text`: `length` tokens, the last prompt token at
    `length - 2`, then EOS and padding; `cut` counts the prompt tokens that did not fit."""
    parts = [(t, w) for t, w in parse_attention(text) if not is_break(t, w)]
    ids, weights = [], []
    for (_text, weight), units in zip(parts, _tokenize(tokenizer, parts, runs), strict=True):
        for unit in units:
            ids.extend(unit)
            weights.extend([weight] * len(unit))
    room = length - 1
    cut = max(0, len(ids) - room)
    cut_at = tokenizer.decode(ids[room:room + 6]).strip() if cut else ""
    ids, weights = ids[:room] + [tokenizer.eos_token_id], weights[:room] + [1.0]
    fill = length - len(ids)
    return Tokens((tuple(ids + [tokenizer.pad_token_id] * fill),), (tuple(weights + [1.0] * fill),), cut, cut_at)
