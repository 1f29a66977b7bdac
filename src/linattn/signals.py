"""One stop flag for every long-running loop: the trainer, the vision trainer, tokenizer training.

`StopFlag` is a request to stop at the next safe point. Used as a context manager with `enabled=True`
(main thread only), SIGINT and SIGTERM set it instead of ending the process, with one notice line
(`linattn.logs`); a second SIGINT raises KeyboardInterrupt at once. The previous handlers come back on
exit. `set()` requests a stop from code (another thread may poll `requested` or call `raise_if_set`).
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Dict, Optional

from .errors import LinattnError
from .logs import get_logger

log = get_logger("signals")

# The trainer's notice; {signal} is the signal's name (SIGINT, SIGTERM).
TRAINING_NOTICE = ("\n[linattn] {signal}: finishing the current step, saving, exiting "
                   "(SIGINT again aborts at once; the last checkpoint stays intact)")


class StopRequested(LinattnError):
    """Raised by `StopFlag.raise_if_set` inside a loop that must end early (the caller was interrupted);
    a LinattnError like every exception linattn defines (tests/test_structure.py)."""


class StopFlag:
    """SIGINT/SIGTERM (while entered, if enabled) or `set()` -> a stop is requested: finish the step, save,
    stop. `signum` is the signal that asked (None when none did); `notice` the line logged on a signal."""

    def __init__(self, enabled: bool = True, notice: Optional[str] = TRAINING_NOTICE):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.notice = notice
        self.signum: Optional[int] = None
        self._set = threading.Event()
        self._old: Dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None or self._set.is_set()

    def set(self) -> None:
        self._set.set()

    def is_set(self) -> bool:
        """`requested`, under threading.Event's name (code written for an Event takes a StopFlag)."""
        return self.requested

    def raise_if_set(self) -> None:
        if self.requested:
            raise StopRequested("stopped: a stop was requested (an interrupt or StopFlag.set())")

    def _handler(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        if self.notice:
            log.warning(self.notice.format(signal=signal.Signals(signum).name))

    def __enter__(self) -> "StopFlag":
        if self.enabled:
            for s in (signal.SIGINT, signal.SIGTERM):
                try:
                    self._old[s] = signal.signal(s, self._handler)
                except (ValueError, OSError):
                    pass
        return self

    def __exit__(self, *exc) -> bool:
        for s, h in self._old.items():
            try:
                signal.signal(s, h)
            except (ValueError, OSError):
                pass
        self._old.clear()
        return False
