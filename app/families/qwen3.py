"""The Qwen3 text encoder as a part of a family (Z-Image's Qwen3-4B): tokenizer, names, file.

Why here and not in a family file: Qwen3 is the text encoder of several 2026 families (Z-Image,
Flux.2 Klein), and what it takes is the same everywhere:

* the tokenizer ships in `assets/qwen3_tokenizer/` (`assets/make_qwen3_tokenizer.py`), its 11 MB
  `tokenizer.json` gzip-compressed; `BundledQwen3Tokenizer.from_pretrained` expands it into a
  temporary folder once per process (1.3 s) and hands every pipeline that one object: the only
  change the app makes to a tokenizer is adding textual-inversion tokens, which a Qwen3 family
  does not take (`Files.takes_embeddings`), and a deep copy per pipeline costs 0.65 s;
* transformers keeps the rotary `inv_freq` (and its `original_inv_freq` copy) in fp32 whatever
  the model's dtype, so a family pins them (`QWEN3_PINNED`);
* a separate file (`qwen_3_4b.safetensors`, fp8 "mixed" too) holds `Qwen3ForCausalLM`'s names
  under `model.` (the LM head, when present, is not read); `QWEN3_PART` finds it in
  `models/text_encoder`, or in an all-in-one under ComfyUI's `text_encoders.qwen3_4b.transformer.`.
"""

from __future__ import annotations

import functools
import gzip
import shutil
import tempfile
from pathlib import Path
from types import MappingProxyType

import torch
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from app.families import ASSETS_DIR, ComponentFile, TextEncoder
from app.families.file_layout import own_names

QWEN3_TOKENIZER_DIR = ASSETS_DIR / "qwen3_tokenizer"
_COMPRESSED = "tokenizer.json.gz"
_PLAIN = ("tokenizer_config.json", "special_tokens_map.json")


def expand_into(folder: Path, target: Path) -> None:
    """The bundled tokenizer's files, `tokenizer.json` expanded, written into `target` (a temporary folder)."""
    with gzip.open(folder / _COMPRESSED, "rb") as src, open(target / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    for name in _PLAIN:
        shutil.copyfile(folder / name, target / name)


class BundledQwen3Tokenizer:
    """`from_pretrained(folder)` for the bundled, gzip-compressed Qwen3 tokenizer (`TextEncoder.tokenizer_class`)."""

    @staticmethod
    @functools.cache
    def _load(folder: Path) -> Qwen2Tokenizer:
        with tempfile.TemporaryDirectory(prefix="qwen3-tokenizer-") as tmp:
            expand_into(folder, Path(tmp))
            return Qwen2Tokenizer.from_pretrained(tmp, local_files_only=True)

    @classmethod
    def from_pretrained(cls, folder: Path, **kwargs) -> Qwen2Tokenizer:
        if kwargs:
            raise TypeError(f"{cls.__name__} takes no options, got {sorted(kwargs)}")
        return cls._load(Path(folder))


# Z-Image's pipelines read the prompt as text (`reads="text"`: app/prompts/as_text.py): they put it in
# Qwen3's chat template (with its thinking block), tokenize it to `max_sequence_length` (512), read the
# next-to-last layer and hand the transformer each prompt's unpadded states, which the engine leaves to them,
# bit for bit.
QWEN3 = TextEncoder("text_encoder", "tokenizer", Qwen3Model, "text_encoders.qwen3_4b.transformer.model.",
                    open_clip=False, lora_prefix="lora_te_", embedding_key="qwen3", config_class=Qwen3Config,
                    tokenizer_class=BundledQwen3Tokenizer, tokenizer_dir=QWEN3_TOKENIZER_DIR, reads="text",
                    chunked=False, chat_template=MappingProxyType({"enable_thinking": True}))
QWEN3_PINNED = {"text_encoder.rotary_emb.*inv_freq": torch.float32}
# llama.cpp's names for Qwen3 in a `.gguf` (its converter writes q and k unpermuted for this architecture)
QWEN3_GGUF_NAMES = (
    (r"token_embd\.weight", "embed_tokens.weight"), (r"output_norm\.weight", "norm.weight"),
    *((rf"blk\.(\d+)\.{theirs}\.(weight|bias)", rf"layers.\1.{ours}.\2") for theirs, ours in (
        ("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("attn_q_norm", "self_attn.q_norm"),
        ("attn_k_norm", "self_attn.k_norm"), ("ffn_norm", "post_attention_layernorm"), ("ffn_gate", "mlp.gate_proj"),
        ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"))),
)
# Its marker is a query norm: Qwen2.5-VL's file (`qwen_2.5_vl_7b.safetensors`, Qwen-Image's) names its layers alike
# under `model.` but has none, so a folder holding both offers each family its own.
QWEN3_PART = ComponentFile("text_encoder", "Qwen3 text encoder (qwen_3_4b.safetensors)", Qwen3Model,
                           (QWEN3.single_file_prefix, "model.", ""), "layers.0.self_attn.q_norm.weight", own_names,
                           folder="text_encoder_dir", config_class=Qwen3Config, gguf_names=QWEN3_GGUF_NAMES)
