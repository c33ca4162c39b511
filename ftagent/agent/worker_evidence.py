"""What a worker attaches to its faults: the trainer's last lines (secrets redacted) and
the crash fault. The hang fault's enrichment (stacks, dumps) is its parts' ``evidence``
hook (agent/hang_watch.py ``evidence_hook``, wrapped by the flight recorder's), which
``Worker.raise_fault`` awaits itself, a failed capture never losing the fault.
"""

from __future__ import annotations

import signal

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
