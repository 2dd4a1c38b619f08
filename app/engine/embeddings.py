"""Textual-inversion embeddings (`.safetensors` only), added to the tokenizers and text encoders.

Layouts: SD1.5 files hold `emb_params` (n, 768); SDXL files hold `clip_l` (n, 768) for the first
encoder and `clip_g` (n, 1280) for the second. A file named `foo` adds tokens `foo`, `foo_1`, …
and the diffusers pipelines expand `foo` in a prompt to all of them. Vectors are cast to the
encoder's own weight dtype and device before being written — the inference side of the
OneTrainer `expected scalar type Float but found Half` report, where an fp32 vector met an
fp16 encoder. Files that do not fit the loaded family, hold NaN/Inf or absurd values, or
whose names are not valid UTF-8 are skipped with a log line.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from app.families import FAMILIES, family
from app.paths import utf8_names
from app.safetensors_files import read_header, refuse_bad_values

log = logging.getLogger(__name__)


def _layout(family_name: str) -> tuple[tuple[str, str, str], ...]:
    """(key in the file, tokenizer attribute, text encoder attribute) per text encoder."""
    return tuple((te.embedding_key, te.tokenizer, te.component) for te in family(family_name).text_encoders)


class EmbeddingError(ValueError):
    """An embedding file that cannot be used with the loaded model."""


def _token_names(name: str, count: int) -> list[str]:
    return [name] + [f"{name}_{i}" for i in range(1, count)]


def token_runs(tokenizer) -> dict[int, tuple[int, ...]]:
    """The token a prompt names a multi-vector embedding by (`foo`) -> the ids of all its vectors
    (`foo`, `foo_1`, …), as `load_embedding` added them; what diffusers' `maybe_convert_prompt`
    expands, for the prompt encoder (`app.prompts`), which tokenizes without the pipeline."""
    added = tokenizer.added_tokens_encoder
    runs = {}
    for name, first in added.items():
        count = 1
        while f"{name}_{count}" in added:
            count += 1
        if count > 1:
            runs[first] = tuple(added[token] for token in _token_names(name, count))
    return runs


def _add_vectors(tokenizer, encoder, tokens: list[str], vectors: torch.Tensor) -> None:
    """The new tokens' rows, added to the table only where the tokenizer outgrows it: a table may
    hold more rows than its tokenizer has tokens (T5's 32,128 for 32,100; LLM encoders pad theirs
    likewise; the spare rows are never produced by the tokenizer), and resizing it down to the
    tokenizer would cut those rows off."""
    tokenizer.add_tokens(tokens)
    if len(tokenizer) > encoder.get_input_embeddings().weight.shape[0]:
        encoder.resize_token_embeddings(len(tokenizer))
    weight = encoder.get_input_embeddings().weight
    ids = tokenizer.convert_tokens_to_ids(tokens)
    with torch.no_grad():
        weight[ids] = vectors.to(device=weight.device, dtype=weight.dtype)


class OtherFamilyEmbedding(EmbeddingError):
    """A file laid out for another family's text encoders: it belongs in a shared folder, nothing is wrong."""


def _families_reading(keys: set[str]) -> list[str]:
    """The labels of the families whose every text encoder finds its vectors among `keys`."""
    return [fam.label for fam in FAMILIES.values() if fam.files.takes_embeddings and fam.text_encoders
            and all(te.embedding_key in keys for te in fam.text_encoders)]


def _check_fits(pipe, family_name: str, path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every check before the first token is added, so a misfit never half-loads."""
    layout = _layout(family_name)
    missing = [key for key, _tok, _enc in layout if key not in tensors]
    if missing:
        readers = _families_reading(set(tensors))
        if readers:
            raise OtherFamilyEmbedding(f"{path.name}: for {' and '.join(dict.fromkeys(readers))} models, not "
                                       f"{family(family_name).label}")
        raise EmbeddingError(f"{path.name}: its tensors {sorted(tensors)} are no family's embedding layout "
                             f"({family(family_name).label} reads {', '.join(key for key, _t, _e in layout)})")
    for key, tok_attr, enc_attr in layout:
        if path.stem in getattr(pipe, tok_attr).get_vocab():
            raise EmbeddingError(f"{path.name}: token {path.stem!r} already exists in the vocabulary")
        width = getattr(pipe, enc_attr).get_input_embeddings().weight.shape[1]
        if tensors[key].shape[-1] != width:
            raise EmbeddingError(f"{path.name}: {key} vectors have size {tensors[key].shape[-1]}, "
                                 f"the {enc_attr} expects {width}")


def load_embedding(pipe, family_name: str, path: Path) -> str:
    """Add one embedding file to `pipe`; returns the token name. Raises EmbeddingError if it does not fit."""
    read_header(path)
    tensors = load_file(str(path), device="cpu")
    _check_fits(pipe, family_name, path, tensors)
    refuse_bad_values(path, {key: tensors[key] for key, _tok, _enc in _layout(family_name)}, EmbeddingError)
    for key, tok_attr, enc_attr in _layout(family_name):
        vectors = tensors[key].reshape(-1, tensors[key].shape[-1])
        tokens = _token_names(path.stem, vectors.shape[0])
        _add_vectors(getattr(pipe, tok_attr), getattr(pipe, enc_attr), tokens, vectors)
    return path.stem


def load_all(pipe, family_name: str, folder: Path, noted: set[tuple[str, int]]) -> tuple[str, ...]:
    """Load every fitting `.safetensors` embedding in `folder`; the others are skipped. A family that takes no
    embeddings (`Files.takes_embeddings`) does not read the folder. Why the log stays quiet: a shared folder
    holds every family's embeddings, and A1111 skips another family's without a word (the API lists them as
    skipped), so such a file is noted at debug level only; a file that is wrong for every family is noted once
    per content (`noted`: the caller's record of (path, mtime) already told), not on every model load."""
    if not folder.is_dir() or not family(family_name).files.takes_embeddings:
        return ()
    loaded = []
    for path in sorted(utf8_names(folder, folder.glob("*.safetensors"), "embedding")):
        try:
            loaded.append(load_embedding(pipe, family_name, path))
        except OtherFamilyEmbedding as exc:
            log.debug("embedding %s skipped: %s", path.name, exc)
        except (EmbeddingError, ValueError) as exc:
            seen = (str(path), path.stat().st_mtime_ns)
            if seen not in noted:
                noted.add(seen)
                log.info("embedding %s skipped: %s", path.name, exc)
    return tuple(loaded)
