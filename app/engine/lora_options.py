"""Per-LoRA choices the user makes once and the engine remembers: whether a LoRA may apply in part.

A LoRA of which less than half the tensors match the loaded model is refused (app/adapters/matching.py):
usually it is made for another model or written in a layout not read here. Some users know better
(a LoRA trained with extra layers their model lacks) and allow it, per LoRA. The choice is kept by
LoRA name (relative to `models/Lora`, so the data folder can move) in `lora-options.json` in the data
folder, as `{"name": {"allow_partial": true}}`; a name is checked against the library before it is
stored, so a request cannot fill the file with made-up names. The file is replaced atomically: the
UI reads it while the worker may be writing it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

from app.settings import Settings

log = logging.getLogger(__name__)
ALLOW_PARTIAL = "allow_partial"


def _stored(settings: Settings) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(settings.lora_options_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", settings.lora_options_file, exc)
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def allows_partial(settings: Settings, name: str) -> bool:
    """Whether the user allowed `name` to apply when less than half of its tensors match."""
    return _stored(settings).get(name, {}).get(ALLOW_PARTIAL) is True


def set_allow_partial(settings: Settings, name: str, allowed: bool) -> None:
    """Remember (or, with False, forget) that `name` may apply in part."""
    stored = _stored(settings)
    options = dict(stored.get(name, {}))
    if allowed:
        options[ALLOW_PARTIAL] = True
    else:
        options.pop(ALLOW_PARTIAL, None)
    if options:
        stored[name] = options
    else:
        stored.pop(name, None)
    path = settings.lora_options_file
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=".lora-options-",
                                     suffix=".tmp", delete=False) as tmp:
        try:
            json.dump(stored, tmp, indent=2, sort_keys=True)
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)
