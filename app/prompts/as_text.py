"""Prompts for a text encoder its pipeline reads as text (`TextEncoder.reads == "text"`: an LLM encoder).

Such a pipeline puts the prompt into its language model's chat template, tokenizes it itself and
reads hidden layers of the model; A1111's emphasis has no meaning there (no peer weights an LLM
encoder's tokens the A1111 way). So the prompt goes over as its plain text: A1111's syntax parsed
(`attention.parse_attention`, the same rules as everywhere: `\\(` is a literal bracket) and the
parts' text joined, weights and `BREAK` dropped, with a note when a weight other than 1 was written.
The pipeline cuts the templated prompt at the family's `max_sequence_length`; a note says so when
the prompt is longer, counted with the bundled tokenizer and the same template, applied as the family's
pipeline applies it (`TextEncoder.chat_template`).
"""

from __future__ import annotations

from collections.abc import Mapping

from app.prompts.attention import is_break, parse_attention


def plain_text(prompt: str) -> tuple[str, bool]:
    """(`prompt` without A1111's syntax, whether it carried any weight or BREAK that is dropped)."""
    parts = parse_attention(prompt)
    text = "".join(" " if is_break(t, w) else t for t, w in parts)
    return text, any(w != 1.0 for _t, w in parts)


def templated_length(tokenizer, text: str, template: Mapping[str, object]) -> int:
    """Tokens of `text` inside the chat template, applied with `template`'s arguments as the family's
    pipeline applies them (one pipeline opens a thinking block, another not)."""
    messages = [{"role": "user", "content": text}]
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template)
    return len(tokenizer(templated, add_special_tokens=False)["input_ids"])


def text_notes(fam, te, tokenizer, prompt: str, what: str) -> list[str]:
    """The notes for one prompt sent as text through the encoder `te`: weights dropped, and a prompt
    the pipeline cuts."""
    text, weighted = plain_text(prompt)
    notes = []
    if weighted:
        notes.append(f"{fam.label} reads the {what} as plain text: emphasis weights and BREAK have no effect "
                     "there and were left out")
    limit = fam.sampling.max_sequence_length
    if limit is None:  # the pipeline reads any length (its "tokenizer" may be a processor)
        return notes
    length = templated_length(tokenizer, text, te.chat_template)
    if length > limit:
        notes.append(f"the {what} is {length} tokens long with its chat template and {fam.label} reads "
                     f"{limit}: the last {length - limit} change nothing")
    return notes
