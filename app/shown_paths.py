"""How answers and messages name folders: a stranger reading them (a share link's visitor, a bug
report's reader) learns neither the user's name nor the disk's layout.

Paths under the data folder become relative to it (`models/Lora/x.safetensors`, the folder itself
`.`), the app's and Python's install folders `<app>`, `<site-packages>`, `<python>` (a traceback
names them in every line), and other paths in the home folder start with `~`. The bug report
(`report.redact`) and every answer of the UI and the APIs (`without_folders`) use the same rule.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any


def install_folders() -> list[tuple[str, str]]:
    """(folder, stand-in) for where the app and Python are installed, the most specific first: a
    traceback names them in every line, and they tell the reader the user's name and layout."""
    paths = sysconfig.get_paths()
    named = {str(Path(__file__).resolve().parents[1]): "<app>", paths["purelib"]: "<site-packages>",
             paths["platlib"]: "<site-packages>", paths["stdlib"]: "<python>", sys.prefix: "<python>"}
    return sorted(((folder, name) for folder, name in named.items() if len(folder) > 1),
                  key=lambda pair: len(pair[0]), reverse=True)


def without_folders(value: Any, data_dir: Path) -> Any:
    """A JSON `value` (dicts, lists, strings, numbers: `report.jsonable` makes one) as an answer may
    show it to whoever the app serves (a share link's strangers): every path relative to `data_dir`,
    no install or home folder (`folder_redactor`); keys and everything else as they were."""
    folders = folder_redactor(None, str(data_dir))

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(item) for k, item in v.items()}
        if isinstance(v, list):
            return [clean(item) for item in v]
        return folders(v) if isinstance(v, str) else v

    return clean(value)


def folder_redactor(home: str | None, data_dir: str | None) -> Callable[[str], str]:
    """A text's folders as a stranger may read them: paths under `data_dir` relative to it (the
    folder itself `.`), the app's and Python's install folders `<app>`, `<site-packages>`,
    `<python>`, other home-folder paths starting with `~` (`home` None: the user's)."""
    home = str(Path.home()) if home is None else home
    installs = install_folders()
    inside = re.compile(re.escape(data_dir) + r"[/\\]") if data_dir and data_dir != "/" else None
    itself = re.compile(re.escape(data_dir) + r"(?![\w.-])") if inside else None
    at_home = re.compile(re.escape(home) + r"(?=[/\\]|$|\W)") if home and home != "/" else None

    def shown(text: str) -> str:
        if inside is not None:
            text = itself.sub(".", inside.sub("", text))
        for folder, name in installs:
            text = text.replace(folder, name)
        return at_home.sub("~", text) if at_home is not None else text

    return shown
