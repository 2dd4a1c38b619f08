"""What is known of a prompt before a generation, from the family's bundled tokenizers (no model loaded):
the notes when it will not be read whole, and how many chunks its encoders will read.

CLIP encoders read any length (A1111's chunks), so only a fixed-length encoder (T5 on Flux) can cut
a prompt. The UI and the API say so with the other notes of the request (`params_from_form`), so
nothing is cut silently. Every chunk is a text-encoder pass and an embedding each step reads: the
engine counts them (`prompt_chunks`) for its work cap and memory estimate (`app/engine/job_memory.py`).
"""

from __future__ import annotations

from functools import lru_cache

from app.adapters.prompt import parse_prompt_loras
from app.families import Family, family
from app.prompts.as_text import text_notes
from app.prompts.chunks import chunk_tokens
from app.prompts.editing import editable, edited_texts
from app.prompts.encode import cut_note, tokens_for


@lru_cache(maxsize=8)
def _tokenizers(name: str) -> dict[str, object]:
    return family(name).tokenizers()


def prompt_notes(fam: Family, prompt: str, negative_prompt: str) -> list[str]:
    """A note per prompt a fixed-length encoder of `fam` would cut (none for CLIP-only families)."""
    fixed = [te for te in fam.text_encoders if not te.chunked]
    if not fixed:
        return []
    texts = [(parse_prompt_loras(prompt)[0], "prompt")]
    if fam.sampling.negative_prompt:
        texts.append((negative_prompt, "negative prompt"))
    tokenizers = _tokenizers(fam.name)
    return [note for te in fixed for text, what in texts
            for note in (text_notes(fam, te, tokenizers[te.tokenizer], text, what) if te.reads == "text"
                         else [cut_note(fam, te, tokens_for(fam, te, tokenizers[te.tokenizer], text), what)])
            if note]


def prompt_chunks(fam: Family, prompt: str, negative_prompt: str, steps: int) -> int:
    """The chunks `fam`'s chunked encoders read for a pass of `steps`: per text pair the pass encodes (one, or
    one per edit where the family follows edits), the longer side's (the shorter is padded to it)."""
    chunked = [te for te in fam.text_encoders if te.chunked and te.reads != "text"]
    pairs = edited_texts(parse_prompt_loras(prompt)[0], negative_prompt if fam.sampling.negative_prompt else "", steps)
    if not chunked:
        return len(pairs) if editable(fam) else 1
    tokenizers = _tokenizers(fam.name)
    return sum(max(chunk_tokens(tokenizers[te.tokenizer], text).chunks for te in chunked for text in pair)
               for _end, *pair in (pairs if editable(fam) else pairs[:1]))


def negative_note(fam: Family, negative_prompt: str, guidance: float) -> str:
    """The note when a negative prompt was written and `fam` at `guidance` never reads it (`Family.negative_unused`),
    as the emphasis note says what a plain-text encoder leaves out: A1111 and Forge drop it silently."""
    why = fam.negative_unused(guidance) if negative_prompt.strip() else ""
    return f"the negative prompt is not used: {why}" if why else ""
