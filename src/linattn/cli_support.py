"""What every command-line entry point shares: an argparse parser that raises `UsageError` instead
of printing a usage block and exiting, and the one-line error report. A leaf module (it imports
only linattn.errors): `cli.py`, `bench/`, `experiments/`, `demo` and `training/` import from here,
never from `cli.py`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from .errors import UsageError

PROG = "linattn"


class ArgParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing the usage block and exiting."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # argparse API
        raise UsageError(message, prog=self.prog)


def report_error(message: str, prog: Optional[str] = None) -> int:
    """Print `prog: error: message` on one line of stderr; return the exit code 2."""
    first = str(message).strip().splitlines()[0] if str(message).strip() else "error"
    print(f"{prog or PROG}: error: {first}", file=sys.stderr)
    return 2


__all__ = ["PROG", "ArgParser", "UsageError", "report_error"]
