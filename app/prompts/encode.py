"""Prompt and negative prompt -> the embeddings a pipeline call takes, read as A1111 reads them.

Each text encoder of the family is read as its `TextEncoder` entry says (`app/families/`):
`reads` (its hidden states are the prompt embeddings, its pooled output is the pooled embedding,
or both), `layer` (the last layer, normed, where clip skip N reads layer -N through the final norm
as A1111 does for SD1.5; or the penultimate layer unnormed, SDXL's, where A1111 ignores clip skip)
and `chunked` (CLIP's 75-token chunks, or one sequence of the family's `max_sequence_length`: T5).

Per chunk, as A1111: the chunk is encoded alone; where any token weighs other than 1 the hidden
states are multiplied by the weights and rescaled so their mean is the unweighted mean (A1111's
"Original" emphasis, computed in float32). Chunks are concatenated along the sequence; several
sequence encoders along the features (SDXL: CLIP-L then OpenCLIP-G). The pooled embedding is the
first chunk's. The shorter of prompt and negative prompt is padded with chunks of the empty
prompt (A1111's "pad prompt/negative prompt to the same length"), since the pipeline runs both in
one batch. An empty negative prompt is zeros where the pipeline's config says
`force_zeros_for_empty_prompt` (SDXL), as A1111 and diffusers do.

Everything runs through each encoder's own forward, so offload hooks, LoRA patches and bypasses
apply as they do for diffusers' own encode; the one step outside a forward (the final norm for
clip skip) reads the norm's parameters onto the activations' device and dtype, moving nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from app.engine.embeddings import token_runs
from app.families import Family, TextEncoder, family_of
from app.prompts.as_text import plain_text, text_notes
from app.prompts.chunks import Tokens, chunk_tokens, sequence_tokens

log = logging.getLogger(__name__)
CLIP_SKIP_MAX = 12  # A1111's slider: 1 (the last layer) … 12


@dataclass(frozen=True)
class Conditioning:
    """What the pipeline call takes instead of prompt strings (None: this family has no such input)."""

    prompt_embeds: torch.Tensor | None
    pooled: torch.Tensor | None = None
    negative_embeds: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None
    notes: tuple[str, ...] = ()
    prompt: str | None = None  # the prompt as text, for a pipeline that reads it so (`TextEncoder.reads == "text"`)
    negative_prompt: str | None = None  # the negative prompt so, where the family uses one

    def call_arguments(self) -> dict[str, torch.Tensor | str]:
        named = {"prompt_embeds": self.prompt_embeds, "pooled_prompt_embeds": self.pooled,
                 "negative_prompt_embeds": self.negative_embeds, "negative_pooled_prompt_embeds": self.negative_pooled,
                 "prompt": self.prompt, "negative_prompt": self.negative_prompt}
        return {name: value for name, value in named.items() if value is not None}


def tokens_for(fam: Family, te: TextEncoder, tokenizer, text: str) -> Tokens:
    """`text` as encoder `te` of `fam` reads it (chunks, or one sequence of the family's length)."""
    runs = token_runs(tokenizer)
    if te.chunked:
        return chunk_tokens(tokenizer, text, runs)
    return sequence_tokens(tokenizer, text, fam.sampling.max_sequence_length, runs)


def cut_note(fam: Family, te: TextEncoder, tokens: Tokens, what: str) -> str:
    """The user-visible note for a prompt cut at a fixed-length encoder ("" when nothing was cut)."""
    if not tokens.cut:
        return ""
    read = fam.sampling.max_sequence_length - 1
    return (f"the {what} is {read + tokens.cut} tokens long and {fam.label} reads "
            f"{read} (its {te.component.replace('_', ' ')}): the last {tokens.cut} tokens, from "
            f"\"{tokens.cut_at}…\", change nothing")


def _empty_chunks(tokenizer, count: int) -> Tokens:
    one = chunk_tokens(tokenizer, "")
    return Tokens(one.ids * count, one.weights * count)


def _pad(tokens: Tokens, tokenizer, chunks: int) -> Tokens:
    if tokens.chunks >= chunks:
        return tokens
    extra = _empty_chunks(tokenizer, chunks - tokens.chunks)
    return Tokens(tokens.ids + extra.ids, tokens.weights + extra.weights, tokens.cut)


def _check_clip_skip(encoder, clip_skip: int) -> None:
    layers = encoder.config.num_hidden_layers
    if not 1 <= clip_skip <= min(layers, CLIP_SKIP_MAX):
        raise ValueError(f"clip skip must be 1…{min(layers, CLIP_SKIP_MAX)} for this model (its text encoder has "
                         f"{layers} layers), got {clip_skip}")


def _final_norm(encoder, hidden: torch.Tensor) -> torch.Tensor:
    """The encoder's final layer norm on `hidden`, its parameters read onto `hidden`'s device and dtype."""
    norm = next(m for name, m in encoder.named_modules() if name.split(".")[-1] == "final_layer_norm")
    weight = None if norm.weight is None else norm.weight.to(hidden.device, hidden.dtype)
    bias = None if norm.bias is None else norm.bias.to(hidden.device, hidden.dtype)
    return torch.nn.functional.layer_norm(hidden, norm.normalized_shape, weight, bias, norm.eps)


def _hidden(te: TextEncoder, encoder, output, clip_skip: int) -> torch.Tensor:
    if te.layer == "penultimate":
        return output.hidden_states[-2]
    if clip_skip == 1 or not te.chunked:
        return output.last_hidden_state
    return _final_norm(encoder, output.hidden_states[-clip_skip])


def emphasise(hidden: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
    """A1111's "Original" emphasis on one chunk (1, tokens, features): multiply each token's vector
    by its weight, then rescale so the mean over the chunk is the unweighted mean again. All
    weights 1: `hidden` itself, bit for bit."""
    if all(w == 1.0 for w in weights):
        return hidden
    z = hidden.float()
    multipliers = torch.tensor(weights, dtype=torch.float32, device=z.device).view(1, -1, 1)
    original = z.mean()
    weighted = z * multipliers
    return (weighted * (original / weighted.mean())).to(hidden.dtype)


def _encode(pipe, te: TextEncoder, tokens: Tokens, clip_skip: int,
            zeroed: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(hidden states of every chunk, concatenated; the first chunk's pooled output), each None where
    `te` does not give it; the first `zeroed` chunks (and the pooled output, if any) come out as zeros."""
    encoder = getattr(pipe, te.component)
    need_hidden = te.layer == "penultimate" or (clip_skip > 1 and te.chunked)
    states, pooled = [], None
    for index, (ids, weights) in enumerate(zip(tokens.ids, tokens.weights, strict=True)):
        output = encoder(torch.tensor([ids], device=pipe._execution_device), output_hidden_states=need_hidden)
        if index == 0 and te.reads != "sequence":
            found = getattr(output, "text_embeds", None)
            pooled = output.pooler_output if found is None else found
            pooled = torch.zeros_like(pooled) if zeroed else pooled
        if te.reads == "pooled":
            break  # a pooled-only encoder reads the first chunk alone
        hidden = emphasise(_hidden(te, encoder, output, clip_skip), weights)
        states.append(torch.zeros_like(hidden) if index < zeroed else hidden)
    return (torch.cat(states, dim=1) if states else None), pooled


def _side(pipe, fam: Family, tokens: dict[str, Tokens], clip_skip: int, chunks: int,
          zero_own: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One prompt's (prompt embeddings, pooled embedding): chunked encoders padded to `chunks`."""
    parts, pooled = [], None
    for te in fam.text_encoders:
        tokenizer, own = getattr(pipe, te.tokenizer), tokens[te.component]
        padded = _pad(own, tokenizer, chunks) if te.chunked else own
        hidden, found = _encode(pipe, te, padded, clip_skip, own.chunks if zero_own else 0)
        parts += [] if hidden is None else [hidden]
        pooled = found if found is not None else pooled
    return torch.cat(parts, dim=-1), pooled


def _as_text(pipe, fam: Family, prompt: str, negative_prompt: str) -> Conditioning:
    """Both prompts as plain text for a pipeline that encodes them itself, the negative only where the
    family uses one, with the notes `text_notes` writes."""
    te = fam.text_encoders[0]
    tokenizer = getattr(pipe, te.tokenizer)
    notes = text_notes(fam, te, tokenizer, prompt, "prompt")
    negative = None
    if fam.sampling.negative_prompt:
        notes += text_notes(fam, te, tokenizer, negative_prompt, "negative prompt")
        negative = plain_text(negative_prompt)[0]
    return Conditioning(None, notes=tuple(notes), prompt=plain_text(prompt)[0], negative_prompt=negative)


def encode_prompts(pipe, prompt: str, negative_prompt: str, clip_skip: int = 1) -> Conditioning:
    """Both prompts as the family's pipeline reads them (see the module docstring); the negative only
    where the family uses one. ValueError for a clip skip the model's encoders cannot honour."""
    fam = family_of(pipe)
    if all(te.reads == "text" for te in fam.text_encoders):  # the pipeline reads it (app/prompts/as_text.py)
        return _as_text(pipe, fam, prompt, negative_prompt)
    texts = (prompt, negative_prompt) if fam.sampling.negative_prompt else (prompt,)
    tokens = [{te.component: tokens_for(fam, te, getattr(pipe, te.tokenizer), text) for te in fam.text_encoders}
              for text in texts]
    for te in fam.text_encoders:
        if te.layer == "last" and te.chunked and te.reads != "pooled":
            _check_clip_skip(getattr(pipe, te.component), clip_skip)
    notes = tuple(note for side, what in zip(tokens, ("prompt", "negative prompt")[:len(tokens)], strict=True)
                  for te in fam.text_encoders
                  if (note := cut_note(fam, te, side[te.component], what)))
    for note in notes:
        log.info("%s", note)
    chunks = max((side[te.component].chunks for side in tokens for te in fam.text_encoders if te.chunked), default=1)
    # An empty negative prompt is zeros where the pipeline says so (SDXL), as A1111 and diffusers do.
    zero_empty = not negative_prompt and bool(pipe.config.get("force_zeros_for_empty_prompt", False))
    with torch.no_grad():
        sides = [_side(pipe, fam, side, clip_skip, chunks, zero_own=index == 1 and zero_empty)
                 for index, side in enumerate(tokens)]
    negative = sides[1] if len(sides) > 1 else (None, None)
    return Conditioning(sides[0][0], sides[0][1], negative[0], negative[1], notes)
