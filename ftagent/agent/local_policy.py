"""The local policy: what the agent decides on its own, with no arbiter (or none reachable).

Pure: a fault, the restarts already done and the configuration in; an :class:`Action` out.

| fault                          | decision                                         |
|--------------------------------|--------------------------------------------------|
| crash, restarts left           | RESTART: at once after a healthy stretch, else   |
|                                | after backoff (base x 2^(n-1), capped)           |
| hang, --hang-action restart    | RESTART as for a crash (counts as a restart)     |
| hang, --hang-action alert      | ALERT_ONLY                                       |
| crash/hang, no restarts left   | STOP with the trainer's exit status              |
| GPU fatal (or scope node)      | REPLACE: stop, exit with model.EXIT_REPLACE      |
| NIC, GPU non-fatal, others     | ALERT_ONLY (the trainer fails on its own if the  |
|                                | fault breaks it, and that crash is handled)      |

Restarting in place locally restarts only this rank: with several ranks, the others
notice through their collectives' timeouts. Job-wide restarts need the arbiter.

Backoff: n is the number of failures in a row that each came within
``--restart-backoff-window`` seconds of the one before (:class:`FailureStreak`). The first
failure after a healthy stretch (n = 0) restarts at once, as torchrun does -- a second of
backoff per fault is a second of the whole job idle; a trainer that keeps failing soon
after its start waits base, 2 x base, 4 x base, ... up to the cap.
"""

from __future__ import annotations

import dataclasses

from ftagent.model import (
    EXIT_REPLACE,
    Action,
    ActionKind,
    Fault,
    FaultKind,
    Origin,
    Scope,
    Severity,
)


def backoff(repeats: int, base: float, cap: float) -> float:
    """Seconds before a restart after ``repeats`` quick failures in a row (0: none)."""
    if base <= 0 or repeats <= 0:
        return 0.0
    return min(cap, base * (2.0 ** min(repeats - 1, 32)))


class FailureStreak:
    """Counts failures that repeat within ``window`` seconds of the previous one; the
    count starts over after a failure-free stretch of ``window``. Time is passed in."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.repeats = 0
        self._last: float | None = None

    def record(self, now: float) -> int:
        """A failure at ``now``: the number of quick repeats before it (0: the first)."""
        if self._last is not None and now - self._last < self.window:
            self.repeats += 1
        else:
            self.repeats = 0
        self._last = now
        return self.repeats


def decide(fault: Fault, *, restarts_done: int, max_restarts: int, backoff_base: float,
           backoff_cap: float, hang_action: str = "restart",
           repeats: int | None = None) -> Action:
    """``repeats``: quick failures before this one (:class:`FailureStreak`); None counts
    every restart done as one (no window). The action's origin is LOCAL."""
    return dataclasses.replace(
        _decide(fault, restarts_done=restarts_done, max_restarts=max_restarts,
                backoff_base=backoff_base, backoff_cap=backoff_cap, hang_action=hang_action,
                repeats=repeats), origin=Origin.LOCAL)


def _decide(fault: Fault, *, restarts_done: int, max_restarts: int, backoff_base: float,
            backoff_cap: float, hang_action: str, repeats: int | None) -> Action:
    exit_status = int(fault.evidence.get("exit_status", 1) or 1)
    if fault.kind == FaultKind.GPU and (fault.severity == Severity.FATAL
                                        or fault.scope == Scope.NODE):
        return Action(ActionKind.REPLACE, f"fatal GPU fault: {fault.message}",
                      exit_code=EXIT_REPLACE, fault_id=fault.id)
    if fault.evidence.get("preflight") is True and fault.severity == Severity.FATAL:
        # the rank cannot start here (detect/preflight.py): move the pod, never loop
        return Action(ActionKind.REPLACE, fault.message, exit_code=EXIT_REPLACE,
                      fault_id=fault.id)
    if fault.kind == FaultKind.HANG and hang_action == "alert":
        return Action(ActionKind.ALERT_ONLY, f"hang (--hang-action alert): {fault.message}",
                      fault_id=fault.id)
    if fault.kind in (FaultKind.CRASH, FaultKind.HANG):
        if restarts_done < max_restarts:
            wait = backoff(restarts_done if repeats is None else repeats, backoff_base,
                           backoff_cap)
            return Action(ActionKind.RESTART,
                          f"{fault.kind.value}: restart {restarts_done + 1}/{max_restarts} "
                          f"after {wait:g}s backoff",
                          backoff_seconds=wait, fault_id=fault.id)
        return Action(ActionKind.STOP,
                      f"{fault.kind.value}: restart budget spent "
                      f"({restarts_done}/{max_restarts})",
                      exit_code=exit_status, fault_id=fault.id)
    return Action(ActionKind.ALERT_ONLY, f"{fault.kind.value}: {fault.message}",
                  fault_id=fault.id)
