"""One writer per run folder: `RunLock` holds an exclusive `fcntl.flock` on `DIR/.linattn.lock` for the
whole run. The kernel releases it when the process ends, however it ends (kill -9 included), so a
lock that can be taken is free: nobody else writes to the folder.

The lock file records the holder (pid, host, start time), for the error a second writer gets and for
the warning when a run starts after one that died: a clean release deletes the file (while still
holding the lock), so a file that names a holder when the lock is free was left by a run that was
killed or crashed. The file is written in place, not through `linattn.io`'s atomic rename: the lock
belongs to the file's inode, which a rename would replace. Without fcntl (Windows) nothing is locked.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

from ..io import pid_alive
from ..logs import get_logger
from .config import TrainError

log = get_logger("training")

try:
    import fcntl
except ImportError:  # pragma: no cover  (Windows)
    fcntl = None

LOCK_FILE = ".linattn.lock"


class RunFolderBusy(TrainError):
    """Another process holds the run folder."""


def _holder_text(info: Dict[str, Any]) -> str:
    pid, host = info.get("pid", "unknown"), info.get("host")
    return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


def _read_holder(fd: int) -> Dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


class RunLock:
    """The exclusive lock of the run folder `folder` (see the module docstring). name: the lock
    file's name (another name locks something else in the folder, e.g. one experiment run);
    after_death: what the warning says happens after a holder died (or a function giving it, asked when
    the warning is printed, so that it can say what the dead run left)."""

    def __init__(self, folder: Union[str, os.PathLike], name: str = LOCK_FILE,
                 after_death: Union[str, Callable[[], str]] = "its last complete checkpoint is used as it is"):
        self.folder = Path(folder)
        self.path = self.folder / name
        self.after_death = after_death
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise RunFolderBusy naming the holder; warn (one line on stderr) when the
        previous holder died without releasing it."""
        if self.held or fcntl is None:
            return
        fd = self._lock_current_file()
        previous = _read_holder(fd)
        if previous:
            alive = isinstance(previous.get("pid"), int) and previous.get("host") == socket.gethostname() \
                and pid_alive(previous["pid"])
            log.warning(f"[linattn] warning: the previous run in {self.folder} ({_holder_text(previous)}) died "
                        f"without releasing its lock" + (" (a process with that pid runs now)" if alive else "")
                        + f"; {self.after_death() if callable(self.after_death) else self.after_death}")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode("utf-8"), 0)
        os.fsync(fd)
        self._fd = fd

    def _lock_current_file(self) -> int:
        """An fd of the lock file at self.path, flock-ed (retried when a releasing holder deleted the file
        between our open and our lock)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunFolderBusy(f"{self.folder} is in use by another run ({_holder_text(holder)}); wait for it "
                                    f"to finish, stop it, or pick another --out") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def release(self) -> None:
        """Delete the lock file, then unlock (a no-op when not held)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


__all__ = ["LOCK_FILE", "RunLock", "RunFolderBusy"]
