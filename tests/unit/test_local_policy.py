from __future__ import annotations

from ftagent.agent.local_policy import FailureStreak, backoff, decide
from ftagent.model import EXIT_REPLACE, ActionKind, Fault, FaultKind, Scope, Severity


def crash(status: int = 3) -> Fault:
    return Fault(FaultKind.CRASH, "boom", evidence={"exit_status": status})


def test_backoff_none_on_a_first_failure_then_doubles_and_caps() -> None:
    assert [backoff(n, 1.0, 5.0) for n in range(6)] == [0, 1, 2, 4, 5, 5]
    assert backoff(3, 0.0, 5.0) == 0.0


def test_failure_streak_counts_only_quick_repeats() -> None:
    s = FailureStreak(window=60.0)
    assert s.record(1000.0) == 0  # the first failure: restart at once
    assert s.record(1010.0) == 1  # again within the window: back off
    assert s.record(1069.0) == 2
    assert s.record(1129.0) == 0  # a healthy stretch of 60 s: at once again
    assert s.record(1130.0) == 1


def test_first_failure_after_a_healthy_stretch_restarts_at_once() -> None:
    kw = dict(max_restarts=5, backoff_base=1.0, backoff_cap=30.0)
    a = decide(crash(), restarts_done=3, repeats=0, **kw)  # type: ignore[arg-type]
    assert a.kind == ActionKind.RESTART and a.backoff_seconds == 0.0
    a = decide(crash(), restarts_done=4, repeats=2, **kw)  # type: ignore[arg-type]
    assert a.backoff_seconds == 2.0


def test_crash_restarts_until_budget_then_stops_with_code() -> None:
    kw = dict(max_restarts=2, backoff_base=1.0, backoff_cap=30.0)
    a = decide(crash(), restarts_done=0, **kw)  # type: ignore[arg-type]
    assert a.kind == ActionKind.RESTART and a.backoff_seconds == 0.0
    a = decide(crash(), restarts_done=1, **kw)  # type: ignore[arg-type]
    assert a.kind == ActionKind.RESTART and a.backoff_seconds == 1.0
    a = decide(crash(7), restarts_done=2, **kw)  # type: ignore[arg-type]
    assert a.kind == ActionKind.STOP and a.exit_code == 7


def test_hang_alert_only_when_asked() -> None:
    f = Fault(FaultKind.HANG, "stuck")
    kw = dict(restarts_done=0, max_restarts=1, backoff_base=0.0, backoff_cap=0.0)
    assert decide(f, hang_action="alert", **kw).kind == ActionKind.ALERT_ONLY  # type: ignore[arg-type]
    assert decide(f, hang_action="restart", **kw).kind == ActionKind.RESTART  # type: ignore[arg-type]


def test_fatal_gpu_replaces_and_nic_alerts() -> None:
    kw = dict(restarts_done=0, max_restarts=1, backoff_base=0.0, backoff_cap=0.0)
    g = Fault(FaultKind.GPU, "xid 79", severity=Severity.FATAL, scope=Scope.NODE)
    a = decide(g, **kw)  # type: ignore[arg-type]
    assert a.kind == ActionKind.REPLACE and a.exit_code == EXIT_REPLACE
    assert decide(Fault(FaultKind.NIC, "eth0 down"), **kw).kind == ActionKind.ALERT_ONLY  # type: ignore[arg-type]


def test_latest_progress_keeps_last_step_of_each_run_and_all_markers() -> None:
    from ftagent.cmd.run import latest_progress
    from ftagent.model import PhaseMarker, Progress

    p = [Progress(step=i, ts=1.0) for i in range(5)]
    m = PhaseMarker("checkpoint", True, ts=1.0)
    assert latest_progress([p[0], p[1], m, p[2], p[3], p[4]]) == [p[1], m, p[4]]
    assert latest_progress([]) == []
    assert latest_progress([m]) == [m]
