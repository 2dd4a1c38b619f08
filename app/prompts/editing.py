"""Prompt editing during a pass: the conditioning each step reads, swapped in the step callback.

`schedule` says which text the prompt and the negative prompt are at each step; each distinct pair is
encoded once (`encode_prompts`, so emphasis, chunks and clip skip apply to each), the pass starts on
the first, and diffusers' step-end callback hands the pipeline the next pair's embeddings before the
step that reads them. The pipeline keeps them in its own layout (the negative batch first under CFG,
each prompt repeated per image), on its own device and in its own dtype: the new ones are laid out
the same way from the tensor they replace, so nothing reaches the denoiser on another device or in
another dtype.

A pipeline can be edited so when its step callback may replace every conditioning tensor it reads:
the prompt embeddings and, where the family has a pooled embedding, the pipeline's `add_text_embeds`
(SD1.5, SDXL). Others (a pooled input the callback cannot reach, a pipeline that reads the prompt as
text) read the text of the first step, with a note.
"""

from __future__ import annotations

import torch

from app.families import Family
from app.prompts.encode import Conditioning, encode_prompts
from app.prompts.schedule import index_at, merged_runs, schedule, text_at

POOLED_INPUT = "add_text_embeds"  # the name a pipeline's step callback gives its pooled conditioning


def edited_texts(prompt: str, negative_prompt: str, steps: int,
                 first_pass_steps: int | None = None) -> list[tuple[int, str, str]]:
    """`[(end, prompt, negative prompt)]` for a pass of `steps`: one entry when nothing is edited."""
    positive = schedule(prompt, steps, first_pass_steps)
    negative = schedule(negative_prompt, steps, first_pass_steps)
    runs = merged_runs({e for e, _ in positive} | {e for e, _ in negative},
                       lambda end: (text_at(positive, end), text_at(negative, end)))
    return [(end, *texts) for end, texts in runs]


def editable(fam: Family, pipeline_class: type | None = None) -> bool:
    """Whether `fam`'s pipeline (`pipeline_class`: one of its stage pipelines) can read a new conditioning
    at each step (see the module docstring)."""
    if any(te.reads == "text" for te in fam.text_encoders):
        return False
    pooled = any(te.reads != "sequence" for te in fam.text_encoders)
    inputs = set(getattr(pipeline_class or fam.pipeline_class, "_callback_tensor_inputs", ()))
    return "prompt_embeds" in inputs and (not pooled or POOLED_INPUT in inputs)


def encoded_texts(fam: Family, prompt: str, negative_prompt: str, steps: int) -> tuple[str, str]:
    """The prompt and negative prompt as `fam`'s encoders read them, for the notes about what is encoded
    (emphasis dropped, tokens cut): as written where the family follows edits (each scheduled text comes
    from them), the first step's texts where it cannot."""
    if editable(fam):
        return prompt, negative_prompt
    _end, first, first_negative = edited_texts(prompt, negative_prompt, steps)[0]
    return first, first_negative


def not_edited_note(fam: Family, prompt: str, negative_prompt: str, steps: int) -> str:
    """The note for a prompt that edits itself on a family that cannot follow it ("" otherwise)."""
    if editable(fam):
        return ""
    entries = edited_texts(prompt, negative_prompt, steps)
    if len(entries) == 1:
        return ""
    return (f"{fam.label} cannot change its prompt during a pass: prompt editing ([from:to:when]) and "
            f"alternation ([a|b]) read as at the first step: \"{entries[0][1]}\"")


class EditedPass:
    """The conditionings of one pass and the callback's swap (`swap`), for `steps` steps of `pipe`."""

    def __init__(self, pipe, fam: Family, prompt: str, negative_prompt: str, clip_skip: int, steps: int,
                 images: int, first_pass_steps: int | None = None, steps_before: int = 0) -> None:
        """`steps_before`: sampler steps of this schedule already run (the SDXL refiner goes on from the
        base pass's count, as A1111's one sampler loop does)."""
        self._pipe, self._clip_skip, self._images = pipe, clip_skip, images
        entries = edited_texts(prompt, negative_prompt, steps, first_pass_steps)
        self._entries = entries if editable(fam, type(pipe)) else entries[:1]
        self._encoded: dict[tuple[str, str], Conditioning] = {}
        self._before = steps_before
        self._current = self._index(steps_before)

    @property
    def edited(self) -> bool:
        return len(self._entries) > 1

    @property
    def callback_inputs(self) -> list[str]:
        """What the step callback must be handed to swap (besides the latents)."""
        if not self.edited:
            return []
        return ["prompt_embeds", *([POOLED_INPUT] if self.first.pooled is not None else [])]

    @property
    def first(self) -> Conditioning:
        """The first step's conditioning; every later one is encoded now too, so the text encoders run
        before the denoiser as in any pass (under offload they are not brought back mid-pass); not the
        earlier ones, which a pass going on after `steps_before` steps never reads."""
        for index in range(self._current, len(self._entries)):
            self._conditioning(index)
        return self._conditioning(self._current)

    def _conditioning(self, index: int) -> Conditioning:
        _end, prompt, negative = self._entries[index]
        if (prompt, negative) not in self._encoded:
            self._encoded[(prompt, negative)] = encode_prompts(self._pipe, prompt, negative, self._clip_skip)
        return self._encoded[(prompt, negative)]

    def swap(self, done: int, tensors: dict) -> None:
        """After step `done` (from 0), put the conditioning of step `done + 1` into `tensors` (the
        callback's), laid out as the tensors it replaces."""
        index = self._index(self._before + done + 1)
        if index == self._current:
            return
        self._current = index
        new = self._conditioning(index)
        tensors["prompt_embeds"] = self._laid_out(new.prompt_embeds, new.negative_embeds, tensors["prompt_embeds"])
        if POOLED_INPUT in tensors:
            tensors[POOLED_INPUT] = self._laid_out(new.pooled, new.negative_pooled, tensors[POOLED_INPUT])

    def _index(self, step: int) -> int:
        """The entry the sampler's step `step` (from 0) reads."""
        return index_at(self._entries, step)

    def _laid_out(self, positive: torch.Tensor, negative: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """`positive` (and `negative`, first, under CFG) repeated per image, on `like`'s device and dtype."""
        def each(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(self._images, dim=0)

        rows = positive.shape[0] * self._images
        if like.shape[0] == 2 * rows and negative is not None:
            out = torch.cat([each(negative), each(positive)])
        elif like.shape[0] == rows:
            out = each(positive)
        else:
            raise RuntimeError(f"prompt editing: the pipeline holds {like.shape[0]} conditioning rows, "
                               f"expected {rows} or {2 * rows}")
        return out.to(device=like.device, dtype=like.dtype)
