"""The default checkpoint, remembered across restarts in the data folder.

Why (issue 45, item 10): every start loaded the first checkpoint in alphabetical order, so a user who
worked with SDXL yesterday got a broken file's error, then FLUX.1 at 28 steps, and had to pick SDXL again;
A1111 keeps `sd_model_checkpoint` in its config.json and loads it at start. Here the sessions' default
(the checkpoint loaded at start, then an admin's choice: `SessionStates.set_default_model`) is written to
`default-checkpoint.json`, and the next start tries it first; a remembered file that is gone or no longer
loads falls back to the others in order, as before. `--model` still wins.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def remembered(path: Path) -> str | None:
    """The remembered checkpoint name; None when nothing was remembered or the file is unreadable (logged)."""
    try:
        name = json.loads(path.read_text()).get("checkpoint")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    return name if isinstance(name, str) and name else None


def remember(path: Path, name: str) -> None:
    """Write `name` whole or not at all (a crash mid-write must not leave a file the next start refuses)."""
    part = path.with_name(path.name + ".part")
    try:
        part.write_text(json.dumps({"checkpoint": name}))
        os.replace(part, path)
    except OSError as exc:  # a read-only data folder: the app works, the choice is not kept
        log.warning("could not remember the checkpoint in %s: %s", path, exc)
