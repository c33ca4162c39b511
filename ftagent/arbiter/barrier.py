"""The job barrier: no rank starts generation G before every rank's previous trainer exited.

After a (re)start decision each agent stops its trainer, waits until the whole process
tree is gone, then sends BarrierArrival(G). When all ``world_size`` ranks arrived the
arbiter releases them together, so a new trainer can never meet the previous attempt's
processes or rendezvous store (pytorch #135712: torchrun restarts fail 3 times in 4
when they do). The first start is the barrier of generation 0.

Functions like the policy: (job, event, now) -> decisions, no I/O, no change: the
jobs (jobs.py) apply the arrival (``state.apply`` of ``Arrived`` counts it at the barrier:
O(1), so 10k ranks release in one pass), then ask ``decide_barrier``; ``state.apply``
carries the decisions out. ``decide_arrival`` is that apply and decision in one call, for
callers that hold a bare ``JobState`` (the tests).
"""

from __future__ import annotations

from collections.abc import Container

from ftagent.arbiter.state import (
    FINISHED,
    AtBarrier,
    BarrierState,
    Decision,
    JobPhase,
    JobState,
    Verdict,
    apply,
)


def decide_arrival(job: JobState, rank: int, generation: int, now: float) -> list[Decision]:
    """Rank ``rank`` is ready for ``generation``: count it (``state.apply`` of
    ``AtBarrier``), then ``decide_barrier``.

    Call ``reconcile`` first: an arrival above the job's generation raises the job to it,
    so here ``generation`` is the job's or older (stale: the rank was sent a restart to
    the current generation, which reconcile re-sends if it never was).
    """
    fresh = job.barrier is None or rank not in job.barrier.arrived or \
        job.barrier.generation != job.generation
    apply(job, AtBarrier(rank, generation), now)
    return decide_barrier(job, rank, generation, fresh)


def decide_barrier(job: JobState, rank: int, generation: int,
                   fresh: bool = True) -> list[Decision]:
    """After ``rank``'s arrival at ``generation`` was counted: release everyone once all
    are in; a rank that re-arrives at a released barrier is released alone. ``fresh``:
    the rank was not counted at this barrier before (a re-sent arrival decides nothing)."""
    g = job.generation
    if job.phase is JobPhase.STOPPED:
        return [Decision(Verdict.STOP, f"rank {rank} arrived at the barrier of a stopped job: "
                         f"{job.stop_reason}", g, targets=(rank,), exit_code=1, rank=rank)]
    b = job.barrier
    if job.phase is JobPhase.SUCCEEDED or generation != g or b is None:
        return []
    if b.released:
        return [Decision(Verdict.RELEASE_BARRIER, f"rank {rank} re-arrived at generation {g}, "
                         "already released", g, targets=(rank,), rank=rank)]
    if not fresh:
        return []
    return _release_if_full(job, b)


def decide_hello(job: JobState, rank: int, now: float) -> list[Decision]:
    """A (re)connecting agent (its RankState already updated from the Hello)."""
    if job.phase is JobPhase.STOPPED:
        return [Decision(Verdict.STOP, f"rank {rank} connected to a stopped job: "
                         f"{job.stop_reason}", job.generation, targets=(rank,), exit_code=1,
                         rank=rank)]
    return reconcile(job, now, rank)


def reconcile(job: JobState, now: float, rank: int | None = None) -> list[Decision]:
    """Bring the job and its connected ranks to one generation, from what the agents say.

    The agents are the truth (the arbiter may be new, or may have missed a fail-open
    restart), and generations only go up. In order:

    1. A rank reports a generation above the job's: the job is at that generation now
       (RECONCILE: a restart the agent did alone, or one a previous arbiter decided);
       the budget is not spent again.
    2. A rank that says the barrier of the job's generation was released already (a
       previous arbiter completed it): RELEASE it for every rank.
    3. A rank that runs a trainer of the job's generation started without the barrier
       (fail open): if every rank does, the job trains: adopt it (RELEASE). If another
       rank waits at that barrier or lags behind, that trainer can meet nobody it should:
       every rank restarts together at the next generation (REJOIN, budget not spent).
       Otherwise wait for the others to connect (the barrier timeout bounds the wait).
    4. Ranks behind the job's generation that were never told: REJOIN it.

    ``rank``: only that rank's state changed (its Hello). While the job's barrier is
    released and the rank is not above it, only rule 4 for that rank can apply: it is
    decided without scanning every rank, so a reconnect storm of N agents costs N, not
    N^2. While every connected rank is quiet (``state.quiet``: a job's first Hellos, the
    ranks waiting at a barrier), nothing is decided, also without a scan (``job.loud``,
    kept by ``state.apply``). Anything else takes the full pass.
    """
    if job.phase in FINISHED:
        return []
    if job.quiet_generation == job.generation and not job.loud:
        return []  # every connected rank is quiet (state.quiet): rules 1-4 find nothing
    me = job.ranks.get(rank) if rank is not None else None
    b = job.barrier
    if (me is not None and me.connected and me.generation <= job.generation and b is not None
            and b.generation == job.generation and b.released):
        if me.generation < job.generation and me.commanded < job.generation:
            return [_rejoin((me.rank,), me.generation, job.generation)]
        return []
    out: list[Decision] = []
    connected = [r for r in job.ranks.values() if r.connected]
    if not connected:
        return out
    g = job.generation
    top = max(connected, key=lambda r: (r.generation, -r.rank))
    raised = top.generation > g
    if raised:
        out.append(Decision(Verdict.RECONCILE, f"rank {top.rank} reports generation "
                            f"{top.generation} (the job was at {g}): the job is at generation "
                            f"{top.generation} (restarted while no arbiter decided)",
                            top.generation, rank=top.rank))
        g = top.generation
    released = (not raised and job.barrier is not None and job.barrier.generation == g
                and job.barrier.released)
    if not released:
        proof = [r for r in connected if r.released_generation >= g]
        if proof:
            out.append(Decision(Verdict.RELEASE_BARRIER, f"rank {proof[0].rank} already "
                                f"runs generation {g}: its barrier was released before "
                                "(by a previous arbiter)", g))
            released = True
    if not released:
        alone = sorted(r.rank for r in connected if r.generation == g and r.running)
        if alone:
            others = [r for r in connected if r.rank not in alone]
            if len(alone) == job.world_size:
                out.append(Decision(Verdict.RELEASE_BARRIER, f"every rank runs generation {g}, "
                                    "started while no arbiter decided: the job goes on", g))
                return out
            if others:
                n = g + 1
                out.append(Decision(Verdict.REJOIN, f"rank {rank_list(alone)} started generation "
                                    f"{g} without the barrier (no arbiter then) while rank "
                                    f"{rank_list(sorted(r.rank for r in others))} did not: "
                                    f"every rank restarts together at generation {n}", n))
                return out
    behind = tuple(sorted(r.rank for r in connected if r.generation < g and r.commanded < g))
    if behind:
        out.append(_rejoin(behind, min(job.ranks[r].generation for r in behind), g))
    return out


def _rejoin(behind: tuple[int, ...], lowest: int, g: int) -> Decision:
    return Decision(Verdict.REJOIN, f"rank {rank_list(list(behind))} at generation {lowest}; "
                    f"the job is at {g}: restart into it", g, targets=behind)


def rank_list(ranks: list[int], shown: int = 10) -> str:
    """``0, 1, 2 and 5 more``: ranks for a human, the first ``shown`` of them."""
    head = ", ".join(str(r) for r in ranks[:shown])
    return head if len(ranks) <= shown else f"{head} and {len(ranks) - shown} more"


def barrier_expired(job: JobState, now: float, timeout: float) -> list[Decision]:
    """STOP the job when its barrier stays incomplete past ``timeout``, naming who is missing."""
    b = job.barrier
    if b is None or b.released or job.phase in FINISHED or now - b.opened_at < timeout:
        return []
    first = first_missing(job.world_size, b.arrived, 20)
    shown = ", ".join(map(str, first))
    more = job.world_size - len(b.arrived) - len(first)
    shown += f" and {more} more" if more > 0 else ""
    return [Decision(Verdict.STOP, f"barrier of generation {b.generation} timed out after "
                     f"{timeout:.0f}s: {len(b.arrived)}/{job.world_size} ranks arrived; missing "
                     f"rank {shown} (is its pod running? see `ftagent status {job.job}`)",
                     job.generation, exit_code=1, rank=first[0] if first else None)]


def barrier_summary(job: JobState, now: float) -> str:
    """One line for status: where the barrier stands."""
    b = job.barrier
    if b is None:
        return ""
    if b.released:
        return f"generation {b.generation}: released"
    missing = first_missing(job.world_size, b.arrived, 11)
    head = ", ".join(str(r) for r in missing[:10]) + (" ..." if len(missing) > 10 else "")
    return (f"generation {b.generation}: {len(b.arrived)}/{job.world_size} arrived, open "
            f"{now - b.opened_at:.0f}s" + (f", waiting for rank {head}" if missing else ""))


def first_missing(world_size: int, arrived: Container[int], n: int) -> list[int]:
    """The lowest ``n`` ranks below ``world_size`` not in ``arrived``, in time linear in
    ``len(arrived) + n``: never a set of every rank (a Hello may say 1,000,000 ranks, and
    ListJobs shows every job's barrier; issue 20)."""
    out: list[int] = []
    r = 0
    while len(out) < n and r < world_size:
        if r not in arrived:
            out.append(r)
        r += 1
    return out


def _release_if_full(job: JobState, b: BarrierState) -> list[Decision]:
    if len(b.arrived) < job.world_size:
        return []
    return [Decision(Verdict.RELEASE_BARRIER, f"all {job.world_size} ranks arrived: "
                     f"generation {b.generation} starts", b.generation)]
