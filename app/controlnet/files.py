"""ControlNet model files: `models/ControlNet/` as A1111 lays it out, names, hashes, and which family each is for.

What users have there: single `.safetensors` files (in the names their authors wrote: lllyasviel's
`control_v11*` in LDM names, most later ones in diffusers names; a family's kit says which it reads) and
diffusers folders (`config.json` + `diffusion_pytorch_model.safetensors`).
A `.pth`/`.ckpt`/`.pt`/`.bin` is a pickle: it is listed with the reason it is refused and never opened
(lllyasviel's originals are `.pth`; converted `.safetensors` copies of each exist). A model is named by its
file stem or folder name, and titled `name [hash]` as the extension's model list titles it.

Which family a file is for is read from its header's names and shapes (`ControlNetKit.matches`), so a
ControlNet for another family is known before anything is loaded.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from app.families import FAMILIES, Family
from app.paths import utf8_names
from app.safetensors_files import FileIdentity, SafetensorsFileError, read_shapes

FOLDER = "ControlNet"  # under the data folder's `models/`
PICKLE_SUFFIXES = (".pth", ".ckpt", ".pt", ".bin")
FOLDER_WEIGHTS = "diffusion_pytorch_model.safetensors"
_TITLE = re.compile(r"^(?P<name>.*?) \[(?P<hash>[0-9a-f]{8,})\]$")
_HASH_AT, _HASH_SPAN = 0x100000, 0x10000  # A1111's model hash: sha256 of 64 KiB at 1 MiB, 8 hex digits


class ControlNetFileError(ValueError):
    """A ControlNet that cannot be used; the message names it and says why."""


@dataclass(frozen=True)
class ControlNetEntry:
    """One model in `models/ControlNet/`: a single file, a diffusers folder, or a refused pickle."""

    name: str
    path: Path  # the file, or the folder
    weights: Path  # the safetensors file holding the tensors (the file itself, or the folder's)
    refusal: str = ""  # why it cannot be used (a pickle); "" for a usable entry

    @property
    def folder(self) -> bool:
        return self.path.is_dir()


def model_hash(path: Path) -> str:
    """A1111's short model hash (what the extension's titles show): the sha256 of 64 KiB at offset 1 MiB,
    8 hex digits. A file shorter than that (the tiny demo models) is hashed whole: A1111's rule would give
    every such file the hash of no bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(_HASH_AT if size >= _HASH_AT + _HASH_SPAN else 0)
        digest.update(handle.read(_HASH_SPAN if size >= _HASH_AT + _HASH_SPAN else size))
    return digest.hexdigest()[:8]


def split_title(title: str) -> tuple[str, str | None]:
    """"name [hash]" -> (name, hash); a bare name -> (name, None)."""
    found = _TITLE.match(title.strip())
    return (found["name"], found["hash"]) if found else (title.strip(), None)


def model_names(root: Path) -> list[str]:
    """The usable ControlNets' names in `root` (no hashing): the UI's menu and the API's unit check."""
    return [entry.name for entry in ControlNetLibrary(root).usable()]


def bare_name(title: str) -> str:
    """A model's name from the extension's title `name [hash]` (a bare name as it is)."""
    return split_title(title)[0]


class ControlNetLibrary:
    """The ControlNets in `root` (`Settings.controlnet_dir`), listed afresh on every call; hashes and families
    are remembered per file while its size and modification time stay the same."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._facts: dict[Path, tuple[FileIdentity, str, str | None]] = {}  # weights -> (identity, hash, family)

    def entries(self) -> list[ControlNetEntry]:
        if not self.root.is_dir():
            return []
        found: dict[str, ControlNetEntry] = {}
        for path in sorted(utf8_names(self.root, list(self.root.iterdir()), "ControlNet")):
            entry = _entry(path)
            if entry is not None:
                found.setdefault(entry.name, entry)
        return sorted(found.values(), key=lambda e: e.name.lower())

    def usable(self) -> list[ControlNetEntry]:
        return [e for e in self.entries() if not e.refusal]

    def facts(self, entry: ControlNetEntry) -> tuple[str, tuple[str, ...]]:
        """(short hash, the names of the families it fits) of a usable entry; a corrupt file raises
        `ControlNetFileError`."""
        identity = FileIdentity.of(entry.weights)
        known = self._facts.get(entry.weights)
        if known is None or known[0] != identity:
            try:
                shapes = read_shapes(entry.weights)
            except SafetensorsFileError as exc:
                raise ControlNetFileError(f"ControlNet {entry.name}: {exc}") from exc
            known = (identity, model_hash(entry.weights), tuple(fam.name for fam in families_of_shapes(shapes)))
            self._facts[entry.weights] = known
        return known[1], known[2]

    def title(self, entry: ControlNetEntry) -> str:
        return f"{entry.name} [{self.facts(entry)[0]}]"

    def titles(self, family_name: str | None = None) -> list[str]:
        """`name [hash]` of every usable ControlNet (for `family_name`'s family only, when given), as the extension's
        `/controlnet/model_list` answers; an unreadable file is left out (`resolve` says why)."""
        out = []
        for entry in self.usable():
            try:
                short, fits = self.facts(entry)
            except ControlNetFileError:
                continue
            if family_name is None or family_name in fits:
                out.append(f"{entry.name} [{short}]")
        return out

    def resolve(self, title: str) -> ControlNetEntry:
        """The entry a unit names (`name [hash]` or `name`): only a listed one, so a name from the API never
        points anywhere else. A pickle is refused with its reason; a missing name lists the ones there are."""
        name, _short = split_title(title)
        entry = next((e for e in self.entries() if e.name == name), None)
        if entry is None:
            have = ", ".join(e.name for e in self.usable()) or "none"
            raise ControlNetFileError(f"ControlNet model {title!r} not found in models/{FOLDER}/; available: {have}")
        if entry.refusal:
            raise ControlNetFileError(entry.refusal)
        return entry


def _entry(path: Path) -> ControlNetEntry | None:
    suffix = path.suffix.lower()
    if path.is_file() and suffix == ".safetensors":
        return ControlNetEntry(path.stem, path, path)
    if path.is_file() and suffix in PICKLE_SUFFIXES:
        return ControlNetEntry(path.stem, path, path, refusal=(
            f"ControlNet {path.name} is a pickled PyTorch file ({suffix}); pickles can run code when opened and are "
            "never loaded here: use the .safetensors version of this model"))
    if path.is_dir() and (path / "config.json").is_file() and (path / FOLDER_WEIGHTS).is_file():
        return ControlNetEntry(path.name, path, path / FOLDER_WEIGHTS)
    return None


def families_of_shapes(shapes: Mapping[str, tuple[int, ...]]) -> tuple[Family, ...]:
    """The families whose `ControlNetKit.matches` these tensor shapes (families on one architecture share their
    ControlNets: a distilled variant and its base); empty: no family here takes it."""
    return tuple(fam for fam in FAMILIES.values() if fam.controlnet is not None and fam.controlnet.matches(shapes))
