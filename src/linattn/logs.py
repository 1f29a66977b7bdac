"""linattn's messages to the user (progress lines, warnings, notices) through `logging`.

Every message goes through a logger under "linattn" (`get_logger("training")` -> "linattn.training").
By default the "linattn" logger has one handler that writes each message as it is, one line, to the
*current* `sys.stderr` (looked up at each message, so a redirected or captured stderr gets them), at
level INFO, and does not propagate to the root logger (no message twice when an application configures
logging). An application takes over with the standard calls, e.g.

    logging.getLogger("linattn").setLevel(logging.WARNING)                # warnings only
    logging.getLogger("linattn").removeHandler(linattn.logs.DEFAULT_HANDLER)  # its own handlers instead

This module imports nothing from linattn.
"""
from __future__ import annotations

import logging
import sys

ROOT = "linattn"


class StderrHandler(logging.Handler):
    """Writes `record.getMessage()` (the formatter's default "%(message)s") and a newline to the current
    sys.stderr and flushes it: the lines the commands printed before they used logging."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # a closed or broken stderr must not stop a training run
            self.handleError(record)


DEFAULT_HANDLER = StderrHandler(logging.INFO)
_root = logging.getLogger(ROOT)
if not any(isinstance(h, StderrHandler) for h in _root.handlers):
    _root.addHandler(DEFAULT_HANDLER)
    _root.setLevel(logging.INFO)
    _root.propagate = False


def get_logger(name: str) -> logging.Logger:
    """The logger "linattn.<name>" (its messages reach the default handler above unless reconfigured)."""
    return logging.getLogger(f"{ROOT}.{name}")
