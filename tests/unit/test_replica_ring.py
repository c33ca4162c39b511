"""The arbiter's ring of peer replicas (arbiter/replica_ring.py), its hand-out
(arbiter/snapshots.py) and the agent's end (agent/link_protocol.py): pure, no I/O."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftagent.agent.link_protocol import LinkProtocol
from ftagent.arbiter import replica_ring, snapshots
from ftagent.arbiter.replica_ring import ReplicaBook, address_of, assign, replica_key
from ftagent.arbiter.state import JobState, Verdict
from ftagent.config import IdentityConfig
from ftagent.v1 import ftagent_pb2 as pb


def _ranks(layout: dict[str, list[int]]) -> dict[int, tuple[str, str]]:
    return {r: (node, f"10.0.0.{r}:7000") for node, rs in layout.items() for r in rs}


def test_each_rank_goes_to_a_rank_on_the_next_node() -> None:
    ranks = _ranks({"node-a": [0, 1], "node-b": [2, 3], "node-c": [4, 5]})
    ring = assign(ranks, {}, {})
    assert ring == {0: "10.0.0.2:7000", 1: "10.0.0.3:7000", 2: "10.0.0.4:7000",
                    3: "10.0.0.5:7000", 4: "10.0.0.0:7000", 5: "10.0.0.1:7000"}
    assert all(ranks[r][0] != next(n for n, a in ranks.values() if a == h)
               for r, h in ring.items())  # never on its own node


def test_uneven_nodes_wrap_round_their_ranks() -> None:
    ring = assign(_ranks({"node-a": [0, 1, 2], "node-b": [3]}), {}, {})
    assert ring == {0: "10.0.0.3:7000", 1: "10.0.0.3:7000", 2: "10.0.0.3:7000",
                    3: "10.0.0.0:7000"}


def test_one_node_rings_by_rank_and_one_rank_has_no_holder() -> None:
    assert assign(_ranks({"n": [0, 1, 2]}), {}, {}) == {
        0: "10.0.0.1:7000", 1: "10.0.0.2:7000", 2: "10.0.0.0:7000"}
    assert assign(_ranks({"n": [0]}), {}, {}) == {}


def test_a_spare_holds_where_no_other_node_has_a_rank() -> None:
    ranks = _ranks({"n": [0]})
    assert assign(ranks, {"sp": ("node-9", "10.0.9.9:7000")}, {}) == {0: "10.0.9.9:7000"}
    assert assign(ranks, {"sp": ("n", "10.0.9.9:7000")}, {}) == {}  # not on its own node


def test_a_replaced_pod_keeps_the_holder_its_predecessor_copied_to() -> None:
    ranks = _ranks({"node-a": [0], "node-b": [1], "node-c": [2]})
    before = assign(ranks, {}, {})
    assert before[1] == "10.0.0.2:7000"
    # rank 1's pod is replaced onto node-d, with another address: the node order would
    # move, but rank 1 still fetches from (and copies to) rank 2's agent
    ranks[1] = ("node-d", "10.0.1.1:7000")
    after = assign(ranks, {}, before)
    assert after[1] == before[1]
    # whoever held a replica at rank 1's old address is given a live holder
    assert after[0] == "10.0.1.1:7000" and after[2] == before[2]


def test_a_holder_that_moved_onto_the_ranks_node_is_replaced() -> None:
    ranks = _ranks({"node-a": [0], "node-b": [1]})
    before = assign(ranks, {}, {})
    ranks[1] = ("node-a", "10.0.0.1:7000")  # rank 0's holder now on rank 0's node
    ranks[2] = ("node-c", "10.0.0.2:7000")
    assert assign(ranks, {}, before)[0] == "10.0.0.2:7000"


@pytest.mark.parametrize("peer, port, want", [
    ("ipv4:10.1.2.3:45678", 7000, "10.1.2.3:7000"),
    ("ipv6:[::1]:45678", 7000, "[::1]:7000"),
    ("ipv6:[fd00::5]:1", 9, "[fd00::5]:9"),
    ("unix:/tmp/sock", 7000, ""),
    ("ipv4:10.1.2.3:45678", 0, ""),
    ("ipv4:10.1.2.3:45678", 70000, ""),
    ("", 7000, ""),
])
def test_the_address_is_the_streams_host_never_one_the_agent_names(
        peer: str, port: int, want: str) -> None:
    assert address_of(peer, port) == want


def test_each_job_has_its_own_key() -> None:
    secret = b"s" * 32
    a = replica_key(secret, "ns", "job-a")
    assert len(a) == 32 and a == replica_key(secret, "ns", "job-a")
    assert a != replica_key(secret, "ns", "job-b")
    assert a != replica_key(secret, "other", "job-a")
    assert a != replica_key(b"t" * 32, "ns", "job-a")  # another arbiter's secret


def _welcome(job: JobState, rank: int | None) -> pb.Welcome:
    w = pb.Welcome()
    snapshots.welcome_replica(w, job, rank, b"s" * 32)
    return w


def test_welcome_says_nothing_for_a_job_without_replicas() -> None:
    job = JobState(job="j", world_size=2)
    snapshots.hello_replica(job, 0, "n0", "ipv4:10.0.0.1:5", 0)
    assert _welcome(job, 0) == pb.Welcome()
    assert snapshots.replica_peers(job, Verdict.RELEASE_BARRIER) == {}


def test_the_ring_is_given_once_every_rank_said_its_address() -> None:
    job = JobState(job="j", namespace="ns", world_size=2)
    snapshots.hello_replica(job, 0, "n0", "ipv4:10.0.0.1:5", 7000)
    assert _welcome(job, 0) == pb.Welcome(replica_key=replica_key(b"s" * 32, "ns", "j"))
    snapshots.hello_replica(job, 1, "n1", "ipv4:10.0.0.2:6", 7001)
    assert _welcome(job, 1).replica_peer == "10.0.0.1:7000"
    assert _welcome(job, None).replica_peer == ""  # a spare: no rank yet
    assert snapshots.replica_peers(job, Verdict.RELEASE_BARRIER) == {
        0: "10.0.0.2:7001", 1: "10.0.0.1:7000"}
    assert snapshots.replica_peers(job, Verdict.DUMP_STACKS) == {}


def test_a_spare_is_welcomed_with_the_key_and_forgotten_when_gone() -> None:
    job = JobState(job="j", world_size=1)
    snapshots.hello_replica(job, 0, "n0", "ipv4:10.0.0.1:5", 7000)
    snapshots.spare_replica(job, "sp1", "n9", "ipv4:10.0.0.9:5", 7009)
    assert snapshots.replica_peers(job, Verdict.ASSIGN) == {0: "10.0.0.9:7009"}
    book: ReplicaBook = job.replica_book
    snapshots.spare_replica(job, "sp2", "n8", "ipv4:10.0.0.8:5", 7008)  # sp1 left
    assert set(book.spares) == {"sp2"}


def test_the_command_bytes_merge_the_ranks_holder() -> None:
    cmd = pb.ArbiterMessage(command=pb.Command(id="c1", kind=pb.COMMAND_KIND_RESTART,
                                               generation=3, resume_step=9))
    data = snapshots.with_replica_peer(cmd.SerializeToString(), "10.0.0.2:7000")
    got = pb.ArbiterMessage.FromString(data)
    assert got.command.replica_peer == "10.0.0.2:7000"
    assert (got.command.id, got.command.generation, got.command.resume_step) == ("c1", 3, 9)
    assert snapshots.with_replica_peer(b"x", "") == b"x"


def test_the_agent_keeps_what_the_arbiter_said() -> None:
    proto = LinkProtocol(IdentityConfig(job="j", rank=1, world_size=2))
    proto.replica_port = 7001
    assert proto.hello().replica_port == 7001
    proto.on_welcome(pb.Welcome(replica_key=b"k" * 32, replica_peer="10.0.0.1:7000"))
    assert (proto.replica_key, proto.replica_peer) == (b"k" * 32, "10.0.0.1:7000")
    proto.on_message(pb.ArbiterMessage(command=pb.Command(
        id="r", kind=pb.COMMAND_KIND_RELEASE_BARRIER, replica_peer="10.0.0.3:7000")))
    assert proto.replica_peer == "10.0.0.3:7000"
    # a key that is not one, an empty or oversized peer: kept as they were
    proto.on_welcome(pb.Welcome(replica_key=b"short", replica_peer="x" * 301))
    assert (proto.replica_key, proto.replica_peer) == (b"k" * 32, "10.0.0.3:7000")


def test_status_says_how_the_replicas_are_placed() -> None:
    job = JobState(job="j", world_size=3)
    assert snapshots.replica_summary(job) == ""
    for r, node in ((0, "a"), (1, "a"), (2, "b")):
        snapshots.hello_replica(job, r, node, f"ipv4:10.0.0.{r}:5", 7000)
    assert snapshots.replica_summary(job) == "ring by node over 2 nodes: 3 of 3 ranks " \
        "have a holder"
    one = JobState(job="k", world_size=1)
    snapshots.hello_replica(one, 0, "a", "ipv4:10.0.0.1:5", 7000)
    assert snapshots.replica_summary(one) == "ring by rank on one node (a lost node loses " \
        "them): 0 of 1 ranks have a holder"
    snapshots.spare_replica(one, "sp", "z", "ipv4:10.0.0.9:5", 7000)
    assert snapshots.replica_summary(one).endswith("1 of 1 ranks have a holder (1 on warm "
                                                   "spares)")


# ---------------------------------------------------------------- one rank moved at a time


def _assign_before(ranks: dict[int, tuple[str, str]], spares: dict[str, tuple[str, str]],
                   previous: dict[int, str]) -> dict[int, str]:
    """``assign`` as it was before the book moved one rank at a time (stop 44): a whole
    pass over every rank, kept here as the answers the book must still give."""
    by_node: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_node.setdefault(ranks[r][0], []).append(r)
    nodes = sorted(by_node, key=lambda n: by_node[n][0])
    where = {n: i for i, n in enumerate(nodes)}
    pos = {r: k for rs in by_node.values() for k, r in enumerate(rs)}
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


class _BookBefore:
    """The book before stop 44: the whole ring recomputed whenever it is read dirty."""

    def __init__(self) -> None:
        self.ranks: dict[int, tuple[str, str]] = {}
        self.spares: dict[str, tuple[str, str]] = {}
        self.ring: dict[int, str] = {}
        self.dirty = False

    def rank_said(self, rank: int, node: str, address: str) -> None:
        old = self.ranks.get(rank)
        if address:
            if old != (node, address):
                self.ranks[rank] = (node, address)
                self.dirty = True
        elif old is not None:
            del self.ranks[rank]
            self.dirty = True

    def spare_said(self, instance: str, node: str, address: str, live: set[str]) -> None:
        for gone in [i for i in self.spares if i not in live and i != instance]:
            del self.spares[gone]
            self.dirty = True
        if address and self.spares.get(instance) != (node, address):
            self.spares[instance] = (node, address)
            self.dirty = True

    def peers(self) -> dict[int, str]:
        if self.dirty:
            self.ring = _assign_before(self.ranks, self.spares, self.ring)
            self.dirty = False
        return self.ring

    def peer_of(self, rank: int, world_size: int) -> str:
        if not self.ranks or (self.dirty and len(self.ranks) < world_size):
            return ""
        return self.peers().get(rank, "")


_OPS = st.lists(st.one_of(
    st.tuples(st.just("rank"), st.integers(0, 7), st.sampled_from("abcd"),
              st.one_of(st.integers(0, 30).map(lambda i: f"10.0.0.{i}:7000"),
                        st.just(""))),
    st.tuples(st.just("spare"), st.sampled_from(["s0", "s1"]), st.sampled_from("abcde"),
              st.sampled_from(["", "10.0.9.1:7000", "10.0.9.2:7000", "10.0.0.3:7000"]),
              st.sets(st.sampled_from(["s0", "s1"]))),
    st.tuples(st.just("peer_of"), st.integers(0, 7), st.integers(1, 8)),
    st.tuples(st.just("peers"))), max_size=60)


@settings(max_examples=400, deadline=None)
@given(_OPS)
def test_the_book_gives_the_answers_a_whole_pass_gave(ops: list[tuple[Any, ...]]) -> None:
    """Any sequence of Hellos (ranks moving node, address, both, leaving; spares coming
    and going; addresses two agents advertise) and reads: every answer as before."""
    book, before = ReplicaBook(), _BookBefore()
    for op in ops:
        if op[0] == "rank":
            book.rank_said(*op[1:])
            before.rank_said(*op[1:])
        elif op[0] == "spare":
            book.spare_said(*op[1:])
            before.spare_said(*op[1:])
        elif op[0] == "peer_of":
            assert book.peer_of(*op[1:]) == before.peer_of(*op[1:]), (op, book.ranks)
        else:
            assert dict(book.peers()) == before.peers(), (op, book.ranks)
    assert dict(book.peers()) == before.peers()


_LAYOUT = st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 12)), min_size=1,
                   max_size=10)
_MOVES = st.lists(st.tuples(st.integers(0, 9), st.sampled_from("abcdef"),
                            st.integers(0, 14)), max_size=20)


@settings(max_examples=600, deadline=None)
@given(_LAYOUT, _MOVES, st.booleans())
def test_one_rank_moved_between_reads_gives_the_whole_pass_answer(
        layout: list[tuple[str, int]], moves: list[tuple[int, str, int]],
        spare: bool) -> None:
    """A job's ranks on a few nodes, some sharing an address, maybe a spare; then one rank
    at a time moves (node, address or both) and the ring is read: the step it takes is
    the whole pass's answer."""
    book, before = ReplicaBook(), _BookBefore()
    for b in (book, before):
        for r, (node, a) in enumerate(layout):
            b.rank_said(r, node, f"10.0.0.{a}:7000")
        if spare:
            b.spare_said("sp", "z", "10.0.9.9:7000", {"sp"})
    assert dict(book.peers()) == before.peers()
    for r, node, a in moves:
        if r >= len(layout):
            continue
        for b in (book, before):
            b.rank_said(r, node, f"10.0.0.{a}:7000")
        assert dict(book.peers()) == before.peers(), (r, node, a, book.ranks)


@pytest.mark.parametrize("seed", range(6))
def test_every_pod_back_on_new_nodes_is_one_small_step_per_hello(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``probe_scale.py --replicas``' rehello: every rank of a job of 8 per node comes back
    on a new node with a new address, in any order. Each Hello's answer is the whole
    pass's, and no Hello makes a whole pass (it did: O(n) each, O(n^2) for the job)."""
    rng = random.Random(seed)
    n = 96 if seed else 16  # seed 0: in rank order, every node emptied in turn
    book, before = ReplicaBook(), _BookBefore()
    for r in range(n):
        for b in (book, before):
            b.rank_said(r, f"node-{r // 8}", f"10.0.{r // 256}.{r % 256}:7000")
    assert book.peer_of(0, n) == before.peer_of(0, n)
    passes = []
    real = replica_ring._Shape.__init__
    monkeypatch.setattr(replica_ring._Shape, "__init__",
                        lambda self, *a: (passes.append(1), real(self, *a))[1])
    order = list(range(n)) if seed == 0 else rng.sample(range(n), n)
    for r in order:
        node = f"node-{r // 8}-new" if seed % 2 == 0 else f"node-{rng.randrange(n // 4)}-x"
        for b in (book, before):
            b.rank_said(r, node, f"10.1.{r // 256}.{r % 256}:7000")
        assert book.peer_of(r, n) == before.peer_of(r, n)
    assert dict(book.peers()) == before.peers()
    assert passes == []
