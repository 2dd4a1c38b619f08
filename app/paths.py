"""Name -> file resolution that cannot escape its folder.

Names arrive from the UI and from the public API (possibly a share link), so they are
untrusted: absolute paths, `..` segments and symlinks pointing outside the configured folder
are refused with a message that says which folder names must live in. Symlinks the user
placed inside the folder are followed (A1111 users link model folders to other drives): the
check is on the name, which is what an untrusted caller controls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


class UnsafePathError(ValueError):
    """A name that would resolve outside its allowed folder."""


def resolve_under(root: Path, name: str, what: str) -> Path:
    """Resolve `name` (relative, `/`-separated) inside `root`; refuse anything that leaves it."""
    if not name or "\x00" in name:
        raise UnsafePathError(f"{what} name is empty or contains a NUL byte")
    candidate = Path(name)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise UnsafePathError(
            f"{what} {name!r} is not a plain name: absolute paths and '..' are refused; "
            f"put the file under {root} and use its name")
    return root / candidate


def utf8_names(root: Path, paths: Iterable[Path], what: str) -> list[Path]:
    """`paths` whose names under `root` are valid UTF-8; each other one is logged and left out.

    On Linux a file name is bytes, and Python hands back undecodable ones with surrogate escapes:
    such a name cannot be sent to the browser (JSON needs UTF-8), so one badly named file would
    break every listing that contains it, and the app's start-up with it.
    """
    kept = []
    for path in paths:
        relative = path.relative_to(root).as_posix()
        try:
            relative.encode("utf-8")
        except UnicodeEncodeError:
            log.warning("%s file %s in %s skipped: its name is not valid UTF-8; rename it to use it", what,
                        ascii(relative), root)
            continue
        kept.append(path)
    return kept
