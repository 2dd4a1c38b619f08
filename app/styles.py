"""A1111's prompt styles: saved prompt snippets in `styles.csv` in the data folder, applied to a prompt.

Why the same file and rule: A1111 and Forge users bring years of styles in `styles.csv`; pointing
`--data-dir` at their install must show them, and a style saved here must read back there. The
format is theirs (`modules/styles.py`): a CSV with the header `name,prompt,negative_prompt`, UTF-8
with a byte-order mark, rows whose name starts with `#` ignored, an old file's `text` column read
as the prompt. A style applies to a prompt as A1111 applies it: where the style holds `{prompt}`
the prompt replaces it, else the style is appended after ", " (an empty side adds no comma); the
negative prompt the same way with the style's negative prompt; several styles apply in the order
chosen. The saved infotext carries the prompt with its styles applied, as A1111 writes it.

Who writes which file: the shared `styles.csv` belongs to the admin (`app/accounts.py`); every
other account saves to a file of its own (`styles-by-account/`, `account_file`) and sees the shared
styles and its own together, its own winning on a name clash for that account only (`StyleBook`).
So no account can overwrite another's style or change what another's prompts get (a style can carry
`<lora:…>` tags), and nobody but the admin can grow the shared file. A file holds at most
`MAX_STYLES` styles and `MAX_FILE_BYTES`, each text at most `MAX_STYLE_CHARS`: a save past a cap
is refused with the cap named, and nothing is written.

The file is read on every use (it is small, and the user may edit it by hand meanwhile) and written
whole to a temporary file that then replaces it, the old one kept as `styles.csv.bak`, as A1111
keeps it, so a failed write never loses the styles.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

FILE_NAME = "styles.csv"
FIELDS = ("name", "prompt", "negative_prompt")
PLACEHOLDER = "{prompt}"
MAX_STYLE_CHARS = 16_000  # a style is a prompt: the prompt's own cap (`generate.MAX_PROMPT_CHARS`)
MAX_NAME_CHARS = 200
MAX_STYLES = 256  # per file: the shared one and each account's own
MAX_FILE_BYTES = 1 << 20  # per file, as written
ACCOUNT_FOLDER = "styles-by-account"


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


def applied(styles: Mapping[str, PromptStyle], names: Sequence[str], prompt: str,
            negative_prompt: str) -> tuple[str, str]:
    """(prompt, negative prompt) with `styles[name]` for each of `names` applied in order; an unknown name
    is refused with the known ones (A1111 skips it silently, which hides a typo)."""
    unknown = [name for name in names if name not in styles]
    if unknown:
        known = ", ".join(styles) or "none saved"
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
    """Add `style`, or replace the one of that name, and write the file; returns the styles now saved. A
    style or file past a cap (see the module docstring) is refused with the cap named, the file unchanged."""
    name = style.name.strip()
    if not name or name.startswith("#"):
        raise ValueError("a style needs a name (one not starting with '#', which A1111 reads as a comment)")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a style's name may hold {MAX_NAME_CHARS} characters; this one has {len(name):,}")
    if any(len(text) > MAX_STYLE_CHARS for text in style):
        raise ValueError(f"a style's text may hold {MAX_STYLE_CHARS:,} characters")
    styles = read_styles(path)
    if name not in styles and len(styles) >= MAX_STYLES:
        raise ValueError(f"{path.name} holds {len(styles)} styles, the most allowed ({MAX_STYLES}); replace one "
                         "(save under its name) instead")
    styles[name] = PromptStyle(name, style.prompt, style.negative_prompt)
    text = csv_text(styles.values())
    if len(text.encode("utf-8")) > MAX_FILE_BYTES:
        raise ValueError(f"{path.name} would hold {len(text.encode('utf-8')):,} bytes, more than the "
                         f"{MAX_FILE_BYTES:,} allowed per styles file; shorten or replace a style")
    _write(path, text)
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


def account_file(data_dir: Path, account: str) -> Path:
    """An account's own styles file: a readable, safe stem of its name plus a hash that keeps two names apart."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", account)[:40]
    return data_dir / ACCOUNT_FOLDER / f"{stem}-{hashlib.sha256(account.encode()).hexdigest()[:12]}.csv"


@dataclass(frozen=True)
class StyleBook:
    """The styles one account sees (the `shared` file, then its `own`, which wins on a name) and the file
    its saves go to: `own`, or the shared file for the admin (`own` None)."""

    shared: Path
    own: Path | None = None

    def read(self) -> dict[str, PromptStyle]:
        return read_styles(self.shared) | (read_styles(self.own) if self.own else {})

    def apply(self, names: Sequence[str], prompt: str, negative_prompt: str) -> tuple[str, str]:
        return applied(self.read() if names else {}, names, prompt, negative_prompt)

    @property
    def target(self) -> Path:
        return self.own or self.shared

    def save(self, style: PromptStyle) -> dict[str, PromptStyle]:
        """Save into `target`; returns every style this account now sees."""
        save_style(self.target, style)
        return self.read()
