"""Byte-exact pass-through of the trainer's output, with lines split off for detectors.

One thread per stream does blocking ``read`` from the trainer's pipe and blocking
``write`` to the agent's own stdout/stderr. Why a thread and not the event loop: a slow
reader of the agent's output (a log shipper, a full pipe) must slow the *trainer* exactly
as it would without the agent (back-pressure), never stall the asyncio loop that detects
hangs; and setting O_NONBLOCK on an inherited stdout would change it for every other
process sharing that file description.

What is written out is the bytes as read: partial lines, ``\\r`` progress bars, invalid
UTF-8 and a 10 MB line without a newline pass through unchanged. For detectors, the same
bytes are split on ``\\n`` *and* ``\\r`` (a tqdm redraw is a line to a parser), and each
line is capped at ``max_line`` bytes so memory stays bounded whatever the trainer prints.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("ftagent.tee")

CHUNK = 1 << 16
MAX_LINE = 1 << 16

# (stream name, complete lines without terminators, monotonic time of the read)
LinesCallback = Callable[[str, list[bytes], float], None]


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until everything is written (pipes may take partial writes)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class LineSplitter:
    """Incremental split on ``\\n`` and ``\\r`` with a per-line cap.

    A line longer than ``max_line`` keeps its first ``max_line`` bytes; the rest up to the
    next terminator is dropped (for detection only: pass-through is unaffected).
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._partial = bytearray()
        self._overflow = False  # dropping the rest of an over-long line

    def feed(self, data: bytes) -> list[bytes]:
        # Every step is a C-level bytes/list operation: this runs for every byte the
        # trainer prints, and a per-line Python loop would cost more than the parsers.
        if b"\r" in data:
            data = data.replace(b"\r", b"\n")
        parts = data.split(b"\n")
        tail = parts.pop()  # bytes after the last terminator (maybe b"")
        if not parts:  # no terminator in this chunk: the line goes on
            if not self._overflow:
                room = self.max_line - len(self._partial)
                self._partial += tail[:room]
                self._overflow = len(tail) > room
            return []
        if self._partial or self._overflow:
            room = max(0, self.max_line - len(self._partial))
            parts[0] = bytes(self._partial + parts[0][:room])
            self._partial.clear()
        if max(map(len, parts)) > self.max_line:
            parts = [p[: self.max_line] for p in parts]
        if b"" in parts:
            parts = [p for p in parts if p]
        self._partial = bytearray(tail[: self.max_line])
        self._overflow = len(tail) > self.max_line
        return parts

    def flush(self) -> list[bytes]:
        line = bytes(self._partial)
        self._partial.clear()
        self._overflow = False
        return [line] if line else []


class LastLines:
    """The last ``n`` lines of output as evidence, kept as the batches they arrived in.

    Storing batches (not a tuple per line) keeps the hot path at one append per read;
    memory stays bounded: at most ``2n`` lines of at most ``max_line`` bytes each.
    """

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self._batches: deque[tuple[str, list[bytes]]] = deque()
        self._count = 0

    def add(self, stream: str, lines: list[bytes]) -> None:
        if len(lines) > self.n:
            lines = lines[-self.n:]
        self._batches.append((stream, lines))
        self._count += len(lines)
        while self._batches and self._count - len(self._batches[0][1]) >= self.n:
            self._count -= len(self._batches.popleft()[1])

    def tail(self, k: int) -> list[tuple[str, bytes]]:
        """The last ``min(k, n)`` lines, oldest first, with their stream."""
        k = min(k, self.n)
        out: list[tuple[str, bytes]] = []
        for stream, lines in reversed(self._batches):
            for line in reversed(lines):
                if len(out) >= k:
                    return out[::-1]
                out.append((stream, line))
        return out[::-1]


class OutputPump(threading.Thread):
    """Copies ``src_fd`` to ``dst_fd`` until EOF and hands lines to ``on_lines``.

    ``on_lines`` is called from this thread; the agent passes a function that hops to the
    event loop (``loop.call_soon_threadsafe``). If ``dst_fd`` breaks (EPIPE: nobody reads
    the agent's output any more) the pump keeps draining so the trainer never blocks on a
    full pipe because of the agent.
    """

    def __init__(self, src_fd: int, dst_fd: int, stream: str, on_lines: LinesCallback,
                 max_line: int = MAX_LINE) -> None:
        super().__init__(name=f"ftagent-tee-{stream}", daemon=True)
        self.src_fd = src_fd
        self.dst_fd = dst_fd
        self.stream = stream
        self.on_lines = on_lines
        self.splitter = LineSplitter(max_line)
        self.bytes = 0
        self.eof = threading.Event()
        self._dst_ok = True

    def run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self.src_fd, CHUNK)
                except OSError as e:
                    if e.errno == errno.EINTR:
                        continue
                    log.warning("reading trainer %s failed: %s", self.stream, e)
                    break
                if not data:
                    break
                now = time.monotonic()
                self.bytes += len(data)
                if self._dst_ok:
                    try:
                        write_all(self.dst_fd, data)
                    except OSError as e:
                        self._dst_ok = False
                        log.warning("agent %s is not writable (%s); still draining the "
                                    "trainer's output", self.stream, e)
                lines = self.splitter.feed(data)
                if lines:
                    self._deliver(lines, now)
            rest = self.splitter.flush()
            if rest:
                self._deliver(rest, time.monotonic())
        finally:
            with contextlib.suppress(OSError):
                os.close(self.src_fd)
            self.eof.set()

    def _deliver(self, lines: list[bytes], now: float) -> None:
        try:
            self.on_lines(self.stream, lines, now)
        except Exception:  # e.g. the loop is closed during shutdown
            log.debug("dropping %d lines", len(lines), exc_info=True)
