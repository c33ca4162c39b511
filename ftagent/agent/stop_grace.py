"""The grace after a stop signal: the trainer's while it handles the signal, no longer.

A stop (a restart in place, or the pod going) sends the trainer SIGTERM and SIGKILLs what
is left ``--stop-timeout`` later. A trainer without a handler dies of the SIGTERM at once.
One with a handler (an emergency save, examples/train.py's stop at the next step) asked
for the grace and gets all of it. But most of a torch trainer's stop was neither: a rank
blocked in a collective when the signal came leaves it by gloo's error, its handler runs,
its code ends, and then CPython's finalization garbage-collects DDP, the process group and
torch's modules: 1-4 s on an idle core, 12-16 s per restart on the loaded benchmark
machine (docs/benchmarks.md), all of it after the trainer's own code was done.

CPython uninstalls its signal handlers when finalization begins (``_PySignal_Fini``
restores SIG_DFL for every Python-level handler), so from outside the moment shows in
``/proc/PID/status``: the signal's bit leaves ``SigCgt``. From then on a process ignores
nothing and handles nothing, so :func:`wait_stopped` delivers the stop signal again, once:
its default action ends the process as it would have ended one that never had a handler.
A handler that is still installed keeps the whole grace; a process that ignores the
signal (``SigIgn``) waits for the deadline's SIGKILL as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

CAUGHT, IGNORED, DEFAULT = "caught", "ignored", "default"
POLL_SECONDS = 0.05


def disposition(status: str, sig: int) -> str | None:
    """How a process treats ``sig``, from the text of its ``/proc/PID/status``:
    ``caught`` (a handler), ``ignored`` or ``default``; None if the masks are absent."""
    masks: dict[str, int] = {}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigCgt", "SigIgn"):
            try:
                masks[name] = int(value.strip(), 16)
            except ValueError:
                return None
    if len(masks) != 2 or not 0 < sig < 65:
        return None
    bit = 1 << (sig - 1)
    if masks["SigCgt"] & bit:
        return CAUGHT
    return IGNORED if masks["SigIgn"] & bit else DEFAULT


def read_disposition(pid: int, sig: int) -> str | None:
    """:func:`disposition` of a live process; None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            return disposition(f.read(4096), sig)
    except OSError:
        return None


async def wait_stopped(exited: asyncio.Future[Any], pids: Callable[[], Iterable[int]],
                       sig: int, deadline: float, *, poll: float = POLL_SECONDS,
                       clock: Callable[[], float] = time.monotonic,
                       read: Callable[[int, int], str | None] = read_disposition,
                       send: Callable[[int, int], None] = os.kill,
                       first: Iterable[int] | None = None) -> list[int]:
    """Wait until ``exited`` is done or ``deadline``; meanwhile send ``sig`` once more to
    each of ``pids()`` whose handler for it is gone. Returns the pids signalled again.
    ``first``: the pids the caller has just listed (the tree it signalled), looked at
    first instead of listing them again."""
    again: list[int] = []
    listed = first
    while not exited.done() and clock() < deadline:
        now_pids, listed = (pids() if listed is None else listed), None
        for pid in now_pids:
            if pid not in again and read(pid, sig) == DEFAULT:
                again.append(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    send(pid, sig)
        await asyncio.wait([exited], timeout=min(poll, max(0.0, deadline - clock())))
    return again
