"""Exceptions raised while reading and applying adapter files.

They subclass `ValueError` because every one of them means "this input is wrong", and callers
that only care about that (the UI, which shows the message) can catch one familiar type. The
split below lets the patcher tell a broken file (refuse it outright) from a file that is fine
but made for another model (report how many layers do not fit). Messages always name the
layer key or file and say what was expected, so the user can act without reading a traceback.
"""

from __future__ import annotations


class AdapterError(ValueError):
    """Base class: an adapter file could not be used."""


class AdapterFormatError(AdapterError):
    """The adapter's own tensors are malformed or inconsistent (missing keys, rank mismatch).

    Raised without looking at the model: the file itself is wrong.
    """


class IncompatibleAdapterError(AdapterError):
    """The adapter is well formed but its shapes do not fit the target weight (or bias).

    Usually a LoRA made for another architecture (SD1.5 vs SDXL) or mapped to the wrong layer.
    """


class LoraApplyError(AdapterError):
    """Applying one named LoRA failed; nothing of the new list was kept."""

    def __init__(self, lora_name: str, message: str) -> None:
        named = message.startswith(f"LoRA {lora_name!r}")  # e.g. the library's "LoRA 'x' not found"
        super().__init__(message if named else f"LoRA {lora_name!r}: {message}")
        self.lora_name = lora_name
