"""A1111's prompt styles: saved prompt snippets in `styles.csv` in the data folder, applied to a prompt.

Why the same file and rule: A1111 and Forge users bring years of styles in `styles.csv`; pointing
`--data-dir` at their install must show them, and a style saved here must read back there. The
format is theirs (`modules/styles.py`): a CSV with the header `name,prompt,negative_prompt`, UTF-8
with a byte-order mark, rows whose name starts with `#` ignored, an old file's `text` column read
as the prompt. A style applies to a prompt as A1111 applies it: where the style holds `{prompt}`
the prompt replaces it, else the style is appended after ", " (an empty side adds no comma); the
negative prompt the same way with the style's negative prompt; several styles apply in the order
chosen. The saved infotext carries the prompt with its styles applied, as A1111 writes it.

The file is read on every use (it is small, and the user may edit it by hand meanwhile) and written
whole to a temporary file that then replaces it, the old one kept as `styles.csv.bak`, as A1111
keeps it, so a failed write never loses the styles.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

FILE_NAME = "styles.csv"
FIELDS = ("name", "prompt", "negative_prompt")
PLACEHOLDER = "{prompt}"
MAX_STYLE_CHARS = 16_000  # a style is a prompt: the prompt's own cap (`generate.MAX_PROMPT_CHARS`)


class PromptStyle(NamedTuple):
    name: str
    prompt: str
    negative_prompt: str


def merge(style_text: str, prompt: str) -> str:
    """One style onto one prompt, by A1111's rule (see the module docstring)."""
    if PLACEHOLDER in style_text:
        return style_text.replace(PLACEHOLDER, prompt)
    return ", ".join(part for part in (prompt.strip(), style_text.strip()) if part)


def read_styles(path: Path) -> dict[str, PromptStyle]:
    """The styles of an A1111 `styles.csv` by name ({} when there is none); a file that is not such a CSV
    is refused with its path named."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8-sig", newline="") as file:
            rows = list(csv.DictReader(file, skipinitialspace=True))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path} is not a readable styles CSV (UTF-8, header name,prompt,negative_prompt): "
                         f"{exc}") from exc
    styles = {}
    for row in rows:
        name = (row.get("name") or "").strip()
        if not name or name.startswith("#"):
            continue
        prompt = row.get("prompt") if "prompt" in row else row.get("text")
        styles[name] = PromptStyle(name, prompt or "", row.get("negative_prompt") or "")
    return styles


def apply_styles(path: Path, names: Sequence[str], prompt: str, negative_prompt: str) -> tuple[str, str]:
    """(prompt, negative prompt) with the styles `names` applied in order; an unknown name is refused
    with the known ones (A1111 skips it silently, which hides a typo)."""
    if not names:
        return prompt, negative_prompt
    styles = read_styles(path)
    unknown = [name for name in names if name not in styles]
    if unknown:
        known = ", ".join(styles) or f"none: {path} holds no style"
        raise ValueError(f"unknown style(s) {', '.join(map(repr, unknown))}; known: {known}")
    for name in names:
        prompt = merge(styles[name].prompt, prompt)
        negative_prompt = merge(styles[name].negative_prompt, negative_prompt)
    return prompt, negative_prompt


def csv_text(styles: Iterable[PromptStyle]) -> str:
    """The styles as A1111 writes its file (header first; no byte-order mark, the writer adds it)."""
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(FIELDS)
    writer.writerows(styles)
    return buffer.getvalue()


def save_style(path: Path, style: PromptStyle) -> dict[str, PromptStyle]:
    """Add `style`, or replace the one of that name, and write the file; returns the styles now saved."""
    name = style.name.strip()
    if not name or name.startswith("#"):
        raise ValueError("a style needs a name (one not starting with '#', which A1111 reads as a comment)")
    if any(len(text) > MAX_STYLE_CHARS for text in style):
        raise ValueError(f"a style's text may hold {MAX_STYLE_CHARS:,} characters")
    styles = read_styles(path)
    styles[name] = PromptStyle(name, style.prompt, style.negative_prompt)
    _write(path, csv_text(styles.values()))
    return styles


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".styles-", suffix=".csv", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8-sig", newline="") as file:
            file.write(text)
        if path.exists():
            shutil.copy2(path, path.with_name(path.name + ".bak"))
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
