"""The arbiter's side of the wire: a timeline entry as its message; the door for faults.

A decision's command is built where it is sent (``commands.command_for``, re-exported
here); what both sides convert (faults, progress, commands back into actions) is in
``ftagent.wire.convert``, the agents' faults checked and converted in one step there
(``checked_fault``: the one door for a rank's faults and a spare's).
"""

from __future__ import annotations

from ftagent.arbiter.commands import command_for
from ftagent.arbiter.timeline import Entry
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import checked_fault, command_to_action, fault_from_proto

__all__ = ["checked_fault", "command_for", "command_to_action", "entry_to_proto",
           "fault_from_proto"]


def entry_to_proto(e: Entry) -> pb.TimelineEntry:
    m = pb.TimelineEntry(seq=e.seq, ts=e.ts, job=e.job, namespace=e.namespace,
                         generation=e.generation, kind=e.kind, message=e.message,
                         fault_id=e.fault_id, action=e.action)
    if e.rank is not None:
        m.rank = e.rank
    for c in e.culprits:
        m.culprits.add(rank=c.rank, pod=c.pod, node=c.node)
    return m
