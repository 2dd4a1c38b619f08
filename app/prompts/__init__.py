"""Prompts as A1111 reads them: emphasis syntax, `BREAK`, 75-token chunks, clip skip, per-encoder reading.

Why our own: users paste A1111 prompts, and every one of them depends on A1111's rules (`(word)`
×1.1, `(word:1.3)`, `[word]` ÷1.1, `\\(` literal, `BREAK`, 75-token chunks with the comma
backtrack, the mean-restoring emphasis). The libraries that weight prompts for diffusers do not
follow those rules: `compel` has its own syntax (`word++`, `(word)1.3`) and blends weighted
embeddings towards an empty prompt's, and `sd_embed` is not on PyPI and lerps towards the last
token; both would give another picture than A1111 for the same text. A1111's own code is AGPL, so
this is a fresh implementation of its documented behaviour:

* `attention.py`: the text -> (text, weight) parts, a single linear scan (no regex on user text);
* `chunks.py`: parts -> token chunks (BOS + 75 + EOS/pad) with per-token weights, embeddings kept
  whole inside one chunk, or one sequence cut at a family's length with a note (T5);
* `encode.py`: chunks -> the tensors the pipeline takes (`prompt_embeds`, `pooled_prompt_embeds`
  and their negatives), reading each text encoder as its family says (`TextEncoder.reads`, `layer`,
  `chunked`), never by the family's name.
"""
