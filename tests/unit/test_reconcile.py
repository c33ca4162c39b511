"""barrier.reconcile: generations reconcile upward from what the agents say (pure)."""

from __future__ import annotations

from ftagent.arbiter import barrier
from ftagent.arbiter.state import (
    BarrierState,
    Decision,
    JobPhase,
    JobState,
    RankState,
    Verdict,
    apply,
)

NOW = 1000.0


def job(world: int, generation: int = 0, *, released: bool = True) -> JobState:
    j = JobState(job="j", world_size=world, generation=generation, phase=JobPhase.RUNNING)
    j.barrier = BarrierState(generation=generation, opened_at=NOW, released=released)
    return j


def rank(j: JobState, r: int, generation: int, *, running: bool = False,
         released: int = -1, commanded: int = -1) -> RankState:
    rs = j.ranks[r] = RankState(rank=r, connected=True, generation=generation,
                                running=running, released_generation=released,
                                commanded=commanded)
    return rs


def run(j: JobState, ds: list[Decision]) -> list[Decision]:
    for d in ds:
        apply(j, d, NOW)
    return ds


def verdicts(ds: list[Decision]) -> list[tuple[Verdict, int, tuple[int, ...]]]:
    return [(d.verdict, d.generation, d.targets) for d in ds]


def test_a_rank_behind_the_job_is_told_to_rejoin_once() -> None:
    j = job(2, 3)
    rank(j, 0, 3, running=True, released=3)
    rank(j, 1, 0)
    assert verdicts(barrier.reconcile(j, NOW)) == [(Verdict.REJOIN, 3, (1,))]
    j.ranks[1].commanded = 3  # the registry records the command it sent
    assert barrier.reconcile(j, NOW) == []


def test_a_higher_generation_from_an_agent_raises_the_job_without_spending_budget() -> None:
    j = job(2, 0)
    rank(j, 0, 0, running=True, released=0)
    rank(j, 1, 1)  # restarted alone while the arbiter was away, waits at the barrier of 1
    ds = run(j, barrier.reconcile(j, NOW))
    assert verdicts(ds) == [(Verdict.RECONCILE, 1, ()), (Verdict.REJOIN, 1, (0,))]
    assert j.generation == 1 and j.restarts == 0 and j.phase is JobPhase.RESTARTING
    assert j.barrier is not None and j.barrier.generation == 1 and not j.barrier.released


def test_a_released_generation_proves_a_previous_arbiter_completed_the_barrier() -> None:
    j = job(2, 0, released=False)
    rank(j, 0, 3, running=True, released=3)
    rank(j, 1, 3)
    ds = run(j, barrier.reconcile(j, NOW))
    assert [d.verdict for d in ds] == [Verdict.RECONCILE, Verdict.RELEASE_BARRIER]
    assert j.barrier is not None and j.barrier.released and j.phase is JobPhase.RUNNING


def test_every_rank_running_the_same_unreleased_generation_is_adopted() -> None:
    j = job(2, 0)
    rank(j, 0, 1, running=True, released=0)
    rank(j, 1, 1, running=True, released=0)
    ds = run(j, barrier.reconcile(j, NOW))
    assert [d.verdict for d in ds] == [Verdict.RECONCILE, Verdict.RELEASE_BARRIER]
    assert j.generation == 1 and j.barrier is not None and j.barrier.released


def test_a_trainer_started_alone_beside_waiting_ranks_restarts_every_rank_together() -> None:
    j = job(3, 1, released=False)
    rank(j, 0, 1, running=True, released=0)  # failed open
    rank(j, 1, 1)  # waits at the barrier of 1
    ds = run(j, barrier.reconcile(j, NOW))
    assert verdicts(ds) == [(Verdict.REJOIN, 2, ())]
    assert j.generation == 2 and j.restarts == 0


def test_a_trainer_started_alone_waits_for_the_others_to_connect() -> None:
    j = job(2, 1, released=False)
    rank(j, 0, 1, running=True, released=0)
    assert barrier.reconcile(j, NOW) == []


def test_a_late_rank_of_a_released_generation_is_not_restarted() -> None:
    j = job(2, 2)
    rank(j, 0, 2, running=True, released=2)
    rank(j, 1, 2, running=True, released=1)  # failed open after the others were released
    assert barrier.reconcile(j, NOW) == []


def test_an_arrival_above_the_job_is_counted_after_reconcile() -> None:
    j = job(2, 0)
    rank(j, 0, 0, running=True, released=0)
    rank(j, 1, 1)
    run(j, barrier.reconcile(j, NOW))
    assert barrier.decide_arrival(j, 1, 1, NOW) == []
    j.ranks[0].generation, j.ranks[0].running = 1, False
    d = run(j, barrier.decide_arrival(j, 0, 1, NOW))
    assert verdicts(d) == [(Verdict.RELEASE_BARRIER, 1, ())] and j.phase is JobPhase.RUNNING


def test_stopped_and_finished_jobs_do_not_reconcile() -> None:
    j = job(2, 0)
    rank(j, 0, 4)
    j.phase = JobPhase.SUCCEEDED
    assert barrier.reconcile(j, NOW) == []
    j.phase, j.stop_reason = JobPhase.STOPPED, "budget spent"
    d = barrier.decide_hello(j, 0, NOW)
    assert verdicts(d) == [(Verdict.STOP, 0, (0,))]
