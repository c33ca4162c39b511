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
and recomputed only when an address changed and the ring is read: a job of n ranks
costs O(n log n) when its shape changes (ranks added or gone, spares), and a few ranks'
worth when one rank's pod comes back with a new address or on a new node (every pod of
a job recreated: n such steps, not n passes over n ranks).
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
from collections.abc import Callable, Mapping
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
    """One job's replica addresses and the ring the arbiter gave out.

    The ring is what ``assign`` makes of the addresses, recomputed when one changed (a
    Hello) and read: a whole pass where more changed (ranks added or gone, spares, several
    ranks between two reads, an address two agents share, a job on one node), else only
    the ranks one rank's new address or node can move (``_one_moved``: it and the ranks
    whose holder it was), so a job whose n pods all come back with new addresses
    costs n small steps, not n passes over n ranks."""

    ranks: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (node, addr)
    spares: dict[str, tuple[str, str]] = field(default_factory=dict)  # instance -> (node, addr)
    ring: dict[int, str] = field(default_factory=dict)  # rank -> its holder's address
    dirty: bool = False
    # the shape the ring was computed on, and who holds at each address (None: no ring
    # computed yet); the one rank whose (node, address) changed since, and what it was
    # (None while dirty: more changed, the next ring is a whole pass)
    _shape: _Shape | None = field(default=None, repr=False, compare=False)
    _held_by: dict[str, set[int]] = field(default_factory=dict, repr=False, compare=False)
    _moved: tuple[int, tuple[str, str]] | None = field(default=None, repr=False,
                                                       compare=False)

    def rank_said(self, rank: int, node: str, address: str) -> None:
        """A rank's Hello (its holder's address; "" : it holds none)."""
        old = self.ranks.get(rank)
        if address:
            if old != (node, address):
                # one known rank moved since the last ring: a step (``_one_moved``)
                self._moved = (rank, old) if old is not None and not self.dirty \
                    and self._shape is not None else None
                self.ranks[rank] = (node, address)
                self.dirty = True
        elif old is not None:
            del self.ranks[rank]
            self.dirty, self._moved = True, None

    def spare_said(self, instance: str, node: str, address: str,
                   live: set[str]) -> None:
        """A spare's Hello; ``live``: the job's spares now (the others are forgotten)."""
        for gone in [i for i in self.spares if i not in live and i != instance]:
            del self.spares[gone]
            self.dirty, self._moved = True, None
        if address and self.spares.get(instance) != (node, address):
            self.spares[instance] = (node, address)
            self.dirty, self._moved = True, None

    def peers(self) -> Mapping[int, str]:
        """Each rank's holder (recomputed when an address changed)."""
        if self.dirty:
            if self._moved is None or not self._one_moved(*self._moved):
                self._shape = _Shape(self.ranks, self.spares)
                self.ring = self._shape.assign(self.ranks, self.ring)
                self._held_by = {}
                for r, a in self.ring.items():
                    self._held_by.setdefault(a, set()).add(r)
            self.dirty, self._moved = False, None
        return self.ring

    def peer_of(self, rank: int, world_size: int) -> str:
        """``rank``'s holder for a Welcome: "" while not every rank said its address (the
        barrier's release carries the ring then: no recomputation per Hello at start)."""
        if not self.ranks or (self.dirty and len(self.ranks) < world_size):
            return ""
        return self.peers().get(rank, "")

    def _one_moved(self, rank: int, was: tuple[str, str]) -> bool:
        """The ring after ``rank`` alone changed from ``was`` (node, address), as a whole
        pass (``assign``) would make it. False (nothing changed) where only a whole pass
        can say: an address two agents advertise, a job on one node before or after.

        Else every rank has a holder on another node (its next node's rank), and a whole
        pass keeps each one's while it is advertised from another node than the rank's:
        it changes only for ``rank`` and the ranks whose holder it was (its old address
        gone, or its node moved: no rank holds at its new address yet), O(1) ranks, not n."""
        shape = self._shape
        assert shape is not None
        node, address = self.ranks[rank]
        old_node, old_address = was
        if shape.shared or (address != old_address and address in shape.advertised):
            return False
        left = len(shape.by_node[old_node]) == 1 and old_node != node
        joined = node not in shape.by_node
        if len(shape.by_node) <= 1 or len(shape.by_node) - left + joined <= 1:
            return False
        shape.move(rank, was, (node, address))
        affected = {rank} | self._held_by.get(old_address, set())
        now = {r: shape.holder(r, self.ranks[r], self.ring.get(r)) for r in affected}
        for r, holder in now.items():
            before = self.ring.pop(r, None)
            if before:
                held = self._held_by[before]
                held.discard(r)
                if not held:
                    del self._held_by[before]
            if holder:
                self.ring[r] = holder
                self._held_by.setdefault(holder, set()).add(r)
        return True


class _Shape:
    """What ``assign`` reads besides a rank's own (node, address) and previous holder:
    the ranks of each node in order, the nodes in order of their lowest rank, the node
    each address is advertised from (ranks', then spares': the last one wins), the spares
    in order. Kept by the book and moved one rank at a time (``move``); a node's next
    one and a rank's place on its node are found by bisection, O(log n)."""

    def __init__(self, ranks: Mapping[int, tuple[str, str]],
                 spares: Mapping[str, tuple[str, str]]) -> None:
        self.by_node: dict[str, list[int]] = {}
        for r in sorted(ranks):
            self.by_node.setdefault(ranks[r][0], []).append(r)
        self.lowest = sorted(rs[0] for rs in self.by_node.values())  # one per node
        self.node_of_lowest = {rs[0]: n for n, rs in self.by_node.items()}
        self.advertised = {a: n for n, a in ranks.values()} | \
            {a: n for n, a in spares.values()}
        # addresses more than one agent advertises (a rank's holder may then be none)
        self.shared = len(ranks) + len(spares) - len(self.advertised)
        self.spares = sorted(spares.items())
        self.addresses = {r: a for r, (_, a) in ranks.items()}

    def after(self, node: str) -> str:
        """The node after ``node`` in the ring (the first after the last)."""
        i = bisect.bisect_right(self.lowest, self.by_node[node][0])
        return self.node_of_lowest[self.lowest[i % len(self.lowest)]]

    def move(self, rank: int, was: tuple[str, str], now: tuple[str, str]) -> None:
        """``rank`` moved from ``was`` to ``now`` (node, address), each address advertised
        by it alone."""
        (old_node, old_address), (node, address) = was, now
        del self.advertised[old_address]
        self.advertised[address] = node
        self.addresses[rank] = address
        if node == old_node:
            return
        self._renamed(old_node, lambda rs: rs.remove(rank))
        self._renamed(node, lambda rs: bisect.insort(rs, rank))

    def _renamed(self, node: str, change: Callable[[list[int]], None]) -> None:
        """Change ``node``'s ranks, keeping the nodes' order by their lowest rank."""
        rs = self.by_node.setdefault(node, [])
        if rs:
            self.lowest.pop(bisect.bisect_left(self.lowest, rs[0]))
            del self.node_of_lowest[rs[0]]
        change(rs)
        if rs:
            bisect.insort(self.lowest, rs[0])
            self.node_of_lowest[rs[0]] = node
        else:
            del self.by_node[node]

    def holder(self, r: int, said: tuple[str, str], prev: str | None) -> str:
        """Rank ``r``'s holder ("" none), as ``assign`` says."""
        node, own = said
        one_node = len(self.by_node) == 1
        if prev and prev != own and prev in self.advertised and \
                (self.advertised[prev] != node or one_node):
            return prev
        holder = ""
        mates = self.by_node[node]
        pos = bisect.bisect_left(mates, r)  # its index on its node
        if not one_node:
            nxt = self.by_node[self.after(node)]
            holder = self.addresses[nxt[pos % len(nxt)]]
        elif len(mates) > 1:
            holder = self.addresses[mates[(pos + 1) % len(mates)]]
        if not holder or holder == own:
            holder = next((a for _, (n, a) in self.spares if n != node), "")
        return holder if holder != own else ""

    def assign(self, ranks: Mapping[int, tuple[str, str]],
               previous: Mapping[int, str]) -> dict[int, str]:
        out: dict[int, str] = {}
        for r, said in ranks.items():
            holder = self.holder(r, said, previous.get(r))
            if holder:
                out[r] = holder
        return out


def assign(ranks: Mapping[int, tuple[str, str]], spares: Mapping[str, tuple[str, str]],
           previous: Mapping[int, str]) -> dict[int, str]:
    """Each rank's holder: its previous one while still advertised on another node (or
    the only node), else a rank on the next node (nodes ordered by their lowest rank; the
    k-th rank of a node goes to the k-th of the next, round), else the next rank on the
    same node (one node), else a spare on another node, else none."""
    return _Shape(ranks, spares).assign(ranks, previous)
