"""Step progress from the trainer's own output lines, with no change to its code.

The agent's output tee hands every line (raw bytes, no terminator; tqdm redraws split at
``\\r`` arrive as lines too) to ``LogProgress.parse_lines``. Nearly all of them are not
progress (NCCL chatter, warnings, tracebacks), and a busy trainer prints a lot, so the cost
is in the lines that are *not* progress. They are rejected before any UTF-8 decoding or
regular expression: a batch of lines is joined once, decoded as latin-1 (a copy, never an
error), and searched with ``str.find`` for a handful of needles ("step", "iter", "loss",
"%|", ...); only the lines that contain one are decoded and parsed (``logformats``).

Needles of lines printed only at start-up (Megatron's argument dump) are dropped after
the first step. Once a format has produced a few steps, the needles narrow to that
format's family (a Megatron job needs "iter" and "checkpoint" only), which makes a
non-progress line about three times cheaper. If no step is seen for ``UNLOCK_AFTER``
seconds (of the ``ts`` the caller passes), every needle is looked for again, so a trainer
that changes what it prints is followed within seconds. ``reset()`` (a new trainer
attempt) forgets the format.

A line longer than ``MAX_LINE`` bytes, binary junk, invalid UTF-8 or a parser error is
skipped and counted, never raised; a count with more than ``MAX_DIGITS`` digits or above
``MAX_STEP`` (``wire/limits.py``) makes the line no step, silently. A step that repeats (a
tqdm redraw) or goes back is returned as it is: the hang detector decides what counts as
new progress.

Pass-through comes first, so parsing has a budget (``ParseBudget``): a share of the loop's
time, refilled as time passes. A batch the budget cannot pay for in full is parsed from its
end (its freshest lines, what the hang detector needs) as far as the budget goes; the
lines before are skipped unparsed and counted (``lines_skipped["budget"]``, the metric
``ftagent_log_lines_skipped_total``). Ordinary trainers never reach it; a trainer printing
step-like lines at hundreds of MB/s gets its progress sampled instead of slowing down.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence

from ftagent.config import ConfigError
from ftagent.model import PhaseMarker, PhaseTiming, Progress, Resumed
from ftagent.sources.logformats import (
    ALWAYS_NEEDLES,
    ANSI_RE,
    FORMATS,
    Claimed,
    LogFormat,
    OutOfBounds,
    ParseState,
    count_of,
    number,
)
from ftagent.wire.limits import MAX_STEP

log = logging.getLogger("ftagent.progress")

MAX_LINE = 16 * 1024  # no trainer prints a progress line longer; longer lines are skipped
LOCK_AFTER = 3  # steps from one format before the needles narrow to its family
UNLOCK_AFTER = 5.0  # seconds without a step before every needle is looked for again

# what a trainer's log line can say
LogObservation = Progress | PhaseMarker | PhaseTiming | Resumed

USER_GROUPS = ("step", "loss", "samples_per_second", "tokens_per_second")

PARSE_SHARE = 0.15  # of wall time the parser may spend, sustained, once its burst is spent
PARSE_BURST = 0.2  # seconds of parsing in hand: a burst of output is parsed in full
PARSE_SLICE = 0.005  # seconds one batch may take: the loop (and the pumps, which share
# the GIL with it) never wait longer on one batch's parse
COST_PER_BYTE = 50e-9  # first guess of parse seconds per byte; learned from each batch
MIN_LEARN = 4096  # bytes a batch needs before its cost per byte updates the estimate


class ParseBudget:
    """A token bucket of parsing seconds: ``share`` of every second elapsed on ``clock``,
    at most ``burst`` in hand; ``spend`` may overdraw (one batch's cost), later batches
    then wait for the refill."""

    def __init__(self, share: float = PARSE_SHARE, burst: float = PARSE_BURST,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.share = share
        self.burst = burst
        self.clock = clock
        self._tokens = burst
        self._at = clock()

    def available(self) -> float:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.share)
        self._at = now
        return self._tokens

    def spend(self, seconds: float) -> None:
        self._tokens -= max(0.0, seconds)

_RUNNING_NEEDLES: tuple[str, ...] = tuple(dict.fromkeys(
    ALWAYS_NEEDLES + tuple(n for f in FORMATS for n in f.needles)))
_STARTUP_NEEDLES: tuple[str, ...] = tuple(dict.fromkeys(
    _RUNNING_NEEDLES + tuple(n for f in FORMATS for n in f.startup)))
MARKERS_FORMAT = "megatron"  # parses the checkpoint markers, whatever the format
_DISPATCH: tuple[tuple[LogFormat, tuple[str, ...]], ...] = tuple(
    (f, f.needles + f.startup) for f in FORMATS)


class UserPattern:
    """One ``--progress-regex``: named groups step (required), loss, samples_per_second,
    tokens_per_second. Matched against the raw bytes when the pattern allows it (no
    decoding for lines that do not match), else against the decoded line."""

    def __init__(self, pattern: str) -> None:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"--progress-regex {pattern!r}: {e}") from None
        if "step" not in rx.groupindex:
            raise ConfigError(f"--progress-regex {pattern!r}: needs a named group "
                              r"(?P<step>\d+)")
        self.text_rx = rx
        self.bytes_rx: re.Pattern[bytes] | None
        try:
            self.bytes_rx = re.compile(pattern.encode("utf-8"))
        except (re.error, UnicodeEncodeError):
            self.bytes_rx = None

    def match(self, raw: bytes, ts: float) -> Progress | None:
        if self.bytes_rx is not None:
            bm = self.bytes_rx.search(raw)
            if bm is None:
                return None
            groups = {k: v.decode("utf-8", "replace") for k, v in bm.groupdict().items()
                      if v is not None}
        else:
            tm = self.text_rx.search(raw.decode("utf-8", "replace"))
            if tm is None:
                return None
            groups = {k: v for k, v in tm.groupdict().items() if v is not None}
        try:
            step = count_of(number(groups.get("step")))
        except OutOfBounds:
            return None
        if step is None:
            return None
        return Progress(step=step, loss=number(groups.get("loss")),
                        samples_per_second=number(groups.get("samples_per_second")),
                        tokens_per_second=number(groups.get("tokens_per_second")),
                        source="user", ts=ts)


class LogProgress:
    """Turns trainer output lines into ``Progress`` and ``PhaseMarker`` observations.

    One instance per trainer (its stdout and stderr together: HF Trainer prints its
    step on stderr and its loss on stdout). Not thread-safe; call from one task.
    """

    def __init__(self, user_regexes: Sequence[str] = (), budget: ParseBudget | None = None,
                 *, unlimited: bool = False) -> None:
        """``budget``: a fresh ``ParseBudget()`` unless given; ``unlimited`` parses every
        line whatever it costs (offline use, tests that count every observation)."""
        self.user = tuple(UserPattern(p) for p in user_regexes)
        self.budget = None if unlimited else (budget or ParseBudget())
        self.skipped = 0  # lines too long or that made a parser fail
        # lines not parsed, by reason: "budget", "too_long", "error"
        self.lines_skipped: dict[str, int] = {}
        self.on_skip: Callable[[str, int], None] | None = None  # (reason, lines): metrics
        self._cost = COST_PER_BYTE
        self.reset()

    def reset(self) -> None:
        """A new trainer attempt: forget epochs, bars and the format seen."""
        self.state = ParseState()
        self._steps = 0
        self._families: set[str] = set()
        self._locked: tuple[str, ...] | None = None
        self._locked_dispatch: tuple[tuple[LogFormat, tuple[str, ...]], ...] = _DISPATCH
        self._last_step_ts = float("-inf")

    @property
    def families(self) -> frozenset[str]:
        """The formats this trainer was seen to print (for events and debugging)."""
        return frozenset(self._families)

    def needles(self, ts: float) -> tuple[str, ...]:
        """The substrings a line must contain to be parsed at all, at time ``ts``."""
        if self._is_locked(ts):
            return self._locked  # type: ignore[return-value]
        return _RUNNING_NEEDLES if self._steps else _STARTUP_NEEDLES

    def _is_locked(self, ts: float) -> bool:
        return self._locked is not None and ts - self._last_step_ts <= UNLOCK_AFTER

    def _dispatch(self, ts: float) -> tuple[tuple[LogFormat, tuple[str, ...]], ...]:
        """The parsers to try, in order: once the format is known, its family's (and the
        checkpoint markers') first, so a step line stops at the first parser instead of
        running every other format's regex; the rest still follow for mixed logs."""
        return self._locked_dispatch if self._is_locked(ts) else _DISPATCH

    def parse(self, line: bytes, ts: float) -> LogObservation | None:
        """One line (bytes, no terminator) → at most one observation."""
        for u in self.user:
            if len(line) <= MAX_LINE:
                try:
                    p = u.match(line, ts)
                except Exception:  # noqa: BLE001 - a hostile line must never break the agent
                    self._skip(line, "user pattern failed")
                    continue
                if p is not None:
                    self._seen("user", p)
                    return p
        text = line.decode("latin-1")
        for n in self.needles(ts):
            if n in text:
                return self._parse_candidate(line, ts)
        return None

    def parse_lines(self, lines: Sequence[bytes], ts: float) -> list[LogObservation]:
        """A batch of lines that arrived together → their observations, in order."""
        return self.parse_blob(b"\n".join(lines), ts)

    def parse_blob(self, buf: bytes, ts: float) -> list[LogObservation]:
        """Lines joined by ``\\n`` (as the output tee delivers them) → observations, in
        order; with a budget, of the batch's last lines only when it cannot pay for all."""
        if self.budget is None or not buf:
            return self._parse_blob(buf, ts)
        avail = min(self.budget.available(), PARSE_SLICE)
        start = 0
        if avail < self._cost * len(buf):  # parse the freshest lines the budget pays for
            # ... and always the freshest line itself (at most MAX_LINE): the last thing a
            # trainer printed before going quiet must be seen, or its last step would be
            # missed for good and read as a hang (seen under a CPU hog)
            keep = int(avail / self._cost) if avail > 0 else 0
            last = buf.rfind(b"\n") + 1
            start = last if keep <= 0 else max(0, min(last, buf.find(b"\n", len(buf) - keep)
                                                      + 1))
            self._count_skip("budget", buf.count(b"\n", 0, start))
            buf = buf[start:]
        t0 = self.budget.clock()
        out = self._parse_blob(buf, ts)
        spent = self.budget.clock() - t0
        self.budget.spend(spent)
        if len(buf) >= MIN_LEARN:
            self._cost = max(1e-10, 0.5 * self._cost + 0.5 * spent / len(buf))
        return out

    def _parse_blob(self, buf: bytes, ts: float) -> list[LogObservation]:
        """Every line of ``buf``. Scanning for needles costs nothing per line without one."""
        if self.user:
            return [o for o in (self.parse(line, ts) for line in buf.split(b"\n") if line)
                    if o is not None]
        if not buf:
            return []
        text = buf.decode("latin-1")  # 1 byte → 1 char: offsets in text are offsets in buf
        find, rfind = text.find, text.rfind
        starts: set[int] = set()
        for needle in self.needles(ts):
            i = find(needle)
            while i >= 0:
                starts.add(rfind("\n", 0, i) + 1)
                end = find("\n", i)
                if end < 0:
                    break
                i = find(needle, end)
        out: list[LogObservation] = []
        for s in sorted(starts):
            e = buf.find(b"\n", s)
            obs = self._parse_candidate(buf[s:] if e < 0 else buf[s:e], ts)
            if obs is not None:
                out.append(obs)
        return out

    # ------------------------------------------------------------------ internals

    def _parse_candidate(self, raw: bytes, ts: float) -> LogObservation | None:
        if len(raw) > MAX_LINE:
            self._skip(raw, "line too long")
            return None
        try:
            text = raw.decode("utf-8", "replace")
            if "\x1b" in text:
                text = ANSI_RE.sub("", text)
            text = text.strip()
            for fmt, needles in self._dispatch(ts):
                for n in needles:
                    if n in text:
                        try:
                            obs = fmt.parse(text, ts, self.state)
                        except OutOfBounds:  # 4,400 digits, step 10**30: not a step
                            obs = None
                        if isinstance(obs, Claimed):
                            return None
                        if obs is not None and in_bounds(obs):
                            self._seen(fmt.family, obs)
                            return obs
                        break
        except Exception:  # noqa: BLE001 - a hostile line must never break the agent
            self._skip(raw, "parser failed")
        return None

    def _seen(self, family: str, obs: LogObservation) -> None:
        if not isinstance(obs, Progress):
            return
        self._last_step_ts = obs.ts
        self._steps += 1
        if family not in self._families:
            self._families.add(family)
            self._locked = None
        if self._locked is None and self._steps >= LOCK_AFTER:
            fams = self._families
            self._locked = tuple(dict.fromkeys(ALWAYS_NEEDLES + tuple(
                n for f in FORMATS if f.family in fams for n in f.needles)))
            first = tuple((f, n) for f, n in _DISPATCH
                          if f.family in fams or f.name == MARKERS_FORMAT)
            self._locked_dispatch = first + tuple(d for d in _DISPATCH if d not in first)

    def _count_skip(self, reason: str, lines: int) -> None:
        if lines <= 0:
            return
        self.lines_skipped[reason] = self.lines_skipped.get(reason, 0) + lines
        if self.on_skip is not None:
            self.on_skip(reason, lines)

    def _skip(self, raw: bytes, why: str) -> None:
        self._count_skip("too_long" if why == "line too long" else "error", 1)
        self.skipped += 1
        if self.skipped == 1 or self.skipped % 10_000 == 0:
            log.warning("skipped an output line (%s, %d bytes; %d skipped so far)",
                        why, len(raw), self.skipped, exc_info=why == "parser failed")


def in_bounds(obs: LogObservation) -> bool:
    """A step and total a float, JSON and the arbiter carry exactly (``MAX_STEP``); an
    epoch-based global step can exceed it even when each of its counts is bounded."""
    if isinstance(obs, Resumed):
        return 0 <= obs.step <= MAX_STEP
    if not isinstance(obs, Progress):
        return True
    return 0 <= obs.step <= MAX_STEP and (
        obs.total_steps is None or 0 <= obs.total_steps <= MAX_STEP)
