"""The events file: one JSON object per line for every state, fault and action.

``{"ts": 1764500000.123, "time": "2026-11-30T12:00:00.123Z", "event": "fault",
"kind": "crash", "message": "...", ...fields}``. A line is flushed when written, so a
tail -f or a log shipper sees it at once, and a crash of the agent loses nothing already
recorded. Writing never raises into the agent: a full disk is logged once and the agent
goes on supervising.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import IO, Any

from ftagent.model import Progress

log = logging.getLogger("ftagent.events")


class EventsFile:
    def __init__(self, path: str, static: Mapping[str, Any] | None = None, *,
                 ranked: Any = None) -> None:
        """``static``: the fields every line carries; ``ranked``: whose ``rank`` attribute
        each line names, read at each write (a worker's lifecycle, the rank's one owner:
        a spare that takes a rank names it from then on)."""
        self.path = path
        self.static: Mapping[str, Any] = dict(static or {})
        self.ranked = ranked
        self._fh: IO[str] | None = None
        self._failed = False
        if path:
            try:
                self._fh = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
            except OSError as e:
                log.error("cannot open events file %s: %s (events are not recorded)", path, e)

    def write(self, event: str, kind: str, message: str, **fields: Any) -> dict[str, Any]:
        (record,) = self.write_lines((event, kind, message, fields))
        return record

    def write_lines(self, *lines: tuple[str, str, str, Mapping[str, Any]]
                    ) -> list[dict[str, Any]]:
        """Several lines of one transition (``(event, kind, message, fields)`` each: an
        action and the state that carries it out), in order, in one write: flushed
        together, so a crash of the agent loses none of them once this returns."""
        now = time.time()
        stamp = {"ts": round(now, 6),
                 "time": datetime.fromtimestamp(now, timezone.utc).isoformat(
                     timespec="milliseconds").replace("+00:00", "Z")}
        rank = {"rank": self.ranked.rank} if self.ranked is not None else {}
        records: list[dict[str, Any]] = [
            {**stamp, "event": event, "kind": kind, "message": message, **rank,
             **self.static, **fields}
            for event, kind, message, fields in lines]
        if self._fh is not None:
            try:
                self._fh.write("".join(json.dumps(r, default=str, ensure_ascii=False) + "\n"
                                       for r in records))
            except (OSError, ValueError) as e:
                if not self._failed:
                    log.error("writing events file %s failed: %s", self.path, e)
                    self._failed = True
        return records

    def close(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None


class ProgressLog:
    """Progress into the events file, at most one line per ``every`` seconds (the step, the
    loss, the mean step time over the interval), so ``ftagent report`` can draw steps over
    time from an events file without the file growing with every step."""

    observes = (Progress,)  # what the watch loop hands it (watch/loop.py ``_route``)

    def __init__(self, events: EventsFile, every: float = 2.0,
                 clock: Any = time.monotonic) -> None:
        self.events = events
        self.every = every
        self.clock = clock
        self._last: tuple[float, int] | None = None  # (clock, step) of the last line

    def observe(self, obs: Any) -> None:
        if not isinstance(obs, Progress) or self.events._fh is None:
            return
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.every:
            return
        fields: dict[str, Any] = {"step": obs.step}
        if obs.loss is not None and obs.loss == obs.loss and abs(obs.loss) != float("inf"):
            fields["loss"] = obs.loss
        if self._last is not None and obs.step > self._last[1]:
            fields["step_seconds"] = round((now - self._last[0]) / (obs.step - self._last[1]), 6)
        self._last = (now, obs.step)
        self.events.write("progress", "step", "", **fields)
