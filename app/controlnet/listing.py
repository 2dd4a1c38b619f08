"""The ControlNet models a unit may name: `models/ControlNet/` as A1111 lays it out.

`.safetensors` files by stem and diffusers folders (with `config.json`) by name; pickles are not listed.
The UI's model menu, `/controlnet/model_list` and the API's unit check read this one list.
"""

from __future__ import annotations

from pathlib import Path


def model_names(folder: Path) -> list[str]:
    """The ControlNets in `folder`, sorted without regard to case."""
    if not folder.is_dir():
        return []
    found = {p.stem for p in folder.glob("*.safetensors") if p.is_file()}
    found |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "config.json").is_file()}
    return sorted(found, key=str.lower)


def bare_name(title: str) -> str:
    """A model's name from the extension's title `name [hash]` (a bare name as it is)."""
    name = title.strip()
    return name.rpartition(" [")[0] if name.endswith("]") and " [" in name else name
