"""Carrying a decision to the agents: one serialised command, queued on each target's stream.

A command waits in the rank's ``pending`` (one slot per kind: the newest life-cycle
command replaces older ones) until the agent acknowledges it, and is queued again when
the agent reconnects (``resend``). After an arbiter restart nothing is pending: agents'
Hellos (generation, restart count, released generation) rebuild what matters. This is
the connections' side of a decision; what it does to the job is ``state.apply``'s.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from ftagent.arbiter import convert, snapshots
from ftagent.arbiter.connection import Connection, FanOut, live
from ftagent.arbiter.state import (
    COMMANDS,
    SPARE_COMMANDS,
    Decision,
    JobState,
    RankState,
    Verdict,
)
from ftagent.metrics import ArbiterMetrics

_SLOTS = {Verdict.RESTART: "life", Verdict.REJOIN: "life", Verdict.STOP: "life",
          Verdict.REPLACE: "life", Verdict.RELEASE_BARRIER: "release",
          Verdict.DUMP_STACKS: "dump", Verdict.BUSY: "busy", Verdict.ASSIGN: "life",
          Verdict.RETIRE_SPARE: "life", Verdict.LAST_WORDS: "words"}
assert set(_SLOTS) == COMMANDS
_TIMED = (Verdict.RESTART, Verdict.REPLACE, Verdict.STOP, Verdict.DUMP_STACKS)
_RESUMING = (Verdict.RESTART, Verdict.REPLACE, Verdict.REJOIN)  # convert.command_for


def send(job: JobState, d: Decision, metrics: ArbiterMetrics | None,
         received: float | None = None) -> None:
    """Queue ``d``'s command on its targets' streams (every rank when it names none).
    ``received``: time.monotonic() when the fault that led to it arrived, for the
    fault-to-command histogram."""
    if d.verdict not in COMMANDS:
        return
    cid = uuid.uuid4().hex
    if d.verdict in SPARE_COMMANDS:  # to the spare's stream (it has no rank yet)
        sp = job.spares.get(d.spare)
        conn = live(sp.conn) if sp is not None else None
        if conn is not None:
            data = convert.command_for(d, cid, restarts=job.restarts).SerializeToString()
            if d.rank is not None:  # ASSIGN: where the rank's replica is kept
                data = snapshots.with_replica_peer(
                    data, snapshots.replica_peers(job, d.verdict).get(d.rank, ""))
            conn.send(data)
        return
    targets = d.targets or tuple(job.ranks)
    # every rank is told the same step; only commands that start a trainer carry it
    resume = snapshots.resume_step(job) if d.verdict in _RESUMING else None
    data = convert.command_for(d, cid, restarts=job.restarts,
                               resume_step=resume).SerializeToString()
    fan = None
    if received is not None and d.verdict in _TIMED and metrics:
        n = sum(1 for r in targets if (rs := job.ranks.get(r)) and rs.conn is not None)
        fan = FanOut(n, received, metrics.fault_to_command.observe) if n else None
    peers = snapshots.replica_peers(job, d.verdict)  # each rank's replica holder
    for r in targets:
        rs = job.ranks.get(r)
        if rs is None:
            continue
        if d.verdict is Verdict.REPLACE and r == d.rank:
            rid = cid + "-replace"
            _queue(rs, d.verdict, rid, convert.command_for(
                d, rid, replace=True, restarts=job.restarts,
                resume_step=resume).SerializeToString(), fan)
        else:
            _queue(rs, d.verdict, cid, snapshots.with_replica_peer(data, peers.get(r, "")),
                   fan)


def _queue(rs: RankState, verdict: Verdict, cid: str, data: bytes,
           fan: FanOut | None) -> None:
    slot = _SLOTS[verdict]
    if slot == "life":
        rs.pending.clear()
    rs.pending[slot] = (cid, data)
    if isinstance(rs.conn, Connection):  # connection.live, inline: once per rank
        rs.conn.send(data, fan)


def resend(rs: RankState) -> None:
    """What the rank was sent and did not acknowledge, again (after its Hello)."""
    conn = live(rs.conn)
    if conn is not None:
        for _, data in list(rs.pending.values()):
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


def settle(job: JobState, settled: Mapping[str, int], outcome: str) -> None:
    """A final FaultAck for each fault whose decision was open, to its rank."""
    for fid, rank in settled.items():
        rs = job.ranks.get(rank)
        conn = live(rs.conn) if rs is not None else None
        if conn is not None:
            conn.ack(fid, True, outcome)
