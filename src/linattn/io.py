"""Files written so that a crash never leaves half of one: atomic writes (temporary file in the same
folder, fsync, rename, fsync of the folder) and JSON helpers. A leaf module: imports nothing from
linattn.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, List, Optional, Union

PathLike = Union[str, os.PathLike]
TMP_PREFIX = ".tmp-"  # temporary files (and folders) in flight carry this prefix
CHECKPOINT_TMP_PREFIX = ".tmp_"  # checkpoint folders in flight (checkpoint.py)
_TEMP_NAME = re.compile(r"^(?:" + re.escape(TMP_PREFIX) + "|" + re.escape(CHECKPOINT_TMP_PREFIX) + r").+\.(\d+)$")


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (one of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_temps(folder: PathLike) -> List[str]:
    """Remove the temporary files and folders (`.tmp-*.<pid>`, `.tmp_*.<pid>`) that a writer killed
    mid-write left in `folder`: only those whose pid is dead. Returns their names."""
    d = Path(folder)
    removed = []
    for p in sorted(d.iterdir()) if d.is_dir() else []:
        m = _TEMP_NAME.match(p.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def fsync_dir(path: PathLike) -> None:
    """Make a rename inside `path` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write `data` to `path` via a temporary file in the same folder and a rename: readers see the
    old file or the new one, never a part of either."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def atomic_write_text(path: PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def jsonable(x: Any) -> Any:
    """`x` with tensors, numpy scalars, paths and non-finite floats made JSON-safe (inf/NaN -> null)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (str, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "item") and (getattr(x, "ndim", None) == 0 or (hasattr(x, "numel") and x.numel() == 1)):
        return jsonable(x.item())  # numpy scalars, one-element tensors
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    return str(x)


def to_json(obj: Any, indent: int = 2, sort_keys: bool = False) -> str:
    return json.dumps(jsonable(obj), indent=indent, sort_keys=sort_keys) + "\n"


def write_json(path: PathLike, obj: Any, *, sort_keys: bool = False) -> None:
    """Atomically write `obj` (made JSON-safe) as indented JSON."""
    atomic_write_text(path, to_json(obj, sort_keys=sort_keys))


def read_json(path: PathLike) -> Optional[Any]:
    """The JSON in `path`, or None when it is missing or unreadable."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


__all__ = ["TMP_PREFIX", "fsync_dir", "atomic_write_bytes", "atomic_write_text", "jsonable", "to_json",
           "write_json", "read_json"]
