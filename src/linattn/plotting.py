"""Figures are optional: matplotlib comes with the `plots` extra (`pip install 'linattn[plots]'`).

Benchmarks and experiments write their tables and JSON first and their PNG figures last, through
`save_figure`: without matplotlib the figure is skipped and the one notice line `MISSING` is what they
report instead of its path. Imports nothing from linattn.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

MISSING = "no PNG figure: matplotlib is not installed (pip install 'linattn[plots]')"


def matplotlib_missing() -> bool:
    """Whether `import matplotlib` fails (the `plots` extra is not installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def save_figure(path: Path, draw: Callable[[Path], None]) -> str:
    """`draw(path)` unless matplotlib is missing. Returns what to report: the path when the figure was
    written, `MISSING` when matplotlib is not installed (nothing is written), else "(plot failed: ...)":
    a plotting problem must not lose the results written before it."""
    if matplotlib_missing():
        return MISSING
    try:
        draw(path)
    except Exception as e:  # noqa: BLE001 - reported in one line, the results are already written
        return f"(plot failed: {type(e).__name__}: {e})"
    return str(path)


__all__ = ["MISSING", "matplotlib_missing", "save_figure"]
