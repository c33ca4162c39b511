"""The newest step a job can resume from memory: every rank's snapshot of it is complete.

Each rank's agent says which steps its trainer holds a complete in-memory snapshot of
(``SnapshotReport``, ``ftagent.checkpoint``); a step is usable only when every rank of the
job holds it, so the resume step is the newest step in all of them. Pure: it reads the
ranks' last reports and nothing else. A rank that never reported, or a job whose ranks
are not all known yet, has none.

The peer replica's ring (where each rank's shard is copied, replica_ring.py) is handed to
the agents here too: the job's replica key and each rank's holder in Welcome, the holder
again in every command that (re)starts a trainer.
"""

from __future__ import annotations

from collections.abc import Mapping

from ftagent.arbiter import replica_ring
from ftagent.arbiter.state import JobState, Verdict
from ftagent.v1 import ftagent_pb2 as pb


def resume_step(job: JobState) -> int | None:
    """The newest step every rank of ``job`` (0..world_size-1) holds (None: none)."""
    held = []
    for r in range(job.world_size):
        rs = job.ranks.get(r)
        if rs is None or not rs.snapshot_steps:
            return None
        held.append(set(rs.snapshot_steps))
    common = set.intersection(*held) if held else set()
    return max(common) if common else None


# ---------------------------------------------------------------- the peer replica's ring

# the commands that (re)start a rank's trainer: each carries that rank's replica holder
REPLICA_CARRIED = (Verdict.RELEASE_BARRIER, Verdict.RESTART, Verdict.REPLACE,
                   Verdict.REJOIN, Verdict.ASSIGN)


def hello_replica(job: JobState, rank: int, node: str, stream_peer: str, port: int) -> None:
    """A rank's Hello: its holder's address (the stream's host, the port it said)."""
    if port or job.replica_book.ranks:
        job.replica_book.rank_said(rank, node, replica_ring.address_of(stream_peer, port))


def spare_replica(job: JobState, instance: str, node: str, stream_peer: str,
                  port: int) -> None:
    """A spare's Hello: it may hold replicas (where a rank has no other node's holder)."""
    if port or job.replica_book.spares:
        job.replica_book.spare_said(instance, node, replica_ring.address_of(stream_peer, port),
                                    set(job.spares))


def welcome_replica(welcome: pb.Welcome, job: JobState, rank: int | None,
                    secret: bytes) -> None:
    """Fill ``welcome``'s replica fields for ``rank`` (None: a spare, no rank yet): the
    job's key, to a stream the arbiter admitted for this job, and the rank's holder where
    known. Nothing for a job none of whose agents holds replicas."""
    book = job.replica_book
    if not book.ranks and not book.spares:
        return
    welcome.replica_key = replica_ring.replica_key(secret, job.namespace, job.job)
    if rank is not None:
        welcome.replica_peer = book.peer_of(rank, job.world_size)


def replica_peers(job: JobState, verdict: Verdict) -> Mapping[int, str]:
    """Each rank's holder, for a command of ``verdict`` that carries it (else none)."""
    if verdict not in REPLICA_CARRIED or not job.replica_book.ranks:
        return {}
    return job.replica_book.peers()


# the commands that restart a trainer: each carries the step every rank resumes from
RESUMING = (Verdict.RESTART, Verdict.REPLACE, Verdict.REJOIN)


def carried(job: JobState, verdict: Verdict) -> tuple[int | None, Mapping[int, bytes]]:
    """What a command of ``verdict`` carries of the job's snapshots, read once per
    decision (commands.send): the resume step (restarting commands, ``resume_step``) and,
    per rank with a holder, its ``replica_peer`` field serialised, to append to the
    command's bytes (``with_replica_peer``)."""
    resume = resume_step(job) if verdict in RESUMING else None
    peers = replica_peers(job, verdict)
    return resume, {r: _peer_field(a) for r, a in peers.items() if a} if peers else {}


def with_replica_peer(data: bytes, peer: str) -> bytes:
    """A serialised ArbiterMessage(command=...) with ``replica_peer`` set: protobuf merges
    a concatenation field by field, so the rank's one field is appended to the bytes
    serialised once for every rank (a command to n ranks costs no n serialisations)."""
    return data + _peer_field(peer) if peer else data


def _peer_field(peer: str) -> bytes:
    return pb.ArbiterMessage(command=pb.Command(replica_peer=peer)).SerializeToString()


def replica_summary(job: JobState) -> str:
    """One line for ``ftagent status``: how the job's replicas are placed ("" : none)."""
    book = job.replica_book
    if not book.ranks:
        return ""
    nodes = {node for node, _ in book.ranks.values()}
    ring = book.peers()
    kind = f"ring by node over {len(nodes)} nodes" if len(nodes) > 1 else \
        "ring by rank on one node (a lost node loses them)"
    at_spares = {a for _, a in book.spares.values()}
    spares = sum(1 for a in ring.values() if a in at_spares)
    return (f"{kind}: {len(ring)} of {job.world_size} ranks have a holder"
            + (f" ({spares} on warm spares)" if spares else ""))
