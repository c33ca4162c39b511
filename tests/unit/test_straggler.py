"""Straggler detection (ftagent/arbiter/straggler.py): synthetic per-rank timings, a clock
passed in. Synchronous training is modelled as it behaves: every rank's step time is the
same, the slow rank waits least in collectives."""

from __future__ import annotations

from ftagent.arbiter.straggler import (
    RankTiming,
    StragglerConfig,
    StragglerWatch,
    assess,
)

STEP = 0.30


def synced(slow: dict[int, float], n: int = 4, base: float = 0.10,
           data: dict[int, float] | None = None) -> list[RankTiming]:
    """n ranks of a synchronous job: each computes ``base`` (or ``slow[r]``) seconds; all
    finish the step together, the difference is spent waiting in the collective."""
    data = data or {}
    own = {r: slow.get(r, base) + data.get(r, 0.0) for r in range(n)}
    step = max(own.values()) + 0.02  # the collective itself
    return [RankTiming(r, f"node-{r}", step, step - own[r], data.get(r, 0.0)) for r in range(n)]


def run(watch: StragglerWatch, timings: list[RankTiming], start: float, end: float,
        every: float = 5.0) -> list:
    found, t = [], start
    while t <= end:
        found += watch.update(timings, t)
        t += every
    return found


def test_slow_compute_rank_is_named_with_node_and_evidence() -> None:
    watch = StragglerWatch(StragglerConfig(ratio=0.8, window=300))
    timings = synced({2: 0.25})
    # every rank's step time is the same: step rate alone cannot tell
    assert len({t.step_seconds for t in timings}) == 1
    found = run(watch, timings, 0, 300)
    assert [f.rank for f in found] == [2]
    f = found[0]
    assert f.node == "node-2" and not f.persistent
    assert "rank 2 on node node-2" in f.message and "slow in compute" in f.message
    assert f.evidence["slow_in"] == "compute"
    assert f.evidence["own_seconds"] == 0.25 and f.evidence["median_own_seconds"] == 0.10
    assert f.evidence["step_seconds"] == f.evidence["median_step_seconds"]
    # it waits least: the others wait for it in the collective
    assert f.evidence["collective_seconds"] < f.evidence["median_collective_seconds"]
    assert watch.current == [2]


def test_rank_waiting_in_collectives_is_not_named() -> None:
    """One rank waits far longer in collectives than the others, but computes as fast:
    it is a victim (of a slower peer, or of the network), not the straggler."""
    watch = StragglerWatch(StragglerConfig(window=60))
    timings = [RankTiming(0, "a", 0.5, 0.40), RankTiming(1, "b", 0.5, 0.05),
               RankTiming(2, "c", 0.5, 0.05), RankTiming(3, "d", 0.5, 0.05)]
    # rank 0's step minus its wait is 0.10, the others' 0.45: only the others are slow...
    assert set(assess({t.rank: t for t in timings}, 0.8)) == set()
    assert run(watch, timings, 0, 600) == []


def test_two_slow_of_four_never_makes_the_fast_ones_stragglers() -> None:
    watch = StragglerWatch(StragglerConfig(window=30))
    found = run(watch, synced({0: 0.3, 1: 0.3}), 0, 100)
    assert {f.rank for f in found} <= {0, 1}
    assert all(f.rank in (0, 1) for f in found)


def test_healthy_job_has_none() -> None:
    watch = StragglerWatch(StragglerConfig(window=60))
    # own time 0.100..0.114 s per step: a spread of 14 %, within the ratio
    jitter = [RankTiming(r, "", STEP, STEP - 0.1 - 0.002 * r) for r in range(8)]
    assert run(watch, jitter, 0, 3600) == []
    assert watch.current == []


def test_window_is_respected_and_recovery_starts_it_over() -> None:
    watch = StragglerWatch(StragglerConfig(window=300))
    slow, healthy = synced({1: 0.2}), synced({})
    assert run(watch, slow, 0, 295) == []  # slow for 295 s: not yet
    assert watch.update(healthy, 296) == []  # recovered: the clock starts over
    assert run(watch, slow, 300, 595) == []  # 295 s again
    assert [f.rank for f in watch.update(slow, 600)] == [1]  # 300 s in a row
    assert watch.update(slow, 605) == []  # named once, not every summary


def test_persistent_after_another_window_then_cleared() -> None:
    watch = StragglerWatch(StragglerConfig(window=100))
    slow = synced({3: 0.3})
    found = run(watch, slow, 0, 200)
    assert [(f.rank, f.persistent) for f in found] == [(3, False), (3, True)]
    assert "still a straggler" in found[1].message
    watch.update(synced({}), 205)
    assert watch.current == []


def test_two_ranks_the_slow_one_does_not_pull_the_median() -> None:
    # c = 1.5x: against the mean of both (1.25) it would be 83% (not slow); against the
    # other rank it is 67%.
    watch = StragglerWatch(StragglerConfig(window=10))
    found = run(watch, synced({1: 0.15}, n=2), 0, 10)
    assert [f.rank for f in found] == [1]


def test_slow_data_loading_is_named_as_such() -> None:
    watch = StragglerWatch(StragglerConfig(window=10))
    found = run(watch, synced({}, data={0: 0.2}), 0, 10)
    assert [f.rank for f in found] == [0]
    assert found[0].evidence["slow_in"] == "data loading"


def test_unmeasured_and_single_ranks_are_left_out() -> None:
    watch = StragglerWatch(StragglerConfig(window=0))
    assert watch.update([RankTiming(0, "", 1.0)], 0) == []  # no median of one
    assert watch.update([RankTiming(0, "", 1.0), RankTiming(1, "", 0.0)], 1) == []
    # no breakdown (log lines only): the whole step is own time
    found = watch.update([RankTiming(0, "", 1.0), RankTiming(1, "", 0.2),
                          RankTiming(2, "", 0.2)], 2)
    assert [f.rank for f in found] == [0]


def test_reset_forgets_the_previous_generation() -> None:
    watch = StragglerWatch(StragglerConfig(window=50))
    run(watch, synced({0: 0.3}), 0, 45)
    watch.reset()
    assert watch.update(synced({0: 0.3}), 50) == []


# --------------------------------------------------------------------------- the agent's side


def test_step_times_means_per_step_from_steps_and_waits() -> None:
    from ftagent.agent.reporter import StepTimes
    from ftagent.model import CollectiveSample, PhaseTiming, Progress

    st = StepTimes(keep=4)
    assert st.means() == (0.0, 0.0, 0.0, 0)
    st.step(Progress(0, ts=10.0))
    for i in range(1, 7):
        st.observe(CollectiveSample("all_reduce", 1024, 0.05, 2))
        st.observe(CollectiveSample("all_reduce", 1024, 0.05, 2, count=2))
        st.observe(PhaseTiming("data", 0.02))
        st.observe(PhaseTiming("forward", 0.5))  # not a wait
        st.step(Progress(i, ts=10.0 + 0.3 * i))
    step, coll, data, n = st.means()
    assert n == 4 and abs(step - 0.3) < 1e-9 and abs(coll - 0.1) < 1e-9
    assert abs(data - 0.02) < 1e-9
    st.step(Progress(0, ts=20.0))  # a new attempt starts over
    assert st.means()[3] == 0


# --------------------------------------------------------------------------- the policy


def _job_and_report(persistent: bool, restarts: int = 0):  # type: ignore[no-untyped-def]
    from ftagent.arbiter.policy import FaultReport
    from ftagent.arbiter.state import JobPhase, JobState
    from ftagent.model import Fault, FaultKind, Severity

    job = JobState("j", world_size=4, phase=JobPhase.RUNNING, restarts=restarts)
    f = Fault(FaultKind.STRAGGLER, "rank 2 slow", severity=Severity.WARNING,
              evidence={"persistent": persistent})
    return job, FaultReport(f, 2, 0)


def test_policy_alerts_by_default_and_replaces_only_a_persistent_one_when_asked() -> None:
    from ftagent.arbiter.policy import PolicyConfig, decide_fault
    from ftagent.arbiter.state import Verdict
    from ftagent.arbiter.straggler import StragglerAction

    replace = PolicyConfig(straggler_action=StragglerAction.REPLACE)
    for cfg, persistent, want in ((PolicyConfig(), True, Verdict.ALERT_ONLY),
                                  (replace, False, Verdict.ALERT_ONLY),
                                  (replace, True, Verdict.REPLACE)):
        job, rep = _job_and_report(persistent)
        got = decide_fault(job, rep, 0.0, cfg)
        assert [d.verdict for d in got] == [want]
        if want is Verdict.REPLACE:
            assert got[0].rank == 2
    job, rep = _job_and_report(True, restarts=3)  # budget spent: never a STOP for slowness
    assert [d.verdict for d in decide_fault(job, rep, 0.0, replace)] == [Verdict.ALERT_ONLY]
