"""Which separate text-encoder and VAE files a checkpoint is loaded with, remembered per checkpoint.

Flux transformer files hold no text encoders and no VAE; users keep those in `models/text_encoder`
and `models/VAE` (Forge's folders), often in several precisions (`t5xxl_fp16`, `t5xxl_fp8_e4m3fn`).
The loader takes the one file of a folder that holds a part; where there are several, or to use
another, the user chooses one per checkpoint (`Engine.set_model_parts`). Choices are stored as
names relative to their folder in `part-choices.json` in the data folder, so the data folder can
move; a name that leaves its folder is refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from app.families import family
from app.paths import resolve_under
from app.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartFiles:
    """The separate files one load may read: chosen files by component, and folders by name."""

    choices: Mapping[str, Path] = field(default_factory=dict)
    folders: Mapping[str, Path] = field(default_factory=dict)


def _folders(settings: Settings) -> dict[str, Path]:
    return {"text_encoder_dir": settings.text_encoder_dir, "vae_dir": settings.vae_dir}


def _stored(settings: Settings) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(settings.part_choices_file.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", settings.part_choices_file, exc)
        return {}
    return data if isinstance(data, dict) else {}


def part_files(settings: Settings, checkpoint: str) -> PartFiles:
    """The folders, and the files chosen for `checkpoint` (none chosen: the folders decide)."""
    folders = _folders(settings)
    chosen = _stored(settings).get(checkpoint, {})
    return PartFiles({component: folders[folder] / name for component, (folder, name) in chosen.items()}, folders)


def choose(settings: Settings, family_name: str, checkpoint: str, parts: Mapping[str, str | None]) -> None:
    """Remember `parts` (component -> file name in its folder; None forgets a choice) for `checkpoint`."""
    fam, folders = family(family_name), _folders(settings)
    by_component = {p.component: p for p in fam.files.parts if p.folder is not None}
    stored = _stored(settings)
    mine = dict(stored.get(checkpoint, {}))
    for component, name in parts.items():
        if component not in by_component:
            raise ValueError(f"{fam.label} takes no separate {component!r} file; choose one of {sorted(by_component)}")
        if name is None:
            mine.pop(component, None)
            continue
        folder = by_component[component].folder
        if not resolve_under(folders[folder], name, "file").is_file():
            raise ValueError(f"no file {name!r} in {folders[folder]}")
        mine[component] = [folder, name]
    stored[checkpoint] = mine
    settings.part_choices_file.write_text(json.dumps(stored, indent=2, sort_keys=True))


def chosen(settings: Settings, checkpoint: str) -> dict[str, str]:
    """component -> chosen file name for `checkpoint` (what `choose` stored)."""
    return {component: name for component, (_folder, name) in _stored(settings).get(checkpoint, {}).items()}


def available(settings: Settings, family_name: str) -> dict[str, list[str]]:
    """component -> the `.safetensors` file names its folder offers (for the UI's pickers)."""
    folders = _folders(settings)
    out = {}
    for part in family(family_name).files.parts:
        if part.folder is not None:
            folder = folders[part.folder]
            out[part.component] = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
    return out
