"""The job barrier: no rank starts generation G before every rank's previous trainer exited.

After a (re)start decision each agent stops its trainer, waits until the whole process
tree is gone, then sends BarrierArrival(G). When all ``world_size`` ranks arrived the
arbiter releases them together, so a new trainer can never meet the previous attempt's
processes or rendezvous store (pytorch #135712: torchrun restarts fail 3 times in 4
when they do). The first start is the barrier of generation 0.

Functions like the policy: (job, event, now) -> decisions, no I/O; ``state.apply``
carries the decisions out. The one exception is bookkeeping: ``decide_arrival`` records
the arrival in the barrier itself, so that an arrival costs O(1) and 10k ranks release
in one pass.
"""

from __future__ import annotations

from ftagent.arbiter.state import BarrierState, Decision, JobPhase, JobState, Verdict


def open_barrier(job: JobState, now: float) -> BarrierState:
    """The barrier of the job's current generation, opened now if there is none yet."""
    b = job.barrier
    if b is None or b.generation != job.generation:
        b = job.barrier = BarrierState(generation=job.generation, opened_at=now)
    return b


def decide_arrival(job: JobState, rank: int, generation: int, now: float) -> list[Decision]:
    """Rank ``rank`` is ready for ``generation``: release everyone once all are."""
    g = job.generation
    if job.phase is JobPhase.STOPPED:
        return [Decision(Verdict.STOP, f"rank {rank} arrived at the barrier of a stopped job: "
                         f"{job.stop_reason}", g, targets=(rank,), exit_code=1, rank=rank)]
    if job.phase is JobPhase.SUCCEEDED or generation < g:
        return []  # stale: the rank was sent a RESTART to the current generation
    b = open_barrier(job, now)
    if b.released:
        return [Decision(Verdict.RELEASE_BARRIER, f"rank {rank} re-arrived at generation {g}, "
                         "already released", g, targets=(rank,), rank=rank)]
    if rank in b.arrived:
        return []
    b.arrived.add(rank)
    if b.first_arrival_at is None:
        b.first_arrival_at = now
    return _release_if_full(job, b)


def decide_hello(job: JobState, rank: int, generation: int, released_generation: int,
                 now: float) -> list[Decision]:
    """A (re)connecting agent: bring it to the job's generation, honour a done barrier.

    An agent behind the job's generation missed a RESTART (or is a replacement pod):
    it is told to REJOIN. An agent that says it was already released for the current
    generation proves that a previous arbiter completed this barrier.
    """
    g = job.generation
    if job.phase is JobPhase.STOPPED:
        return [Decision(Verdict.STOP, f"rank {rank} connected to a stopped job: "
                         f"{job.stop_reason}", g, targets=(rank,), exit_code=1, rank=rank)]
    if job.phase is JobPhase.SUCCEEDED:
        return []
    if generation < g:
        return [Decision(Verdict.REJOIN, f"rank {rank} is at generation {generation}; the job "
                         f"is at {g}: restart into it", g, targets=(rank,), rank=rank)]
    b = open_barrier(job, now)
    if released_generation >= g and not b.released:
        return [Decision(Verdict.RELEASE_BARRIER, f"rank {rank} already runs generation {g}: "
                         "its barrier was released before (arbiter restarted)", g)]
    return []


def barrier_expired(job: JobState, now: float, timeout: float) -> list[Decision]:
    """STOP the job when its barrier stays incomplete past ``timeout``, naming who is missing."""
    b = job.barrier
    if b is None or b.released or job.finished or now - b.opened_at < timeout:
        return []
    missing = sorted(set(range(job.world_size)) - b.arrived)
    shown = ", ".join(str(r) for r in missing[:20])
    if len(missing) > 20:
        shown += f" and {len(missing) - 20} more"
    return [Decision(Verdict.STOP, f"barrier of generation {b.generation} timed out after "
                     f"{timeout:.0f}s: {len(b.arrived)}/{job.world_size} ranks arrived; missing "
                     f"rank {shown} (is its pod running? see `ftagent status {job.job}`)",
                     job.generation, exit_code=1, rank=missing[0] if missing else None)]


def barrier_summary(job: JobState, now: float) -> str:
    """One line for status: where the barrier stands."""
    b = job.barrier
    if b is None:
        return ""
    if b.released:
        return f"generation {b.generation}: released"
    missing = sorted(set(range(job.world_size)) - b.arrived)
    head = ", ".join(str(r) for r in missing[:10]) + (" ..." if len(missing) > 10 else "")
    return (f"generation {b.generation}: {len(b.arrived)}/{job.world_size} arrived, open "
            f"{now - b.opened_at:.0f}s" + (f", waiting for rank {head}" if missing else ""))


def _release_if_full(job: JobState, b: BarrierState) -> list[Decision]:
    if len(b.arrived) < job.world_size:
        return []
    return [Decision(Verdict.RELEASE_BARRIER, f"all {job.world_size} ranks arrived: "
                     f"generation {b.generation} starts", b.generation)]
