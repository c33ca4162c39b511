"""Range checks of the messages a peer sends, where they enter (the arbiter's registry).

Every field is checked against ``limits`` before it becomes state, so that one hostile or
broken message is refused with a status that names the field (INVALID_ARGUMENT), and
nothing a peer sends can make the listing of other jobs fail (a generation of 2**63-1
would overflow int64 on its next +1). A fault's check lives with its decoding
(``wire.convert.check_fault``, re-exported here): one call checks and converts it.
"""

from __future__ import annotations

import math

import grpc

from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits
from ftagent.wire.convert import check_fault

__all__ = ["Refused", "check_fault", "check_generation_claim", "check_hello", "check_message",
           "check_node_report", "progress_in_range", "snapshot_steps"]


class Refused(ValueError):
    """A message the arbiter will not take; the stream ends with ``code``."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str) -> None:
        super().__init__(details)
        self.code = code
        self.reason = reason  # label of ftagent_arbiter_rejected_requests


def _invalid(e: ValueError, what: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {e}", "out_of_range")


def check_hello(h: pb.Hello) -> None:
    """Raises Refused for a Hello no agent of this release would send."""
    if not h.job:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "Hello without a job name: start the "
                      "agent with --job", "bad_hello")
    if not 1 <= h.world_size <= limits.MAX_WORLD_SIZE or not 0 <= h.rank < h.world_size:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"rank {h.rank} of world size "
                      f"{h.world_size} is out of range: check --rank/--world-size", "bad_hello")
    try:
        limits.check_name("job", h.job)
        limits.check_name("namespace", h.namespace)
        limits.check_name("pod", h.pod)
        limits.check_name("node", h.node)
        limits.check_name("state", h.state, 32)
        limits.check_name("agent_instance", h.agent_instance, limits.MAX_ID)
        limits.check_name("agent_version", h.agent_version, 64)
        limits.check_int("the number of gpus", len(h.gpus), 0, limits.MAX_GPUS)
        for g in h.gpus:
            limits.check_name("gpus", g, limits.MAX_GPU_ID)
        limits.check_int("generation", h.generation, 0, limits.MAX_GENERATION)
        limits.check_int("restart_count", h.restart_count, 0, limits.MAX_RESTARTS)
        if h.HasField("max_restarts"):
            limits.check_int("max_restarts", h.max_restarts, 0, limits.MAX_RESTARTS)
        if h.HasField("released_generation"):
            limits.check_int("released_generation", h.released_generation, -1,
                             limits.MAX_GENERATION)
    except limits.OutOfRange as e:
        raise _invalid(e, "Hello") from None


def check_generation_claim(h: pb.Hello, job_generation: int) -> None:
    """Raises Refused for a Hello that would raise its job's generation above
    ``limits.MAX_CLAIMED_GENERATION``: the job's own generation (what this arbiter
    commanded) is echoed freely, but a peer's claim above it is capped below the ceiling,
    so the generations the arbiter adds on restarts never reach ``MAX_GENERATION`` and the
    real agents' messages stay in range (issue 20: a Hello at 2**31-1 locked them out)."""
    ceiling = max(job_generation, limits.MAX_CLAIMED_GENERATION)
    claimed = max(h.generation, h.released_generation if h.HasField("released_generation")
                  else -1)
    if claimed > ceiling:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"Hello: generation {claimed} is "
                      f"above the job's {job_generation} and the highest a peer may raise "
                      f"it to ({limits.MAX_CLAIMED_GENERATION})", "out_of_range")


def check_message(m: pb.AgentMessage) -> None:
    """The generations and ids of a message after Hello within their ranges.

    Not faults: the registry records one out of range as ignored and acknowledges it as
    final (``wire.checks.check_fault``), so the agent stops re-sending it.
    """
    body = m.WhichOneof("body")
    if body == "arrival":
        limits.check_generation("BarrierArrival.generation", m.arrival.generation)
    elif body == "exit":
        limits.check_generation("TrainerExit.generation", m.exit.generation)
    elif body == "ack":
        limits.check_name("Ack.command_id", m.ack.command_id, limits.MAX_ID)
    elif body == "stacks":
        limits.check_name("Stacks.command_id", m.stacks.command_id, limits.MAX_ID)


def check_node_report(r: pb.NodeReport) -> None:
    """Raises Refused (INVALID_ARGUMENT, the whole report) for a NodeReport no node agent of
    this release sends: no or a bad node name, too many faults, a fault out of range. A
    node agent clips what it sends (``convert.fault_to_proto``), so a refusal is a bug or
    a hostile peer; refusing it whole keeps the arbiter from deciding half of it."""
    try:
        limits.check_name("NodeReport.node", r.node, required=True)
        limits.check_name("NodeReport.agent_instance", r.agent_instance, limits.MAX_ID)
        limits.check_name("NodeReport.agent_version", r.agent_version, 64)
        if len(r.faults) > limits.MAX_NODE_FAULTS:
            raise limits.OutOfRange(f"NodeReport carries {len(r.faults)} faults; at most "
                                    f"{limits.MAX_NODE_FAULTS} (send the rest in the next)")
        for f in r.faults:
            check_fault(f)
            if f.kind == pb.FAULT_KIND_UNSPECIFIED:
                raise limits.OutOfRange(f"fault {f.id} has no kind")
    except limits.OutOfRange as e:
        raise _invalid(e, "NodeReport") from None


def progress_in_range(p: pb.ProgressSummary) -> bool:
    """False for a summary with a step or rate no trainer has (it is dropped)."""
    return (-1 <= p.step <= limits.MAX_STEP
            and all(math.isfinite(v) and v >= 0 for v in (
                p.samples_per_second, p.tokens_per_second, p.seconds_since_progress))
            and (not p.HasField("loss") or not math.isinf(p.loss))
            and all(0 <= v <= limits.MAX_SECONDS for v in (   # NaN fails too
                p.step_seconds, p.collective_seconds, p.data_seconds))
            and 0 <= p.timed_steps <= limits.MAX_TIMED_STEPS
            and (not p.HasField("resumed_step") or 0 <= p.resumed_step <= limits.MAX_STEP)
            and all(0 <= v <= limits.MAX_TOTAL_SECONDS for v in (   # NaN fails too
                p.checkpoint_seconds, p.other_phase_seconds))
            and p.resume_source in RESUME_SOURCES_OR_NONE)


RESUME_SOURCES_OR_NONE = ("", "memory", "peer", "disk")
MAX_SNAPSHOTS_REPORTED = 8  # steps one SnapshotReport may name


def snapshot_steps(m: pb.SnapshotReport) -> tuple[int, ...] | None:
    """The steps a rank says it holds a complete snapshot of, sorted and distinct; None
    (the report is dropped) for more than ``MAX_SNAPSHOTS_REPORTED`` or a step out of
    range. What a rank says only ever picks among the steps every rank holds: a rank that
    lies can make its own job resume at a step it does not have (its load then falls to
    disk), never touch another job."""
    if len(m.steps) > MAX_SNAPSHOTS_REPORTED or not all(
            0 <= s <= limits.MAX_STEP for s in m.steps):
        return None
    return tuple(sorted(set(m.steps)))
