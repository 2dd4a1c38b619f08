"""Notes shown before a generation when a prompt will not be read whole.

CLIP encoders read any length (A1111's chunks), so only a fixed-length encoder (T5 on Flux) can cut
a prompt. The UI and the API say so with the other notes of the request (`params_from_form`), counted
with the family's bundled tokenizers, so no model has to be loaded and nothing is cut silently.
"""

from __future__ import annotations

from functools import lru_cache

from app.adapters.prompt import parse_prompt_loras
from app.families import Family, family
from app.prompts.as_text import text_notes
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
    if fam.negative_prompt:
        texts.append((negative_prompt, "negative prompt"))
    tokenizers = _tokenizers(fam.name)
    return [note for te in fixed for text, what in texts
            for note in (text_notes(fam, te, tokenizers[te.tokenizer], text, what) if te.reads == "text"
                         else [cut_note(fam, te, tokens_for(fam, te, tokenizers[te.tokenizer], text), what)])
            if note]
