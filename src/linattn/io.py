"""Files written so that a crash never leaves half of one: atomic writes (temporary file in the same
folder, fsync, rename, fsync of the folder) and JSON helpers. A leaf module: imports nothing from
linattn.

Every file gets the mode a plain `open()` gives under the process umask (0644 under umask 022):
writers that create their own private temporary file (safetensors writes 0600 and renames it) are
followed by `give_default_mode`, so that no private mode leaks through a rename.
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


def current_umask() -> int:
    """The process umask. Read from /proc where it says it (Linux), since setting it to read it back
    would briefly change it for every thread; elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def default_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0o666 less the umask."""
    return 0o666 & ~current_umask()


def give_default_mode(path: PathLike) -> None:
    """Give the file `path` the mode a plain open() would have given it (`default_file_mode`)."""
    os.chmod(path, default_file_mode())


def give_default_modes(folder: PathLike) -> None:
    """`give_default_mode` for every regular file under `folder` (symbolic links are left alone)."""
    mode = default_file_mode()
    for p in Path(folder).rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


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
        give_default_mode(tmp)   # a temporary file left by a killed writer may carry another mode
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


# JSON lines (metrics.jsonl): one record a line, appended as a run goes; a resume rewrites the file atomically.

def json_line(record: Any) -> str:
    """`record` (made JSON-safe) as one line of JSON, newline included."""
    return json.dumps(jsonable(record)) + "\n"


def append_jsonl(path: PathLike, record: Any) -> None:
    """Append one record to a JSON-lines file (a kill mid-write tears at most this last line)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json_line(record))


def write_jsonl(path: PathLike, records: List[Any]) -> None:
    """Atomically write a JSON-lines file holding `records`."""
    atomic_write_text(path, "".join(json_line(r) for r in records))


def read_jsonl(path: PathLike) -> List[Any]:
    """The records of a JSON-lines file ([] when it is missing); blank lines are skipped and reading stops at
    the first line that is not JSON (a torn last line, from a kill mid-write)."""
    records: List[Any] = []
    p = Path(path)
    if p.is_file():
        for line in p.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                break
    return records


__all__ = ["TMP_PREFIX", "current_umask", "default_file_mode", "give_default_mode", "give_default_modes", "fsync_dir",
           "atomic_write_bytes", "atomic_write_text", "jsonable", "to_json", "write_json", "read_json", "json_line",
           "append_jsonl", "write_jsonl", "read_jsonl"]
