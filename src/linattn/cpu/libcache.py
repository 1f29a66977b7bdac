"""Where the compiled kernel libraries are cached, and when a cached one may be loaded.

A library in the cache is machine code that `load_library` runs as the user, so the cache is treated the way
ssh treats its keys:

* trusted folders: the cache root (`$LINATTN_CACHE_DIR`, else `~/.cache/linattn`), its `cpu/` and `cpu/<key>/`
  folders and every library must be owned by the user (or root) and not writable by group or others, and the
  root's parent must not let others rename the root (writable by group/others only with the sticky bit, as
  /tmp). A refused root gets one notice saying why; the build then goes to `~/.cache/linattn` (created with
  mode 0700) when that is safe, else to a temporary folder of this process (mode 0700, removed at exit);
* where `os.getuid` does not exist (Windows) there are no POSIX owners or mode bits to check: nothing is
  refused, and the folder's access rights are the protection;
* verified libraries: the build records each library's size and SHA-256 beside it (`<name>.so.sum`), after
  the library was fsynced and renamed into place. A library whose record is missing or does not match (a
  crash before the data reached the disk, a truncated or replaced file) is never loaded: mapping a truncated
  library kills the process with SIGBUS.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Dict, Iterable, List, Optional

ENV_CACHE = "LINATTN_CACHE_DIR"
RECORD_SUFFIX = ".sum"

_REFUSED: Dict[str, str] = {}  # resolved root -> why it is not used (for this process)
_TEMP_ROOT: List[Path] = []
_NOTICED = set()


def _uid() -> Optional[int]:
    getuid = getattr(os, "getuid", None)
    return getuid() if getuid is not None else None


def untrusted(path: Path) -> Optional[str]:
    """Why `path` (a folder or a library) must not be used, or None: owned by another user, or writable by
    group/others. None for a path that does not exist yet and where POSIX owners do not exist."""
    uid = _uid()
    if uid is None:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path} cannot be inspected ({e.strerror})"
    if st.st_uid not in (uid, 0):
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}; chmod go-w it)"
    return None


def _parent_problem(root: Path) -> Optional[str]:
    """Whether others could rename `root` away: its parent writable by group/others without the sticky bit."""
    if _uid() is None:
        return None
    try:
        st = os.stat(root.parent)
    except OSError:
        return None
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{root.parent} (holding the cache) is writable by others without the sticky bit"
    return None


def first_problem(paths: Iterable[Path]) -> Optional[str]:
    for p in paths:
        why = untrusted(p)
        if why is not None:
            return why
    return None


def _make_private(root: Path) -> None:
    """Create `root` (and its missing parents) with mode 0700; an existing folder is left as it is."""
    if not root.exists():
        root.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)  # mkdir's mode passes through the umask


def _temp_root() -> Path:
    if not _TEMP_ROOT:
        path = Path(tempfile.mkdtemp(prefix="linattn-cache-"))  # 0700, owned by this user
        atexit.register(shutil.rmtree, str(path), True)
        _TEMP_ROOT.append(path)
    return _TEMP_ROOT[0]


def is_temporary(root: Path) -> bool:
    """Whether `root` is this process's temporary cache (the last resort)."""
    return bool(_TEMP_ROOT) and root == _TEMP_ROOT[0]


def _candidates() -> List[Path]:
    roots = []
    base = os.environ.get(ENV_CACHE, "").strip()
    if base:
        roots.append(Path(base).expanduser())
    try:
        roots.append(Path.home() / ".cache" / "linattn")
    except (RuntimeError, KeyError):  # no home folder to be found
        pass
    return roots


def refuse(root: Path, why: str) -> None:
    """Stop using `root` in this process (the next `trusted_root()` falls back)."""
    _REFUSED[str(root)] = why


def trusted_root() -> Path:
    """The first cache root that is safe to use (creating the default one); one notice per refused root."""
    for root in _candidates():
        if str(root) in _REFUSED:
            continue
        try:
            _make_private(root)
        except OSError as e:
            refuse(root, f"{root} cannot be created ({e.strerror})")
            continue
        why = _parent_problem(root) or first_problem([root, root / "cpu"])
        if why is None:
            _notice_refused(root)
            return root
        refuse(root, why)
    root = _temp_root()
    _notice_refused(root)
    return root


def _notice_refused(instead: Path) -> None:
    for root, why in _REFUSED.items():
        if root not in _NOTICED:
            _NOTICED.add(root)
            warnings.warn(f"linattn: not using the kernel cache {root}: {why}; building into {instead} instead",
                          stacklevel=4)


# ------------------------------------------------------------------------------------------ the records

def record_path(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe(library: Path) -> dict:
    """The record of a library that was just written: its size and SHA-256."""
    return {"size": library.stat().st_size, "sha256": _digest(library)}


def mismatch(library: Path) -> Optional[str]:
    """Why the cached `library` must not be loaded (missing, no record, size or checksum differing), or None."""
    try:
        size = library.stat().st_size
    except FileNotFoundError:
        return "not built yet"
    try:
        record = json.loads(record_path(library).read_text())
        want_size, want_sum = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{library} has no valid build record"
    if size != want_size:
        return f"{library} has {size} bytes, the build wrote {want_size}"
    if _digest(library) != want_sum:
        return f"{library} does not match the checksum recorded at build time"
    return None
