"""Whatever happens to the test process, the labs it made are taken down.

pytest's finalizers cover a failing test and Ctrl-C (KeyboardInterrupt unwinds through
them); ``atexit`` covers an exit that skips them; SIGTERM and SIGHUP (a CI runner cancelling
the job, a closed terminal) would kill the process without either, so they close the labs
first and then die of the signal as before. What survives even this (SIGKILL) is removed by
the next lab's ``net.sweep()``: the names carry the pid, and that pid is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from typing import Any, Protocol


class Closable(Protocol):
    def close(self) -> None: ...


_open: list[Closable] = []  # the labs of this process (tests only: one per module)
_lock = threading.Lock()
_installed = False


def register(lab: Closable) -> None:
    global _installed
    with _lock:
        _open.append(lab)
        if not _installed:
            _installed = True
            atexit.register(close_all)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                _chain(sig)


def unregister(lab: Closable) -> None:
    with _lock:
        if lab in _open:
            _open.remove(lab)


def close_all() -> None:
    with _lock:
        labs = list(_open)
        _open.clear()
    for lab in reversed(labs):
        with contextlib.suppress(Exception):  # close the others whatever one does
            lab.close()


def _chain(sig: int) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(sig)

    def handler(signum: int, frame: Any) -> None:
        close_all()
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(sig, handler)
