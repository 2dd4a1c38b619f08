"""A1111-style infotext: the `parameters` text of a PNG, written and read in one place.

The format A1111, Forge and Civitai share: the prompt (any number of lines), then optional
lines starting `Negative prompt: `, then one line of `Key: value` pairs joined by ", ", where a
value holding a comma, colon or newline is written as a JSON string. LoRAs travel as
`<lora:name:weight>` tags in the prompt plus a `Lora hashes: "name: hash, …"` pair, which is
what those tools read back.

The generation writer (`app.engine.generate.infotext`) and the PNG Info reader both use this
module, so a PNG we write is a PNG we can read. Tag syntax is the prompt parser's
(`app.adapters.prompt`) and A1111's: `<lora:name:te:unet>` when the two weights differ (the text
encoder's first, as A1111's and Forge's networks read it), so a two-number tag means the same in
every tool, whoever wrote it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from app.adapters.prompt import parse_prompt_loras
from app.adapters.specs import LoraSpec
from app.png_text import SIGNATURE, read_png

OUR_VERSION = "steady-diffusion"
NEGATIVE = "Negative prompt:"
# `Key: value` pairs, where a value is a JSON string or runs to the next comma and a key is a word
# with spaces, dashes or slashes ("CFG scale", "Schedule type", "Hires upscale"): A1111's shape.
# A1111's regex (`\s*(\w[\w \-/]*):\s*(value)(?:,|$)`, run by `findall`) is tried at every position,
# and at each it backtracks through the whole run of key characters when no colon follows: quadratic
# time, 43.8 s for 50 KB of `a a a …` while every other request waited. This one also matches a run
# *without* a colon (group 2 empty), so the scan goes on after the run instead of inside it, and a
# quoted value's scan ends at its first unescaped quote, which no later value can start before: every
# character is scanned a bounded number of times. It finds the same pairs (tests compare the two).
_PAIR = re.compile(r'(\w[\w \-/]*)(?:(:)\s*("(?:\\.|[^\\"])*"(?=,|$)|[^,]*),?)?')
_MIN_PAIRS = 3  # a last line with fewer `Key: value` pairs is part of the prompt (A1111's rule too)
MAX_INFOTEXT_CHARS = 1 << 20  # longer texts are refused unread (`png_text` caps a PNG's chunk the same)


class LoraUse(NamedTuple):
    """A LoRA a generation ran with; `te` None means the text-encoder weight equals `unet`; `schedule` the
    denoiser's step schedule as typed ("" for none; `unet` is then its step-0 strength)."""

    name: str
    unet: float
    short_hash: str = ""
    te: float | None = None
    schedule: str = ""


@dataclass(frozen=True)
class Infotext:
    """What a `parameters` text says: prompts without LoRA tags, the settings, the LoRAs."""

    prompt: str
    negative_prompt: str
    settings: dict[str, str]
    loras: tuple[LoraSpec, ...]

    @property
    def ours(self) -> bool:
        return self.settings.get("Version", "") == OUR_VERSION


def quote(value: object) -> str:
    """A value as A1111 writes it: plain unless a comma, colon or newline would break the line."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ',:\n"') else text


def lora_tag(name: str, unet: float, te: float | None = None, schedule: str = "") -> str:
    """`<lora:name:w>`, or `<lora:name:te:unet>` (A1111's order) when the text-encoder weight differs; a step
    `schedule` stands for the UNet weight (`<lora:name:1@0,0@0.3>`: the text encoder at its step-0 strength)."""
    unet_text = schedule or f"{unet:g}"
    if te is None or te == unet:
        return f"<lora:{name}:{unet_text}>"
    return f"<lora:{name}:{te:g}:{unet_text}>"


def prompt_with_tags(prompt: str, loras: tuple[LoraUse, ...]) -> str:
    """The prompt plus a tag for every LoRA it does not already carry, so other tools see them all."""
    _stripped, tagged = parse_prompt_loras(prompt)
    present = {spec.name for spec in tagged}
    tags = [lora_tag(u.name, u.unet, u.te, u.schedule) for u in loras if u.name not in present]
    return " ".join([prompt.strip(), *tags]).strip()


def format_infotext(prompt: str, negative_prompt: str, settings: list[tuple[str, object]],
                    loras: tuple[LoraUse, ...] = ()) -> str:
    """The full text: prompt with LoRA tags, negative prompt, then the settings line."""
    pairs = [*settings]
    if loras:
        pairs.append(("Lora hashes", ", ".join(f"{u.name}: {u.short_hash}" for u in loras)))
        pairs.append(("Lora weights", ", ".join(f"{u.name}: {u.unet:g}" for u in loras)))
    pairs.append(("Version", OUR_VERSION))
    lines = [prompt_with_tags(prompt, loras)]
    if negative_prompt:
        lines.append(f"{NEGATIVE} {negative_prompt}")
    lines.append(", ".join(f"{key}: {quote(value)}" for key, value in pairs))
    return "\n".join(lines)


def _settings_line(line: str) -> dict[str, str] | None:
    pairs = [(key, value) for key, colon, value in _PAIR.findall(line) if colon]
    if len(pairs) < _MIN_PAIRS:
        return None
    return {key.strip(): json.loads(value) if value.startswith('"') else value.strip() for key, value in pairs}


def _weights_field(text: str) -> tuple[LoraSpec, ...]:
    """`name: w, name: w` from our own `Lora weights` pair (older PNGs of ours carried no tags)."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.rpartition(":")
        specs.append(LoraSpec(name.strip(), float(weight)))
    return tuple(specs)


def parse_infotext(text: str) -> Infotext:
    """Read a `parameters` text from us, A1111 or Forge; raises ValueError when it has no settings line
    or is over `MAX_INFOTEXT_CHARS` (reading it takes linear time, 1 MB in about 0.05 s)."""
    if len(text) > MAX_INFOTEXT_CHARS:
        raise ValueError(f"the infotext is {len(text):,} characters long; the most read is {MAX_INFOTEXT_CHARS:,}")
    lines = text.strip().replace("\r\n", "\n").split("\n")
    settings = _settings_line(lines[-1]) if lines else None
    if settings is None:
        raise ValueError("no generation settings found (expected a last line like 'Steps: 20, Sampler: …')")
    prompt_lines, negative_lines, target = [], [], None
    for line in lines[:-1]:
        if line.startswith(NEGATIVE):
            target, line = negative_lines, line[len(NEGATIVE):].strip()
        (prompt_lines if target is None else negative_lines).append(line)
    prompt, loras = parse_prompt_loras("\n".join(prompt_lines))
    if not loras and settings.get("Lora weights"):
        loras = _weights_field(settings["Lora weights"])
    return Infotext(prompt, "\n".join(negative_lines).strip(), settings, loras)


def read_parameters(path: Path) -> str | None:
    """The `parameters` text chunk of a PNG (where A1111, Forge and we write infotext), or None (also
    for a file that is not a PNG). Only the header chunks are read, within `app.png_text`'s caps (a
    chunk over them raises ValueError); the pixels are never decoded."""
    with open(path, "rb") as stream:
        if stream.read(len(SIGNATURE)) != SIGNATURE:
            return None
        stream.seek(0)
        return read_png(stream).text.get("parameters")
