"""A readable console: known third-party noise is dropped at start, everything else stays.

Each filter drops one message we know to be harmless here, from the one logger that emits it,
and says why; a filter on a logger stays for the whole run, so messages a library repeats at
every generation are covered too. Any other warning from these libraries still shows.
"""

from __future__ import annotations

import logging

# (emitting logger, text the message contains, why it is harmless here)
KNOWN_NOISE = (
    ("diffusers.models.modeling_utils", "that should be kept in float32: []",
     "the list of modules to keep in float32 is empty, so there is nothing to keep; placement casts "
     "with .to() on purpose and diffusers says this once per call, hundreds of times per GPU run"),
    ("transformers.utils.import_utils", "requires torchvision (not installed)",
     "image processors are never used: the safety checker is off"),
    ("transformers.modeling_utils", "initialized from a multivariate normal distribution",
     "textual-inversion loading overwrites the new token rows right after resizing"),
)
QUIET_LOGGERS = {"httpx": logging.WARNING}  # Gradio's own readiness requests, one INFO line each


class DropMessage(logging.Filter):
    """Drops records whose message contains `text`."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_third_party() -> None:
    """Install the filters (idempotent) and hide the libraries' load/save progress bars, which
    interleave with our log; the status line shows loading progress instead."""
    for logger_name, text, _why in KNOWN_NOISE:
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, DropMessage) and f.text == text for f in logger.filters):
            logger.addFilter(DropMessage(text))
    for logger_name, level in QUIET_LOGGERS.items():
        logging.getLogger(logger_name).setLevel(level)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
