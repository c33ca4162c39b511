"""The trainer's output on its way from the pump threads to a worker's loop.

The output pumps (supervisor.py: one thread per pipe) read the trainer's lines and write
them through, byte for byte, before anything else; what they hand the agent goes through
a :class:`LineFeed`: a bounded backlog (tee.py ``LineBacklog``) drained on the loop into the
worker's ``on_lines``. The feed also says what "now" the detectors may use while output
read earlier still waits (:meth:`LineFeed.now`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ftagent.agent.tee import BACKLOG_BYTES, BACKLOG_LINES, LineBacklog

log = logging.getLogger("ftagent.agent")

DRAIN_BATCHES = 16  # output batches handled per loop callback before timers get a turn
ALL = 1 << 30  # a drain with no limit (the trainer's exit)


class LineFeed:
    """One worker's output feed: ``on_lines(stream, blob, ts)`` gets every batch on the
    loop, in order; ``count_skipped(reason, lines)`` hears of batches dropped."""

    def __init__(self, on_lines: Callable[[str, bytes, float], None],
                 count_skipped: Callable[[str, int], None],
                 wake: Callable[[], None] | None = None) -> None:
        """``wake``: the ticker's wake-up (its event's ``set``), called on the loop when
        a batch arrives while the ticker sleeps past the grid (``quiet``)."""
        self.on_lines = on_lines
        self.count_skipped = count_skipped
        self.wake = wake
        # the ticker found nothing waiting and sleeps until its detectors' due time, not
        # to the grid: the next batch wakes it (set on the loop, read by the pumps; a
        # pump that reads it just as it is set wakes the ticker once more, no harm);
        # quiet from the start: no trainer, no output yet
        self.quiet = wake is not None
        # the running trainer's output on its way (read-only outside: ``pending`` says
        # whether anything waits)
        self.backlog: LineBacklog | None = None

    def pumps_callback(self) -> Callable[[str, bytes, float], None]:
        """The pumps' callback for a new trainer: queue the batch in a bounded backlog,
        never block.

        The loop is not woken per batch: the worker's ticker drains the backlog every
        tick (:meth:`drain_some`), on the grid every worker shares, so N workers' output
        costs one loop wake-up per tick instead of one self-pipe write and read per line
        (the launcher's own CPU against torchrun's: bench/restart.py --overhead). A
        ticker that found nothing waiting sleeps past the grid (``quiet``): the first
        batch after that wakes it, once, and it is back on the grid. What
        that delays is only the *handling*: each batch keeps its read time, the
        detectors' "now" stays at the oldest batch not yet handled (:meth:`now`), and a
        trainer's exit drains everything before its crash is judged. A backlog growing
        past an eighth of its bounds wakes the loop at once; a drain handles at most
        ``DRAIN_BATCHES`` and yields (timers, the trainer's exit, signals get their turn);
        past the backlog's bounds the oldest batches are dropped, never the trainer slowed.
        """
        loop = asyncio.get_running_loop()
        backlog = self.backlog = LineBacklog(wake_bytes=BACKLOG_BYTES // 8,
                                              wake_lines=BACKLOG_LINES // 8)

        def hop(stream: str, blob: bytes, ts: float) -> None:
            if backlog.put(stream, blob, ts):
                loop.call_soon_threadsafe(self._drain, backlog, DRAIN_BATCHES)
            elif self.quiet and self.wake is not None:  # the first batch after a quiet spell
                self.quiet = False
                loop.call_soon_threadsafe(self.wake)

        return hop

    def drain_some(self) -> None:
        """The ticker's turn: up to ``DRAIN_BATCHES`` waiting batches, the rest after."""
        if self.backlog is not None and self.backlog.pending:
            self._drain(self.backlog, DRAIN_BATCHES)

    def tick(self, now: float | None = None) -> float:
        """The ticker's turn (``drain_some``), then the detectors' "now" (``now``): one
        call per tick; an empty backlog is looked at, not called."""
        self.drain_some()
        return self.now(now)

    def drain_all(self) -> None:
        """Everything the pumps have queued, handled now (the trainer's exit)."""
        if self.backlog is not None and self.backlog.pending:
            self._drain(self.backlog, ALL)

    def now(self, now: float | None = None) -> float:
        """The detectors' "now": the clock, or while output read earlier still waits in the
        backlog, that output's read time. Observations carry the time their line was read;
        a loop that is behind must not call a hang on data it has not looked at yet."""
        now = time.monotonic() if now is None else now
        b = self.backlog
        oldest = b.oldest_ts() if b is not None and b.pending else None
        return now if oldest is None else min(now, oldest)

    def _drain(self, backlog: LineBacklog, n: int) -> None:
        """Hand up to ``n`` queued batches to ``on_lines``; reschedule if more wait."""
        for batch in backlog.take(n):
            self.on_lines(*batch)
        dropped = backlog.new_drops() if backlog.dropped_lines else 0
        if dropped:
            self.count_skipped("backlog", dropped)
            if dropped == backlog.dropped_lines:  # the first drop of this trainer
                log.warning("the agent's loop fell behind the trainer's output: the oldest "
                            "lines go unparsed (ftagent_log_lines_skipped_total)")
        if n < ALL and backlog.pending:
            asyncio.get_running_loop().call_soon(self._drain, backlog, n)
