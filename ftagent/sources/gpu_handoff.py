"""Thread -> event loop hand-off of GPU events, merging repeats while the loop is busy.

The NVML event thread and the kernel-log thread ``put`` events; the first one into an
empty hand-off wakes the loop at once (``call_soon_threadsafe``: the latency of one
event is one loop wake-up), and while the loop has not drained yet, later events with the
same (GPU, kind, Xid, source) only raise that pending event's ``count``. A flood of a
million identical lines reaches the loop as a few events whose counts add up exactly,
and memory is bounded by the distinct keys (``cap``; beyond it events are dropped and
counted in ``dropped``, which takes thousands of distinct Xids in one loop turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable

from ftagent.model import GpuEvent

Key = tuple[int, str, int | None, str]


class Handoff:
    def __init__(self, loop: asyncio.AbstractEventLoop, emit: Callable[[GpuEvent], None],
                 cap: int = 1024) -> None:
        self.loop = loop
        self.emit = emit
        self.cap = cap
        self.dropped = 0
        self.wakeups = 0
        self._lock = threading.Lock()
        self._pending: dict[Key, list[object]] = {}  # key -> [first event, count]

    def put(self, ev: GpuEvent) -> None:
        """From any thread."""
        key = (ev.gpu, ev.kind, ev.xid, ev.source)
        with self._lock:
            slot = self._pending.get(key)
            if slot is not None:
                slot[1] = int(slot[1]) + ev.count  # type: ignore[call-overload]
                return
            if len(self._pending) >= self.cap:
                self.dropped += ev.count
                return
            wake = not self._pending
            self._pending[key] = [ev, ev.count]
        if wake:
            self.wakeups += 1
            with contextlib.suppress(RuntimeError):  # a closed loop: the agent is exiting
                self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, {}
        for first, count in batch.values():
            assert isinstance(first, GpuEvent) and isinstance(count, int)
            self.emit(first if count == first.count else dataclasses.replace(first, count=count))
