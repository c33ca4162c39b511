"""The local policy: what the agent decides on its own, with no arbiter (or none reachable).

Pure: a fault, the restarts already done and the configuration in; an :class:`Action` out.

| fault                          | decision                                         |
|--------------------------------|--------------------------------------------------|
| crash, restarts left           | RESTART after backoff (base x 2^n, capped)       |
| hang, --hang-action restart    | RESTART after backoff (counts as a restart)       |
| hang, --hang-action alert      | ALERT_ONLY                                       |
| crash/hang, no restarts left   | STOP with the trainer's exit status              |
| GPU fatal (or scope node)      | REPLACE: stop, exit with model.EXIT_REPLACE      |
| NIC, GPU non-fatal, others     | ALERT_ONLY (the trainer fails on its own if the  |
|                                | fault breaks it, and that crash is handled)      |

Restarting in place locally restarts only this rank: with several ranks, the others
notice through their collectives' timeouts. Job-wide restarts need the arbiter.
"""

from __future__ import annotations

from ftagent.model import EXIT_REPLACE, Action, ActionKind, Fault, FaultKind, Scope, Severity


def backoff(restarts_done: int, base: float, cap: float) -> float:
    """Exponential backoff before restart number ``restarts_done + 1``."""
    if base <= 0:
        return 0.0
    return min(cap, base * (2.0 ** min(restarts_done, 32)))


def decide(fault: Fault, *, restarts_done: int, max_restarts: int, backoff_base: float,
           backoff_cap: float, hang_action: str = "restart") -> Action:
    exit_status = int(fault.evidence.get("exit_status", 1) or 1)
    if fault.kind == FaultKind.GPU and (fault.severity == Severity.FATAL
                                        or fault.scope == Scope.NODE):
        return Action(ActionKind.REPLACE, f"fatal GPU fault: {fault.message}",
                      exit_code=EXIT_REPLACE, fault_id=fault.id)
    if fault.kind == FaultKind.HANG and hang_action == "alert":
        return Action(ActionKind.ALERT_ONLY, f"hang (--hang-action alert): {fault.message}",
                      fault_id=fault.id)
    if fault.kind in (FaultKind.CRASH, FaultKind.HANG):
        if restarts_done < max_restarts:
            wait = backoff(restarts_done, backoff_base, backoff_cap)
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
