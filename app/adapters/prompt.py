"""`<lora:name:weight>` and `<lora:name:te_w:unet_w>` prompt tags, in A1111's order.

A weight may also be a step schedule, `<lora:name:1@0,0@0.3>`, or named, `<lora:name:te=1:unet=0@0,1@1>`
(the sd-webui-loractl syntax A1111 users know; `app.adapters.strength_schedule` says how it reads).

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
from app.adapters.strength_schedule import StrengthSchedule, is_schedule, parse_schedule

_TAG = re.compile(r"<lora:([^:>]+)((?::[^:>]*){0,2})>", re.IGNORECASE)


def _number(text: str, tag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"prompt tag {tag!r}: {text!r} is not a number") from None


def _value(text: str, name: str, tag: str) -> float | StrengthSchedule:
    """A weight field: a number, or a step schedule (`1@0,0@0.3`, loractl's syntax)."""
    return parse_schedule(text, name, f"prompt tag {tag!r}") if is_schedule(text) else _number(text, tag)


def _fields(parts: list[str], tag: str) -> tuple[str | None, str | None]:
    """(te, unet) texts from a tag's fields: positional in A1111's order, or named `te=` / `unet=`."""
    named, positional = {}, []
    for part in parts:
        key, equals, value = part.partition("=")
        if not equals:
            positional.append(part)
        elif key.strip().lower() in ("te", "unet"):
            named[key.strip().lower()] = value.strip()
        else:
            raise ValueError(f"prompt tag {tag!r}: {key.strip()!r}= is not a LoRA field here (te= and unet= are; a "
                             "hires pass takes its strengths from its own prompt's tags)")
    te = named.get("te", positional[0] if positional else None)
    unet = named.get("unet", positional[1] if len(positional) > 1 else None)
    return te, unet


def _spec(name: str, parts: list[str], tag: str) -> LoraSpec:
    """One tag's spec: a single weight (number or schedule) sets both; two are te then unet. A schedule given
    for the text encoder applies at its step-0 strength (the prompt is encoded once, before the first step)."""
    te_text, unet_text = _fields(parts, tag)
    te = 1.0 if te_text is None else _value(te_text, name, tag)
    unet = te if unet_text is None else _value(unet_text, name, tag)
    te_strength = te.start if isinstance(te, StrengthSchedule) else te
    if isinstance(unet, StrengthSchedule):
        return LoraSpec(name, weight=te_strength, te_weight=te_strength, schedule=unet)
    if unet_text is None:
        return LoraSpec(name, weight=te_strength)
    return LoraSpec(name, weight=te_strength, unet_weight=unet, te_weight=te_strength)


def parse_prompt_loras(prompt: str) -> tuple[str, tuple[LoraSpec, ...]]:
    """Return the prompt without tags and the specs the tags ask for (last tag wins per name)."""
    found: dict[str, LoraSpec] = {}
    for match in _TAG.finditer(prompt):
        name = match.group(1).strip()
        parts = [n.strip() for n in match.group(2).split(":")[1:] if n.strip()]
        found[name] = _spec(name, parts, match.group(0))
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
