"""The arbiter's side of the wire: a decision as the command it sends, a timeline entry.

What both sides convert (faults, progress, commands back into actions) is in
``ftagent.wire.convert``.
"""

from __future__ import annotations

from ftagent.arbiter.state import Decision, Verdict
from ftagent.arbiter.timeline import Entry
from ftagent.model import EXIT_REPLACE, IN_PLACE_EXITS, Fault
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.checks import check_fault
from ftagent.wire.convert import busy_to_proto, command_to_action, fault_from_proto

__all__ = ["checked_fault", "command_for", "command_to_action", "entry_to_proto",
           "fault_from_proto"]


def checked_fault(m: pb.Fault) -> Fault:
    """An agent's fault, its fields bounded (``check_fault``) before it is converted: the
    one door for a rank's faults and a spare's. ValueError for an unusable one."""
    check_fault(m)
    return fault_from_proto(m)


_COMMAND_KINDS = {
    Verdict.RESTART: pb.COMMAND_KIND_RESTART,
    Verdict.REJOIN: pb.COMMAND_KIND_RESTART,
    Verdict.STOP: pb.COMMAND_KIND_STOP,
    Verdict.RELEASE_BARRIER: pb.COMMAND_KIND_RELEASE_BARRIER,
    Verdict.DUMP_STACKS: pb.COMMAND_KIND_DUMP_STACKS,
    Verdict.REPLACE: pb.COMMAND_KIND_REPLACE,
    Verdict.BUSY: pb.COMMAND_KIND_BUSY,
    Verdict.ASSIGN: pb.COMMAND_KIND_ASSIGN,
    Verdict.RETIRE_SPARE: pb.COMMAND_KIND_REPLACE,  # the spare's pod moves
    Verdict.LAST_WORDS: pb.COMMAND_KIND_LAST_WORDS,
}


def command_for(d: Decision, command_id: str, *, replace: bool = False,
                restarts: int | None = None, resume_step: int | None = None
                ) -> pb.ArbiterMessage:
    """The command a decision sends; for REPLACE, ``replace`` picks the target's variant.
    ``restarts``: the job's restart count once ``d`` is applied (restarting commands).
    ``resume_step``: the newest step whose snapshot every rank holds (restarting ones)."""
    kind = _COMMAND_KINDS[d.verdict]
    cmd = pb.Command(id=command_id, kind=kind, generation=d.generation, reason=d.reason,
                     fault_id=d.fault_id)
    if restarts is not None and d.verdict in (Verdict.RESTART, Verdict.REPLACE,
                                              Verdict.REJOIN, Verdict.ASSIGN):
        cmd.restarts = restarts
    if resume_step is not None and d.verdict in (Verdict.RESTART, Verdict.REPLACE,
                                                 Verdict.REJOIN):
        cmd.resume_step = resume_step
    if d.verdict is Verdict.RETIRE_SPARE:
        cmd.exit_code = EXIT_REPLACE
    elif d.verdict is Verdict.REPLACE:
        if replace:  # an in-place tier's own code (arbiter/ladder.py), else move the pod
            cmd.exit_code = d.exit_code if d.exit_code in IN_PLACE_EXITS else EXIT_REPLACE
        else:
            cmd.kind = pb.COMMAND_KIND_RESTART
        if d.rank is not None:
            cmd.target_rank = d.rank  # model.Action: the rank being replaced
    elif d.verdict is Verdict.ASSIGN and d.rank is not None:
        cmd.target_rank = d.rank  # the rank the spare becomes
    elif d.exit_code is not None and d.verdict is Verdict.STOP:
        cmd.exit_code = d.exit_code
    elif d.busy is not None and d.verdict is Verdict.BUSY:
        cmd.busy.CopyFrom(busy_to_proto(d.busy))
    return pb.ArbiterMessage(command=cmd)


def entry_to_proto(e: Entry) -> pb.TimelineEntry:
    m = pb.TimelineEntry(seq=e.seq, ts=e.ts, job=e.job, namespace=e.namespace,
                         generation=e.generation, kind=e.kind, message=e.message,
                         fault_id=e.fault_id, action=e.action)
    if e.rank is not None:
        m.rank = e.rank
    for c in e.culprits:
        m.culprits.add(rank=c.rank, pod=c.pod, node=c.node)
    return m
