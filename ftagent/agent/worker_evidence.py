"""What a worker attaches to its faults: the trainer's last lines (secrets redacted) and
the crash fault, and the hang fault's evidence hook (stacks and last lines:
``evidence_hook``, the flight recorder's dumps around it), which ``Worker.raise_fault``
awaits itself, a failed capture never losing the fault.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Awaitable, Callable, Sequence

from ftagent.agent import evidence
from ftagent.agent.redact import redact_lines
from ftagent.agent.tee import LastLines
from ftagent.model import Fault, FaultKind, ProcessExit, Scope

EVIDENCE_LINES = 50  # last lines attached to a fault (the events file keeps them too)
EVIDENCE_STDERR_LINES = 20  # and the last of stderr alone: where tracebacks are


def tail(last_lines: LastLines, n: int = EVIDENCE_LINES,
         stream: str | None = None) -> list[str]:
    """The last output lines as text, secrets redacted; stderr lines are marked unless
    asked for alone."""
    return _text(last_lines.tail(n, stream), marked=stream is None)


def _text(lines: list[tuple[str, bytes]], *, marked: bool) -> list[str]:
    """Lines as text, secrets redacted; stderr's marked if ``marked`` (a merged tail)."""
    if not lines:
        return []  # nothing printed: nothing to redact
    texts = redact_lines([b.decode("utf-8", "replace") for _, b in lines])
    if not marked:
        return texts
    return [f"{s}: {text}" if s == "stderr" else text
            for (s, _), text in zip(lines, texts, strict=True)]


def crash_fault(exit_: ProcessExit, attempt: int, last_lines: LastLines) -> Fault:
    """The fault of a trainer that exited non-zero or was killed: its status, signal,
    attempt and last lines (stderr's alone too: the traceback, whatever order the two
    pipes were read in)."""
    how = (f"killed by signal {exit_.signal} ({signal.Signals(exit_.signal).name})"
           if exit_.signal is not None else f"exited with code {exit_.code}")
    # both tails in one call (LastLines.tails), not the ring asked twice
    merged, stderr = last_lines.tails(EVIDENCE_LINES, EVIDENCE_STDERR_LINES, "stderr")
    return Fault(FaultKind.CRASH, f"trainer (pid {exit_.pid}) {how}", scope=Scope.PROCESS,
                 evidence={"exit_status": exit_.exit_status, "exit_code": exit_.code,
                           "signal": exit_.signal, "attempt": attempt,
                           "last_lines": _text(merged, marked=True),
                           "last_stderr_lines": _text(stderr, marked=False)})


def evidence_hook(dump_timeout: float, last: Callable[[], list[str]]
                  ) -> Callable[[Fault, Callable[[], Sequence[int]]], Awaitable[Fault]]:
    """The agent's ``evidence`` hook for a hang fault, captured *before* the policy acts
    (once the trainer is killed, that evidence is gone): py-spy stacks and states of
    ``pids()`` (the tree listed only when captured here: a verified hang carries its
    window's last sample) and the last lines (``last``: ``tail`` over the worker's ring,
    cmd/run.py). The flight recorder wraps it (flight_recorder_parts); the worker awaits it,
    a failure never losing the fault (Worker.raise_fault)."""

    async def enrich(fault: Fault, pids: Callable[[], Sequence[int]]) -> Fault:
        if "processes" in fault.evidence:  # verified: the window's last sample is there
            return dataclasses.replace(fault, evidence={**fault.evidence,
                                                        "last_lines": last()})
        captured = await evidence.capture(pids(), dump_timeout)
        extra = {"processes": captured.get("processes", []),
                 "stack_capture_seconds": captured.get("seconds"),
                 "last_lines": last()}
        return dataclasses.replace(fault, evidence={**fault.evidence, **extra})

    return enrich
