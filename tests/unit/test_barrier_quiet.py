"""The barrier's reconcile skips its scan while every connected rank is quiet, and that
shortcut decides exactly what the full pass decides; a job's end is a count of the ranks
that succeeded, not a scan per exit.

``state.apply`` keeps ``job.loud`` (the connected ranks that are not ``state.quiet``); the
checks here drive random sequences of agents' Hellos, departures, arrivals and the
decisions that follow through ``apply``, as ``jobs.py`` does, and after every change
compare the index with a recount and ``barrier.reconcile`` with its full pass. Before the
index, a job's first N Hellos cost O(N) each (16,384 ranks: about 20 s of the loop)."""

from __future__ import annotations

import random
import time

import pytest

from ftagent.arbiter import barrier
from ftagent.arbiter.state import (
    Arrived,
    Decision,
    Exited,
    JobPhase,
    JobState,
    Left,
    Registered,
    Verdict,
    apply,
    quiet,
    succeeded,
)

NOW = 1000.0


def hello(rank: int, world: int, *, generation: int = 0, released: int = -1,
          running: bool = False, instance: str = "a") -> Registered:
    return Registered(rank=rank, pod=f"pod-{rank}", node="n", state="waiting",
                      instance=instance, pod_uid="", gpus=(), generation=generation,
                      released_generation=released, running=running, restart_count=0,
                      world_size=world, alert_only=False, conn=object())


def full_pass(job: JobState, rank: int | None) -> list[Decision]:
    """What reconcile decides without the index (a JobState made without ``apply``)."""
    kept = job.quiet_generation
    job.quiet_generation = -1
    try:
        return barrier.reconcile(job, NOW, rank)
    finally:
        job.quiet_generation = kept


def recount(job: JobState) -> set[int]:
    return {r for r, rs in job.ranks.items() if rs.connected and not quiet(rs, job.generation)}


def winners(job: JobState) -> set[int]:
    return {r for r, rs in job.ranks.items() if succeeded(rs, job.generation)}


def step(job: JobState, change: object, rng: random.Random) -> None:
    apply(job, change, NOW)  # type: ignore[arg-type]
    assert job.quiet_generation == job.generation
    assert job.loud == recount(job) and job.succeeded == winners(job)
    rank = getattr(change, "rank", None)
    rank = rank if isinstance(change, Registered) else None
    got = barrier.reconcile(job, NOW, rank)
    assert got == full_pass(job, rank)
    for d in got[: rng.randint(0, len(got))]:  # some decisions applied, as jobs.py would
        apply(job, d, NOW)
        assert job.loud == recount(job) and job.succeeded == winners(job)


@pytest.mark.parametrize("seed", range(60))
def test_the_index_and_the_shortcut_match_the_full_pass(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 6)
    job = JobState(job="j", world_size=world)
    for _ in range(80):
        r = rng.randrange(world)
        g = job.generation
        kind = rng.random()
        if kind < 0.45:  # most Hellos are quiet; some say a trainer runs, a newer or older one
            gen = rng.choice([g, g, g, max(0, g - 1), g + 1])
            change: object = hello(r, world, generation=gen,
                                   released=rng.choice([-1, -1, gen - 1, gen]),
                                   running=rng.random() < 0.2,
                                   instance=rng.choice("ab"))
        elif kind < 0.6:
            change = Left(r)
        elif kind < 0.75 and r in job.ranks:
            change = Arrived(r, rng.choice([g, g + 1]))
        elif kind < 0.8 and r in job.ranks:
            change = Exited(r, rng.choice([g, g, max(0, g - 1)]), rng.choice([0, 0, 1]))
        elif kind < 0.85:
            change = Decision(Verdict.RESTART, "test", g + 1, rank=r)
        elif kind < 0.9:
            change = Decision(Verdict.RELEASE_BARRIER, "test", g)
        elif kind < 0.95:
            change = Decision(rng.choice([Verdict.REJOIN, Verdict.STOP, Verdict.RELEASE_BARRIER]),
                              "test", g, targets=(r,))
        else:
            change = Decision(Verdict.DUMP_STACKS, "test", g, rank=r)
        step(job, change, rng)


def test_a_job_of_16384_ranks_starts_without_a_scan_per_hello() -> None:
    world = 16384
    job = JobState(job="j", world_size=world)
    t = time.process_time()
    for r in range(world):
        apply(job, hello(r, world), NOW)
        assert barrier.decide_hello(job, r, NOW) == []
    spent = time.process_time() - t
    # O(N) in all: well under a second of CPU (it was about 20 s, O(N^2))
    assert spent < 5.0, spent
    assert not job.loud and job.connected == world


def test_a_rank_that_runs_alone_is_still_seen_among_quiet_ones() -> None:
    job = JobState(job="j", world_size=3)
    apply(job, hello(0, 3, running=True), NOW)  # started without a barrier (no arbiter)
    assert job.loud == {0}
    apply(job, hello(1, 3), NOW)
    got = barrier.decide_hello(job, 1, NOW)
    assert [d.verdict for d in got] == [Verdict.REJOIN] and got == full_pass(job, 1)


def test_a_job_of_16384_ranks_ends_without_a_scan_per_exit() -> None:
    world = 16384
    job = JobState(job="j", world_size=world)
    for r in range(world):
        apply(job, hello(r, world), NOW)
    apply(job, Decision(Verdict.RELEASE_BARRIER, "all arrived", 0), NOW)
    t = time.process_time()
    for r in range(world):
        apply(job, Exited(r, 0, 0), NOW)
        assert job.finished is (r == world - 1)
    spent = time.process_time() - t
    assert spent < 5.0, spent  # it was 8.4 s (a scan of every rank per exit)
    assert job.phase is JobPhase.SUCCEEDED and len(job.succeeded) == world
