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
skipped and counted, never raised. A step that repeats (a tqdm redraw) or goes back is
returned as it is: the hang detector decides what counts as new progress.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from ftagent.config import ConfigError
from ftagent.model import PhaseMarker, Progress
from ftagent.sources.logformats import (
    ALWAYS_NEEDLES,
    ANSI_RE,
    FORMATS,
    Claimed,
    LogFormat,
    ParseState,
    number,
)

log = logging.getLogger("ftagent.progress")

MAX_LINE = 16 * 1024  # no trainer prints a progress line longer; longer lines are skipped
LOCK_AFTER = 3  # steps from one format before the needles narrow to its family
UNLOCK_AFTER = 5.0  # seconds without a step before every needle is looked for again

USER_GROUPS = ("step", "loss", "samples_per_second", "tokens_per_second")

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
        step = number(groups.get("step"))
        if step is None or step != step or step < 0:
            return None
        return Progress(step=int(step), loss=number(groups.get("loss")),
                        samples_per_second=number(groups.get("samples_per_second")),
                        tokens_per_second=number(groups.get("tokens_per_second")),
                        source="user", ts=ts)


class LogProgress:
    """Turns trainer output lines into ``Progress`` and ``PhaseMarker`` observations.

    One instance per trainer (its stdout and stderr together: HF Trainer prints its
    step on stderr and its loss on stdout). Not thread-safe; call from one task.
    """

    def __init__(self, user_regexes: Sequence[str] = ()) -> None:
        self.user = tuple(UserPattern(p) for p in user_regexes)
        self.skipped = 0  # lines too long or that made a parser fail
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

    def parse(self, line: bytes, ts: float) -> Progress | PhaseMarker | None:
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

    def parse_lines(self, lines: Sequence[bytes], ts: float) -> list[Progress | PhaseMarker]:
        """A batch of lines that arrived together → their observations, in order."""
        return self.parse_blob(b"\n".join(lines), ts)

    def parse_blob(self, buf: bytes, ts: float) -> list[Progress | PhaseMarker]:
        """Lines joined by ``\\n`` (as the output tee delivers them) → observations, in
        order. Scanning the blob for needles costs nothing per line that has none."""
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
        out: list[Progress | PhaseMarker] = []
        for s in sorted(starts):
            e = buf.find(b"\n", s)
            obs = self._parse_candidate(buf[s:] if e < 0 else buf[s:e], ts)
            if obs is not None:
                out.append(obs)
        return out

    # ------------------------------------------------------------------ internals

    def _parse_candidate(self, raw: bytes, ts: float) -> Progress | PhaseMarker | None:
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
                        obs = fmt.parse(text, ts, self.state)
                        if isinstance(obs, Claimed):
                            return None
                        if obs is not None:
                            self._seen(fmt.family, obs)
                            return obs
                        break
        except Exception:  # noqa: BLE001 - a hostile line must never break the agent
            self._skip(raw, "parser failed")
        return None

    def _seen(self, family: str, obs: Progress | PhaseMarker) -> None:
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

    def _skip(self, raw: bytes, why: str) -> None:
        self.skipped += 1
        if self.skipped == 1 or self.skipped % 10_000 == 0:
            log.warning("skipped an output line (%s, %d bytes; %d skipped so far)",
                        why, len(raw), self.skipped, exc_info=why == "parser failed")
