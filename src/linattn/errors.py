"""Every user-facing error of linattn derives from `LinattnError` (itself a `ValueError`), so
`except linattn.LinattnError` catches anything the library raises about its inputs, data, configs
or checkpoints, and `except ValueError` keeps working for code written against plain Python.

A leaf module: it imports nothing from linattn.
"""
from __future__ import annotations

from typing import Optional


class LinattnError(ValueError):
    """Base of every error linattn raises about what it was given."""


class LinattnTypeError(LinattnError, TypeError):
    """An argument of the wrong type (also a `TypeError`)."""


class ConfigError(LinattnError):
    """A config field with a bad value, or an unknown field."""


class CheckpointError(LinattnError):
    """A checkpoint that is missing, unreadable, or does not match the model config."""


class DataError(LinattnError):
    """Training or evaluation data that is missing or unusable."""


class UsageError(LinattnError):
    """Bad command-line arguments: reported as one line on stderr, exit code 2.

    Args:
        message: What is wrong, naming the argument.
        prog: The command to name in the report (None: the command being run).
    """

    def __init__(self, message: str, prog: Optional[str] = None):
        super().__init__(message)
        self.prog = prog


__all__ = ["LinattnError", "LinattnTypeError", "ConfigError", "CheckpointError", "DataError", "UsageError"]
