"""Reading a secret from an environment variable so that it leaves the process's environment.

`os.environ.pop` removes a variable from what child processes inherit, but Linux shows a
process's environment *as it was at start* in `/proc/PID/environ`: the kernel reads it from the
block the process was started with, which unsetting a variable does not touch. So after popping
it, the `NAME=value` bytes in that block are overwritten with zeros (the block lies between the
`env_start` and `env_end` addresses of `/proc/self/stat`, in this process's own writable memory).

What stays visible: the environment of the shell or service manager that started the app (it set
the variable), and the password inside this process's memory (as with any login it checks), which
root or the same user can read through a debugger or `/proc/PID/mem`.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
_ENV_START_FIELD = 50  # 1-based field numbers in /proc/PID/stat (proc(5))
_ENV_END_FIELD = 51


def pop_secret(name: str) -> str | None:
    """The variable's value (None when unset), removed from the environment and, on Linux, wiped
    from the start-up block `/proc/PID/environ` shows."""
    value = os.environ.pop(name, None)
    if value is not None and not _wipe_start_block(os.fsencode(f"{name}={value}")):
        log.info("the start-up copy of %s could not be wiped (not Linux?); /proc/PID/environ may show it", name)
    return value


def _wipe_start_block(entry: bytes) -> bool:
    """Zero every `entry` in the environment block the process started with; whether it was found."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[_ENV_START_FIELD - 3]), int(fields[_ENV_END_FIELD - 3])
    except (OSError, IndexError, ValueError):
        return False
    block = ctypes.string_at(start, end - start)
    found, at = False, block.find(entry + b"\0")
    while at != -1:
        if at == 0 or block[at - 1] == 0:  # a whole `NAME=value` entry, not the tail of another one
            ctypes.memset(start + at, 0, len(entry))
            found = True
        at = block.find(entry + b"\0", at + 1)
    return found
