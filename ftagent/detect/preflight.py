"""Preflight before every (re)start: check results in, pass or fail with a reason out.

Pure: ``agent/preflight.py`` runs the checks at the edge (each bounded by its budget) and
hands the results here; the verdict names the first failing check and why, and
``fault_of`` turns a failure into the fault the decider hears *before* the barrier of the
generation releases, so that the arbiter replaces this rank's pod (REPLACE) instead of
restarting the whole job into a rank that fails again after the barrier.

======================= ============================================ ======= =====
check                   passes when                                  budget  fast
======================= ============================================ ======= =====
accelerator             every device of the trainer answers (NVML:     5 s    2 s
                          UUID and memory info, no GpuIsLost, no
                          row remap failed or pending; vendor
                          tools: a health read)
nic                     every link the agent watches is up             1 s   0.5 s
                          (IFF_UP and carrier)
storage                 the checkpoint directory (if given) takes a    5 s    2 s
                          small file: written, fsynced, read back,
                          removed
peer                    a TCP connect to MASTER_ADDR:MASTER_PORT      2 s    1 s
                          (ranks other than 0) finds a route:
                          connected or refused; ENETUNREACH fails
compute                 every device stores and reads back 64 MiB    10 s   skip
                          and computes a known sum and matmul
                          (agent/compute_probe.py in a child with
                          torch and CUDA; the simulated backends'
                          own; no compute path: skipped, said so)
======================= ============================================ ======= =====

A check that takes longer than its budget fails as "did not answer within": a device or
a file system that hangs is the fault preflight exists to catch. A check with nothing to
check (no accelerator watch, no NIC, no directory) is skipped, never a failure. Warm
restarts use the fast budgets (the devices answered moments ago: a restart must stay
fast; ``--preflight-warm full`` uses the full ones).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ftagent.model import Fault, FaultKind, Scope, Severity

CHECKS = ("accelerator", "nic", "storage", "peer", "compute")
BUDGETS = {"accelerator": 5.0, "nic": 1.0, "storage": 5.0, "peer": 2.0, "compute": 10.0}
# compute 0: skipped on a warm restart (the devices computed moments ago)
FAST_BUDGETS = {"accelerator": 2.0, "nic": 0.5, "storage": 2.0, "peer": 1.0, "compute": 0.0}
MAX_DETAIL = 300


@dataclass(frozen=True)
class CheckResult:
    """One check as it ran: ``ok`` False with ``detail`` saying why; ``timed_out`` when it
    did not answer within its budget; ``skipped`` when there was nothing to check."""

    name: str
    ok: bool
    seconds: float
    detail: str = ""
    timed_out: bool = False
    skipped: bool = False


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # one line: what failed and why ("" when it passed)
    failed: tuple[str, ...]  # the checks that failed, in CHECKS order
    seconds: float  # the longest check (they run together)
    results: tuple[CheckResult, ...] = ()


def budgets(fast: bool) -> dict[str, float]:
    """Seconds each check may take: the fast ones for a warm restart."""
    return dict(FAST_BUDGETS if fast else BUDGETS)


def _secs(v: float) -> float:
    return v if math.isfinite(v) and v >= 0 else 0.0


def verdict(results: Sequence[CheckResult]) -> Verdict:
    """Pass unless a check failed or timed out; the reason names each failing check."""
    order = {n: i for i, n in enumerate(CHECKS)}
    rs = sorted(results, key=lambda r: order.get(r.name, len(CHECKS)))
    bad = [r for r in rs if not r.skipped and (not r.ok or r.timed_out)]
    took = max((_secs(r.seconds) for r in rs), default=0.0)
    if not bad:
        return Verdict(True, "", (), took, tuple(rs))
    parts = []
    for r in bad:
        why = r.detail[:MAX_DETAIL] or ("did not answer" if r.timed_out else "failed")
        if r.timed_out and "within" not in why:
            why = f"{why} (did not answer within {_secs(r.seconds):.1f}s)"
        parts.append(f"{r.name}: {why}")
    return Verdict(False, "preflight failed: " + "; ".join(parts), tuple(r.name for r in bad),
                   took, tuple(rs))


def fault_of(v: Verdict, generation: int) -> Fault:
    """The fault a failed preflight raises: FATAL (the rank cannot start here), so the
    arbiter REPLACEs this rank's pod. An accelerator failure is a GPU fault of the node's
    hardware (node-scope: a node agent's or other tenants' reports can corroborate it); a
    link or the storage is the pod's view (scope POD: its node is never cordoned on it)."""
    gpu = "accelerator" in v.failed or "compute" in v.failed
    kind = FaultKind.GPU if gpu else FaultKind.NODE
    scope = Scope.NODE if gpu else Scope.POD
    evidence = {"preflight": True, "checks": list(v.failed), "generation": generation,
                "seconds": round(v.seconds, 3)}
    return Fault(kind, v.reason, Severity.FATAL, scope, evidence=evidence)
