"""Carrying a decision to the agents: one serialised command, queued on each target's stream.

A command waits in the rank's ``pending`` (one slot per kind: the newest life-cycle
command replaces older ones) until the agent acknowledges it, and is queued again when
the agent reconnects (``resend``). After an arbiter restart nothing is pending: agents'
Hellos (generation, restart count, released generation) rebuild what matters. This is
the connections' side of a decision; what it does to the job is ``state.apply``'s.
The command is built here (``command_for``), once per decision whatever the number of
ranks: one serialisation, one read of the job's snapshots, one fan-out to the streams.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from ftagent.arbiter import snapshots
from ftagent.arbiter.connection import Connection, FanOut, live, send_all
from ftagent.arbiter.state import (
    COMMANDS,
    SPARE_COMMANDS,
    Decision,
    JobState,
    RankState,
    Verdict,
)
from ftagent.metrics import ArbiterMetrics
from ftagent.model import EXIT_REPLACE, IN_PLACE_EXITS
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import busy_to_proto

_SLOTS = {Verdict.RESTART: "life", Verdict.REJOIN: "life", Verdict.STOP: "life",
          Verdict.REPLACE: "life", Verdict.RELEASE_BARRIER: "release",
          Verdict.DUMP_STACKS: "dump", Verdict.BUSY: "busy", Verdict.ASSIGN: "life",
          Verdict.RETIRE_SPARE: "life", Verdict.LAST_WORDS: "words"}
assert set(_SLOTS) == COMMANDS
_TIMED = (Verdict.RESTART, Verdict.REPLACE, Verdict.STOP, Verdict.DUMP_STACKS)


# A fault's FaultAck to the agent that reported it: (its stream, fault id, final, outcome).
Answer = tuple[Connection, str, bool, str]


def send(job: JobState, d: Decision, metrics: ArbiterMetrics | None,
         received: float | None = None, settled: Sequence[tuple[str, int]] = (),
         answer: Answer | None = None) -> None:
    """Queue ``d``'s command on its targets' streams (every rank when it names none).
    ``received``: time.monotonic() when the fault that led to it arrived, for the
    fault-to-command histogram. ``settled``: the open faults ``d`` settled (``state.
    Settled``: (id, rank) each): a final FaultAck with ``d``'s outcome to each one's rank;
    ``answer``: the FaultAck of the fault ``d`` (the last of its decisions) is about, to
    its reporting agent. Both are queued after the command in the same fan-out (an agent
    that reads the final ack has read the commands it led to).

    Once per decision, whatever the number of ranks: the command is built and serialised
    once, what it carries of the job's snapshots is read once (``snapshots.carried``: the
    resume step, each rank's replica holder as bytes to append), and the streams get it
    in one fan-out (``connection.send_all``); per rank there is only the pending slot and
    the bytes' concatenation."""
    acks = _final_acks(job, settled, d.verdict.value) if settled else []
    if answer is not None:
        acks.append((answer[0], _fault_ack(*answer[1:])))
    if d.verdict not in COMMANDS:
        if acks:
            send_all((), None, acks)
        return
    cid = d.command_id or uuid.uuid4().hex  # a DUMP_STACKS': its probe's (jobs.execute)
    if d.verdict in SPARE_COMMANDS:  # to the spare's stream (it has no rank yet)
        sp = job.spares.get(d.spare)
        conn = live(sp.conn) if sp is not None else None
        out: list[tuple[Connection, bytes]] = []
        if conn is not None:
            data = command_for(d, cid, restarts=job.restarts).SerializeToString()
            if d.rank is not None:  # ASSIGN: where the rank's replica is kept
                data = snapshots.with_replica_peer(
                    data, snapshots.replica_peers(job, d.verdict).get(d.rank, ""))
            out.append((conn, data))
        if out or acks:
            send_all(out, None, acks)
        return
    targets = d.targets or tuple(job.ranks)
    # every rank is told the same step; only commands that start a trainer carry it, and
    # the replica holders only where the job's agents hold replicas: a command that
    # carries neither (a RELEASE or a DUMP_STACKS of a job without replicas) reads nothing
    if d.verdict in snapshots.RESUMING or (d.verdict in snapshots.REPLICA_CARRIED
                                           and job.replica_book.ranks):
        resume, peers = snapshots.carried(job, d.verdict)
    else:
        resume, peers = None, {}
    data = command_for(d, cid, restarts=job.restarts, resume_step=resume).SerializeToString()
    fan = None
    if received is not None and d.verdict in _TIMED and metrics:
        n = sum(1 for r in targets if (rs := job.ranks.get(r)) and rs.conn is not None)
        fan = FanOut(n, received, metrics.fault_to_command.observe) if n else None
    slot = _SLOTS[d.verdict]
    out = []
    for r in targets:
        rs = job.ranks.get(r)
        if rs is None:
            continue
        if d.verdict is Verdict.REPLACE and r == d.rank:
            rid = cid + "-replace"
            mine = command_for(d, rid, replace=True, restarts=job.restarts,
                               resume_step=resume).SerializeToString()
        else:
            rid, mine = cid, data + peers.get(r, b"")  # protobuf merges the appended field
        if slot == "life":
            rs.pending.clear()
        rs.pending[slot] = (rid, mine)
        if isinstance(rs.conn, Connection):  # connection.live, inline: once per rank
            out.append((rs.conn, mine))
    send_all(out, fan, acks)


def resend(rs: RankState) -> None:
    """What the rank was sent and did not acknowledge, again (after its Hello)."""
    conn = live(rs.conn)
    if conn is not None:
        for _, data in list(rs.pending.values()):
            conn.send(data)


def ask_stacks(job: JobState, rs: RankState) -> None:
    """The job's open hang probe's DUMP_STACKS to ``rs``, a rank that owes it an answer
    and does not hold it (after its Hello): a rank first heard of during the probe (its
    agent came up late, or every agent reconnects to an arbiter restarted mid-probe: the
    probe re-raised by the fault its agent sends again reached only the ranks back by
    then), or one whose agent acknowledged it before its stream broke. Without it the
    probe waited for its deadline (--stacks-timeout) to decide a job hang. The probe's
    own command, as ``send`` built it: its id (the answer counts only with it,
    jobs.stacks; an agent acts once on a command id, so the agent that already answered
    does not capture again) and its reason; kept in the rank's slot as any command, so
    ``resend`` carries it after a reconnect. O(1): one rank, one command."""
    probe = job.hang_probe
    if probe is None or rs.stack is not None or not probe.command_id:
        return
    held = rs.pending.get(_SLOTS[Verdict.DUMP_STACKS])
    if held is not None and held[0] == probe.command_id:
        return  # unacknowledged: ``resend`` sent it again
    d = Decision(Verdict.DUMP_STACKS, probe.reason, job.generation, rank=probe.rank,
                 fault_id=probe.fault_id, until=probe.deadline,
                 command_id=probe.command_id)
    data = command_for(d, probe.command_id).SerializeToString()
    rs.pending[_SLOTS[Verdict.DUMP_STACKS]] = (probe.command_id, data)
    conn = live(rs.conn)
    if conn is not None:
        conn.send(data)


def forget_replace(rs: RankState) -> None:
    """Drop an unacknowledged REPLACE of this rank's pod (a new pod holds the rank now)."""
    for slot, (cid, _) in list(rs.pending.items()):
        if cid.endswith("-replace"):
            del rs.pending[slot]


def acked(rs: RankState, command_id: str) -> None:
    for slot, (cid, _) in list(rs.pending.items()):
        if cid == command_id:
            del rs.pending[slot]


def _final_acks(job: JobState, settled: Sequence[tuple[str, int]],
                outcome: str) -> list[tuple[Connection, bytes]]:
    """A final FaultAck for each fault whose decision was open, to its rank's stream
    (``outcome``: the settling decision's verdict, a name far within a FaultAck's bound)."""
    out = []
    for fid, rank in settled:
        rs = job.ranks.get(rank)
        if rs is not None and isinstance(rs.conn, Connection):  # connection.live, inline
            out.append((rs.conn, _fault_ack(fid, True, outcome)))
    return out


def _fault_ack(fault_id: str, final: bool, outcome: str) -> bytes:
    """A FaultAck, serialised: ``outcome`` is a verdict's name (``Connection.ack`` bounds
    any other outcome); ``fault_id`` was checked where the fault came in."""
    return pb.ArbiterMessage(fault_ack=pb.FaultAck(
        fault_id=fault_id, final=final, outcome=outcome)).SerializeToString()


# ---------------------------------------------------------------- the command a decision sends

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
