"""`linattn serve` in a child process, for the tests and `linattn bench serve`: start it on a free port, wait for
its announced address, stop it with SIGTERM (SIGKILL if it does not drain in time). Standard library only."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Sequence

from ..errors import LinattnError

ANNOUNCE = re.compile(r"\[linattn\] serving (\S+) at (http://\S+)")


class ServerDidNotStart(LinattnError):
    """The child server exited or stayed silent before announcing its address."""


class ServerProcess:
    """`python -m linattn serve ARGS --port 0` as a child process; `url` and `name` once it listens.

    Args:
        args: The serve flags (--model ...; --port is added).
        env: The child's whole environment (None: this process's).
        start_timeout: Seconds to wait for the announcement.
    """

    def __init__(self, args: Sequence[str], env: Optional[Dict[str, str]] = None, start_timeout: float = 120.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "linattn", "serve", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ) if env is None else env)
        self.lines: List[str] = []
        self.url: Optional[str] = None
        self.name: Optional[str] = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(start_timeout) or self.url is None:
            self.stop()
            raise ServerDidNotStart("linattn serve did not start:\n" + "".join(self.lines[-30:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = ANNOUNCE.search(line)
            if m and self.url is None:
                self.name, self.url = m.group(1), m.group(2)
                self._ready.set()
        self._ready.set()   # the process ended

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the server drains), SIGKILL after `timeout` seconds; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
