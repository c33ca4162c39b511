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

Pass-through comes first: the pump never waits for the agent's loop. It stamps each batch
with the time it was read and puts it in a ``LineBacklog``, bounded in bytes and lines; if
the loop falls that far behind, the oldest batches are dropped (their last lines kept as a
sample, their count reported) instead of the trainer being slowed.

Wake-ups are what an idle agent pays for (each ~0.1 ms of CPU on a 2-core VM): a pump
given an ``interval`` waits that long after a short read before reading again, so lines
printed meanwhile cost one wake-up, and reach the console up to ``--output-interval``
(0.5 s) later; the first line after a quiet spell passes at once, and a big read (output
flowing) or the trainer's exit (``hurry``) ends the wait. After a quiet spell (a trainer's
start, a restart, a checkpoint) the waits ramp up: ``interval / RAMP`` (62 ms), then
doubling back to the interval, so the lines that follow the first (a restart's first
step) are not held a whole interval behind it, for at most three more wake-ups per quiet
spell; steady output is read once per interval as before. The trainer never waits on it:
the pipe holds 1 MiB.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("ftagent.tee")

CHUNK = 1 << 20  # read up to the pipe's size (see grow_pipe)
MAX_LINE = 1 << 16
PIPE_SIZE = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size
F_SETPIPE_SZ = 1031
BACKLOG_BYTES = 2 << 20  # lines read but not yet handled by the loop, at most
BACKLOG_LINES = 1 << 16
SAMPLE_BYTES = 16 << 10  # of a dropped batch, its last lines up to this many bytes are kept
COALESCE_BELOW = 64 << 10  # a read this big or bigger: output is flowing, no wait
RAMP = 8  # after a quiet spell the pump's waits start at interval / RAMP and double


def grow_pipe(fd: int, size: int = PIPE_SIZE) -> int:
    """Enlarge a pipe from 64 KiB so a chatty trainer costs fewer reads, writes and loop
    wake-ups per megabyte; returns the size in force (unchanged where not allowed)."""
    try:
        return int(fcntl.fcntl(fd, F_SETPIPE_SZ, size))
    except OSError:
        return 0

# (stream name, complete lines joined by b"\n" without a final one, monotonic read time)
LinesCallback = Callable[[str, bytes, float], None]
# Where a pump writes what it read, when not to a file descriptor as is (the launcher's
# rank prefixes and log files: ``WorkerOutput``); it may block, as a slow reader would.
Writer = Callable[[bytes], None]


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until everything is written (pipes may take partial writes)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class LineSplitter:
    """Incremental split on ``\\n`` and ``\\r`` with a per-line cap, as whole blobs.

    ``feed`` returns the complete lines a chunk finishes as *one* ``\\n``-joined blob (the
    partial line carried from earlier chunks included), so the hot path makes no Python
    object per line: the parsers scan the blob, the evidence ring stores it. A line longer
    than ``max_line`` keeps its first ``max_line`` bytes; the rest up to the next terminator
    is dropped (for detection only: pass-through is unaffected).
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._partial = bytearray()
        self._overflow = False  # dropping the rest of an over-long line

    def feed(self, data: bytes) -> bytes:
        if b"\r" in data:
            data = data.replace(b"\r", b"\n")
        cut = data.rfind(b"\n")
        if cut < 0:  # no terminator in this chunk: the line goes on
            if not self._overflow:
                room = self.max_line - len(self._partial)
                self._partial += data[:room]
                self._overflow = len(data) > room
            return b""
        if self._partial or self._overflow:
            first = data.find(b"\n")
            room = max(0, self.max_line - len(self._partial))
            head = bytes(self._partial) + data[:min(first, room)] + data[first:cut]
            self._partial.clear()
        else:
            head = data[:cut]
        tail = data[cut + 1:]
        self._partial = bytearray(tail[: self.max_line])
        self._overflow = len(tail) > self.max_line
        return head

    def flush(self) -> bytes:
        line = bytes(self._partial)
        self._partial.clear()
        self._overflow = False
        return line


def lines_of(blob: bytes) -> list[bytes]:
    """The non-empty lines of a blob from :meth:`LineSplitter.feed`."""
    return [ln for ln in blob.split(b"\n") if ln]


class LastLines:
    """The last ``n`` lines of each stream as evidence, kept as the blobs they arrived in.

    One ring per stream: the two pipes are read by separate threads, so a burst of
    stdout may well be delivered *after* the stderr traceback that followed it, and a
    single ring would then evict the traceback, the best evidence a crash has. A sequence
    number keeps the merged tail in arrival order. Storing blobs keeps the hot path at one
    append per read; they are split into lines (each cut to ``max_line`` bytes) only when a
    fault asks for evidence. Memory stays bounded whatever the trainer prints: per stream,
    the newest blob plus older ones while they are needed for ``n`` lines and fit in
    ``max_bytes``.
    """

    def __init__(self, n: int, max_bytes: int = 1 << 20, max_line: int = MAX_LINE) -> None:
        self.n = max(1, n)
        self.max_bytes = max_bytes
        self.max_line = max_line
        self._rings: dict[str, deque[tuple[int, bytes, int]]] = {}  # seq, blob, line count
        self._counts: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._seq = 0

    def add(self, stream: str, blob: bytes) -> None:
        if not blob:
            return
        ring = self._rings.setdefault(stream, deque())
        k = blob.count(b"\n") + 1
        self._seq += 1
        ring.append((self._seq, blob, k))
        count = self._counts.get(stream, 0) + k
        size = self._bytes.get(stream, 0) + len(blob)
        while len(ring) > 1 and (count - ring[0][2] >= self.n or size > self.max_bytes):
            _, old, old_k = ring.popleft()
            count -= old_k
            size -= len(old)
        self._counts[stream], self._bytes[stream] = count, size

    def held(self) -> tuple[int, int]:
        """(blobs, bytes) held over all streams, for the memory bound's tests."""
        return (sum(len(r) for r in self._rings.values()), sum(self._bytes.values()))

    def tail(self, k: int, stream: str | None = None) -> list[tuple[str, bytes]]:
        """The last ``min(k, n)`` non-empty lines (of ``stream``, or of all merged in
        arrival order), oldest first, with their stream."""
        k = min(k, self.n)
        keyed: list[tuple[int, int, str, bytes]] = []
        for name, ring in self._rings.items():
            if stream is not None and name != stream:
                continue
            got = 0
            for seq, blob, _ in reversed(ring):
                lines = lines_of(blob)
                for i in range(len(lines) - 1, -1, -1):
                    if got >= k:
                        break
                    keyed.append((seq, i, name, lines[i][: self.max_line]))
                    got += 1
                if got >= k:
                    break
        keyed.sort()
        return [(name, line) for _, _, name, line in keyed[-k:]]

    def tails(self, k: int, k_stream: int, stream: str) -> tuple[list[tuple[str, bytes]],
                                                                 list[tuple[str, bytes]]]:
        """Both tails a crash's evidence asks for, in one call: the last ``k`` lines of
        all streams merged (``tail(k)``) and the last ``k_stream`` of ``stream`` alone
        (``tail(k_stream, stream)``: stderr's, where the traceback is)."""
        if not self._rings:  # nothing was printed: nothing to split
            return [], []
        return self.tail(k), self.tail(k_stream, stream)


class LineBacklog:
    """The pumps' batches on their way to the loop: FIFO, thread-safe, bounded.

    ``put`` (a pump thread) never blocks on the loop: past ``max_bytes`` or ``max_lines``
    held, the oldest batches are dropped. Of each dropped batch its last lines (up to
    ``sample_bytes``, at its read time) are kept, one sample per stream, so the freshest
    progress in what was dropped still reaches the detectors; the rest is counted in
    ``dropped_lines``. ``oldest_ts`` is the read time of the oldest batch not yet taken:
    the loop has seen everything read before it, which is what "now" means to a detector
    while the loop is behind.
    """

    def __init__(self, max_bytes: int = BACKLOG_BYTES, max_lines: int = BACKLOG_LINES,
                 sample_bytes: int = SAMPLE_BYTES, *, wake_bytes: int | None = None,
                 wake_lines: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.sample_bytes = sample_bytes
        # With wake marks, the loop is woken only when the backlog grows past one (it
        # drains on its own clock otherwise); without, whenever the backlog was empty.
        self.wake_bytes = wake_bytes
        self.wake_lines = wake_lines
        self.dropped_lines = 0  # grows in the pump threads
        self.dropped_batches = 0
        self._reported = 0
        self.peak_bytes = 0
        self._q: deque[tuple[str, bytes, float, int]] = deque()  # stream, blob, ts, lines
        self._samples: dict[str, tuple[str, bytes, float, int]] = {}
        self._bytes = 0
        self._lines = 0
        # batches and samples waiting, as of the last put or take: read without a call
        # (the loop looks before it drains, and an empty backlog costs it nothing)
        self.pending = 0
        self._lock = threading.Lock()

    def put(self, stream: str, blob: bytes, ts: float) -> bool:
        """Queue a batch; True when the loop needs a wake-up: the backlog was empty, or
        with wake marks, it has just grown past one."""
        k = blob.count(b"\n") + 1
        with self._lock:
            was_empty = not self._q and not self._samples
            below = not self._over_mark()
            self._q.append((stream, blob, ts, k))
            self._bytes += len(blob)
            self._lines += k
            while len(self._q) > 1 and (self._bytes > self.max_bytes
                                        or self._lines > self.max_lines):
                self._drop_oldest()
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            self.pending = len(self._q) + len(self._samples)
            if self.wake_bytes is None and self.wake_lines is None:
                return was_empty
            return below and self._over_mark()

    def _over_mark(self) -> bool:
        return ((self.wake_bytes is not None and self._bytes > self.wake_bytes)
                or (self.wake_lines is not None and self._lines > self.wake_lines))

    def _drop_oldest(self) -> None:
        stream, blob, ts, k = self._q.popleft()
        self._bytes -= len(blob)
        self._lines -= k
        self.dropped_batches += 1
        cut = blob.find(b"\n", max(0, len(blob) - self.sample_bytes)) + 1
        sample = blob[cut:] if len(blob) > self.sample_bytes else blob
        if len(sample) > self.sample_bytes:  # one long last line: no sample
            sample = b""
        kept = sample.count(b"\n") + 1 if sample else 0
        old = self._samples.pop(stream, None)
        if old is not None:
            self.dropped_lines += old[3]
        self.dropped_lines += k - kept
        if sample:
            self._samples[stream] = (stream, sample, ts, kept)

    def take(self, n: int) -> list[tuple[str, bytes, float]]:
        """Up to ``n`` batches, oldest first (samples of dropped ones before the rest)."""
        with self._lock:
            out = [(s, b, t) for s, b, t, _ in sorted(self._samples.values(),
                                                      key=lambda e: e[2])]
            self._samples.clear()
            while self._q and len(out) < n:
                stream, blob, ts, k = self._q.popleft()
                self._bytes -= len(blob)
                self._lines -= k
                out.append((stream, blob, ts))
            self.pending = len(self._q)
            return out

    def new_drops(self) -> int:
        """Lines dropped since the last call (for a counter the loop increments)."""
        with self._lock:
            n, self._reported = self.dropped_lines - self._reported, self.dropped_lines
            return n

    def oldest_ts(self) -> float | None:
        """Read time of the oldest batch not taken yet; None when the loop is caught up."""
        with self._lock:
            times = [e[2] for e in self._samples.values()]
            if self._q:
                times.append(self._q[0][2])
            return min(times) if times else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._q) + len(self._samples)

    def held(self) -> tuple[int, int]:
        """(bytes, lines) queued, samples aside, for the bound's tests."""
        with self._lock:
            return self._bytes, self._lines


class OutputPump(threading.Thread):
    """Copies ``src_fd`` to ``dst_fd`` until EOF and hands lines to ``on_lines``.

    ``on_lines`` is called from this thread; the agent passes a function that queues the
    batch for the event loop (a ``LineBacklog``) and never blocks. A batch is handed over
    before it is written out, stamped with its read time, so a slow reader of the agent's
    output (which slows the trainer, as it would without the agent) does not hide from the
    detectors the progress already read. If ``dst_fd`` breaks (EPIPE: nobody reads the
    agent's output any more) the pump keeps draining so the trainer never blocks on a
    full pipe because of the agent.
    """

    def __init__(self, src_fd: int, dst_fd: int | Writer, stream: str,
                 on_lines: LinesCallback, max_line: int = MAX_LINE,
                 interval: float = 0.0) -> None:
        super().__init__(name=f"ftagent-tee-{stream}", daemon=True)
        self.src_fd = src_fd
        self.write: Writer = dst_fd if callable(dst_fd) else functools.partial(write_all, dst_fd)
        self.stream = stream
        self.on_lines = on_lines
        self.splitter = LineSplitter(max_line)
        self.bytes = 0
        self.eof = threading.Event()
        # interval > 0: after a read shorter than COALESCE_BELOW, wait that long (or until
        # ``hurry``) before reading again, so a trainer printing every 0.1 s costs one
        # wake-up of this thread per interval instead of one per line (each ~0.1 ms of CPU
        # on a 2-core VM; bench/restart.py --overhead); after a quiet spell the waits
        # ramp up from interval / RAMP (module docstring). Only for a pipe that holds far
        # more than an interval of output (grow_pipe): the trainer never waits on it.
        self.interval = interval
        self.hurry = threading.Event()  # the trainer exited: read on to EOF at once
        self._dst_ok = True

    def run(self) -> None:
        first = self.interval / RAMP
        wait = first  # the trainer's start is a quiet spell too
        try:
            while True:
                began = time.monotonic()
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
                if now - began >= first:  # the read waited for output: a quiet spell
                    wait = first
                self.bytes += len(data)
                blob = self.splitter.feed(data)
                if blob:
                    self._deliver(blob, now)
                if self._dst_ok:
                    try:
                        self.write(data)
                    except OSError as e:
                        self._dst_ok = False
                        log.warning("agent %s is not writable (%s); still draining the "
                                    "trainer's output", self.stream, e)
                if self.interval > 0 and len(data) < COALESCE_BELOW:
                    self.hurry.wait(wait)
                    wait = min(self.interval, 2 * wait)
            rest = self.splitter.flush()
            if rest:
                self._deliver(rest, time.monotonic())
            flush = getattr(self.write, "flush", None)  # a WorkerOutput's held partial line
            if flush is not None and self._dst_ok:
                try:
                    flush()
                except OSError as e:
                    log.warning("agent %s is not writable (%s)", self.stream, e)
        finally:
            with contextlib.suppress(OSError):
                os.close(self.src_fd)
            self.eof.set()

    def _deliver(self, blob: bytes, now: float) -> None:
        try:
            self.on_lines(self.stream, blob, now)
        except Exception:  # e.g. the loop is closed during shutdown
            log.debug("dropping %d bytes of lines", len(blob), exc_info=True)


class PrefixedLines:
    """A ``Writer`` that starts every line with ``prefix`` (torchrun's ``[default0]:``)
    on its way to ``fd``, and writes only whole lines: several workers share one console,
    so a partial line written as it comes would let another worker's line land in its
    middle (``--tee 3`` did, in 2 of 4 runs). The partial last line waits for its end;
    complete lines go out in one write under ``lock``, which every worker's writer to the
    same console shares. A line longer than ``max_line`` without a newline is written as
    it is (a progress bar must not grow memory), and ``flush`` writes what is left when
    the stream ends, with the newline it lacked (prefixed lines are a line-by-line view;
    the log files of --tee keep the bytes as they came)."""

    def __init__(self, fd: int, prefix: bytes, lock: threading.Lock | None = None,
                 max_line: int = MAX_LINE) -> None:
        self.fd = fd
        self.prefix = prefix
        self.lock = lock if lock is not None else threading.Lock()
        self.max_line = max_line
        self._partial = b""
        self._mid_line = False  # an over-long line was written before its end

    def __call__(self, data: bytes) -> None:
        if not data:
            return
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        if len(data) - cut > self.max_line:  # an over-long line: out it goes as it is
            cut = len(data)
        self._partial = data[cut:]
        if cut:
            self._write(data[:cut])

    def flush(self) -> None:
        """The last partial line (the trainer exited without a newline), prefixed and
        ended with a newline: the console is shared, and another worker's next line must
        not continue it."""
        if self._partial or self._mid_line:
            rest, self._partial = self._partial, b""
            self._write(rest + b"\n")

    def _write(self, chunk: bytes) -> None:
        out = chunk.replace(b"\n", b"\n" + self.prefix)
        if not self._mid_line:
            out = self.prefix + out
        self._mid_line = not chunk.endswith(b"\n")
        if not self._mid_line:  # the prefix of a line not begun yet waits for its bytes
            out = out[:len(out) - len(self.prefix)]
        with self.lock:
            write_all(self.fd, out)


class WorkerOutput:
    """One launcher worker's stream: to the console (as is, or prefixed), to a log file,
    both (``--tee``), or the file alone (``--redirects``); closed with the attempt."""

    def __init__(self, console: int | None, prefix: bytes, path: str | None,
                 console_lock: threading.Lock | None = None) -> None:
        """``console_lock``: shared by every worker's output to the same console, so that
        prefixed lines go out whole."""
        self.console: Writer | None = None
        self._prefixed: PrefixedLines | None = None
        if console is not None and prefix:
            self.console = self._prefixed = PrefixedLines(console, prefix, console_lock)
        elif console is not None:
            self.console = functools.partial(write_all, console)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) \
            if path else -1

    def __call__(self, data: bytes) -> None:
        if self.fd >= 0:
            try:
                write_all(self.fd, data)
            except OSError as e:  # a full disk must not stop the console copy
                log.warning("writing a worker's log file failed (%s); console only", e)
                self.close()
        if self.console is not None:
            self.console(data)

    def flush(self) -> None:
        """The stream ended (the pump's EOF): a partial last line goes out."""
        if self._prefixed is not None:
            self._prefixed.flush()

    def close(self) -> None:
        self.flush()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def trainer_pumps(out_fd: int, err_fd: int, stdout_fd: int | Writer, stderr_fd: int | Writer,
                  on_lines: LinesCallback, max_line: int = MAX_LINE,
                  output_interval: float = 0.0) -> list[OutputPump]:
    """A trainer's two pumps (not started), its pipes grown first. Coalesced reads
    (``output_interval``: the agent passes --output-interval) only where both pipes hold
    far more than an interval's output of any sane trainer (PIPE_SIZE, 1 MiB: 2 MB/s
    before a write could wait)."""
    grown = min(grow_pipe(out_fd), grow_pipe(err_fd))
    interval = output_interval if grown >= PIPE_SIZE else 0.0
    return [OutputPump(out_fd, stdout_fd, "stdout", on_lines, max_line, interval),
            OutputPump(err_fd, stderr_fd, "stderr", on_lines, max_line, interval)]
