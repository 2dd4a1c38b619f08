"""`<lora:name:weight>` and `<lora:name:te_w:unet_w>` prompt tags, in A1111's order.

A1111 and Forge read a second number as the UNet's weight and the first as the text encoder's
(its networks extension: `te_multiplier`, then `unet_multiplier`); we read and write the same, so
a prompt moves between the tools with the same meaning.

Tags are parsed into the same declarative list `Engine.set_loras` takes and stripped from the
prompt, so a prompt-only user gets exactly the same patching path as a slider user.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from app.adapters.specs import LoraSpec

_TAG = re.compile(r"<lora:([^:>]+)((?::[^:>]*){0,2})>", re.IGNORECASE)


def _number(text: str, tag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"prompt tag {tag!r}: {text!r} is not a number") from None


def parse_prompt_loras(prompt: str) -> tuple[str, tuple[LoraSpec, ...]]:
    """Return the prompt without tags and the specs the tags ask for (last tag wins per name)."""
    found: dict[str, LoraSpec] = {}
    for match in _TAG.finditer(prompt):
        name = match.group(1).strip()
        numbers = [n for n in match.group(2).split(":")[1:] if n.strip()]
        values = [_number(n.strip(), match.group(0)) for n in numbers]
        first = values[0] if values else 1.0
        unet = values[1] if len(values) > 1 else None
        found[name] = LoraSpec(name, weight=first, unet_weight=unet, te_weight=first if unet is not None else None)
    stripped = re.sub(r"\s{2,}", " ", _TAG.sub("", prompt)).strip(" ,")
    return stripped, tuple(found.values())


def without_missing_loras(params, exists: Callable[[str], bool]):
    """(`params` without the prompt's tags naming a LoRA that does not `exist`, those names): A1111 warns of a
    LoRA it cannot find and draws without it, so a pasted prompt works here too, and nothing of the missing
    LoRA reaches the image or its infotext."""
    missing: list[str] = []

    def keep(match: re.Match) -> str:
        name = match.group(1).strip()
        if exists(name):
            return match.group(0)
        missing.append(name)
        return ""

    prompt = _TAG.sub(keep, params.prompt)
    if not missing:
        return params, ()
    return dataclasses.replace(params, prompt=re.sub(r"\s{2,}", " ", prompt).strip(" ,")), tuple(dict.fromkeys(missing))


def missing_lora_note(missing: tuple[str, ...], folder: str) -> str:
    """The note for tags `without_missing_loras` took out (`folder`: the LoRA folder as messages name it)."""
    if not missing:
        return ""
    names = ", ".join(repr(name) for name in missing)
    return (f"LoRA {names} not found in {folder}: drawn without it (its tag was left out, as A1111 does); "
            "put the file there and press ↻ to use it")


def merge_prompt_loras(params, desired: tuple[LoraSpec, ...]):
    """Strip tags from `params.prompt`; tags add to `desired` or override an entry of the same name."""
    prompt, tagged = parse_prompt_loras(params.prompt)
    if not tagged:
        return params, desired
    by_name = {spec.name: spec for spec in desired}
    by_name.update({spec.name: spec for spec in tagged})
    return dataclasses.replace(params, prompt=prompt), tuple(by_name.values())
