"""Name -> file resolution that cannot escape its folder.

Names arrive from the UI and from the public API (possibly a share link), so they are
untrusted: absolute paths, `..` segments and symlinks pointing outside the configured folder
are refused with a message that says which folder names must live in. Symlinks the user
placed inside the folder are followed (A1111 users link model folders to other drives): the
check is on the name, which is what an untrusted caller controls.
"""

from __future__ import annotations

from pathlib import Path


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
