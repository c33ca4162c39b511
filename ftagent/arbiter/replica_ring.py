"""Where each rank's peer replica is kept: a ring by node, chosen by the arbiter.

Each agent started with ``--replica-listen`` says its holder's port (``Hello.replica_port``);
the arbiter pairs it with the address its stream comes from (never an address the agent
names, so a pod cannot point its job's replicas at a host of its choosing). Every rank's
replica then goes to a rank on the *next* node (nodes ordered by their lowest rank), so a
lost node's ranks find theirs one node on; with one node, the next rank's agent (the
replica survives a replaced pod, not a lost node). A warm spare holds replicas where a
rank has no holder on another node otherwise.

The choice is sticky: a rank keeps its holder while that holder's agent is still the one
advertising that address and sits on another node, so a replaced pod (a new node, a new
address) is told the holder its predecessor copied to and fetches its shard from there;
a rank whose holder is gone (its pod replaced) is given a new one and copies there next.
After an arbiter restart the ring is recomputed from the Hellos: for a job whose pods did
not move it is the same ring.

Pure: addresses in, the ring out. The book is kept per job (``JobState.replica_book``)
and recomputed only when an address changed, so a job of n ranks costs O(n log n) per
change, not per Hello.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_ADDRESS = 300  # "HOST:PORT" as the arbiter writes it (a peer string, bounded)


def replica_key(secret: bytes, namespace: str, job: str) -> bytes:
    """The key the agents of (namespace, job) prove to each other on their replica channel:
    the arbiter hands it to every stream it admitted for that job (Welcome); another job's
    is another key, so an agent of job B cannot push to, or fetch from, job A's holders."""
    msg = b"ftagent-replica-job/v1\0" + namespace.encode() + b"\0" + job.encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()


def address_of(stream_peer: str, port: int) -> str:
    """``HOST:PORT`` of an agent's holder: the host its gRPC stream comes from (grpc's
    ``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678``), the port it said; "" when either is not
    one (a unix socket, no port)."""
    if not 0 < port < 65536:
        return ""
    kind, _, rest = stream_peer.partition(":")
    if kind == "ipv4":
        host = rest.rsplit(":", 1)[0]
        return f"{host}:{port}" if host else ""
    if kind == "ipv6":
        host = rest.rsplit(":", 1)[0]
        host = host if host.startswith("[") else f"[{host}]"
        return f"{host}:{port}" if len(host) > 2 else ""
    return ""


@dataclass
class ReplicaBook:
    """One job's replica addresses and the ring the arbiter gave out."""

    ranks: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (node, addr)
    spares: dict[str, tuple[str, str]] = field(default_factory=dict)  # instance -> (node, addr)
    ring: dict[int, str] = field(default_factory=dict)  # rank -> its holder's address
    dirty: bool = False

    def rank_said(self, rank: int, node: str, address: str) -> None:
        """A rank's Hello (its holder's address; "" : it holds none)."""
        old = self.ranks.get(rank)
        if address:
            if old != (node, address):
                self.ranks[rank] = (node, address)
                self.dirty = True
        elif old is not None:
            del self.ranks[rank]
            self.dirty = True

    def spare_said(self, instance: str, node: str, address: str,
                   live: set[str]) -> None:
        """A spare's Hello; ``live``: the job's spares now (the others are forgotten)."""
        for gone in [i for i in self.spares if i not in live and i != instance]:
            del self.spares[gone]
            self.dirty = True
        if address and self.spares.get(instance) != (node, address):
            self.spares[instance] = (node, address)
            self.dirty = True

    def peers(self) -> Mapping[int, str]:
        """Each rank's holder (recomputed when an address changed)."""
        if self.dirty:
            self.ring = assign(self.ranks, self.spares, self.ring)
            self.dirty = False
        return self.ring

    def peer_of(self, rank: int, world_size: int) -> str:
        """``rank``'s holder for a Welcome: "" while not every rank said its address (the
        barrier's release carries the ring then: no recomputation per Hello at start)."""
        if not self.ranks or (self.dirty and len(self.ranks) < world_size):
            return ""
        return self.peers().get(rank, "")


def assign(ranks: Mapping[int, tuple[str, str]], spares: Mapping[str, tuple[str, str]],
           previous: Mapping[int, str]) -> dict[int, str]:
    """Each rank's holder: its previous one while still advertised on another node (or
    the only node), else a rank on the next node (nodes ordered by their lowest rank; the
    k-th rank of a node goes to the k-th of the next, round), else the next rank on the
    same node (one node), else a spare on another node, else none."""
    by_node: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_node.setdefault(ranks[r][0], []).append(r)
    nodes = sorted(by_node, key=lambda n: by_node[n][0])
    where = {n: i for i, n in enumerate(nodes)}
    pos = {r: k for rs in by_node.values() for k, r in enumerate(rs)}  # index on its node
    advertised = {a: n for n, a in ranks.values()} | {a: n for n, a in spares.values()}
    out: dict[int, str] = {}
    for r, (node, own) in ranks.items():
        prev = previous.get(r)
        if prev and prev != own and prev in advertised and \
                (advertised[prev] != node or len(nodes) == 1):
            out[r] = prev
            continue
        holder = ""
        if len(nodes) > 1:
            nxt = by_node[nodes[(where[node] + 1) % len(nodes)]]
            holder = ranks[nxt[pos[r] % len(nxt)]][1]
        elif len(by_node[node]) > 1:
            mates = by_node[node]
            holder = ranks[mates[(pos[r] + 1) % len(mates)]][1]
        if not holder or holder == own:
            holder = next((a for i, (n, a) in sorted(spares.items()) if n != node), "")
        if holder and holder != own:
            out[r] = holder
    return out
