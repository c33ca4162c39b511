"""A rank's owner (pod and uid, as verified at its Hello) survives an arbiter restart
through the job's history record (``--state-dir``): a restarted arbiter refuses another
pod's Hello for the rank while the owner pod exists, exactly as before the restart, and
lets the rank go once the owner is gone or replaced. A record's owners are checked where
they enter."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from ftagent.arbiter.history import History, JobRecord
from ftagent.arbiter.history_file import FileHistory
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.checks import Refused


class World:
    """A clock and the pod watch's view (pod -> uid) the registry's pod_alive reads."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.pods = {"pod-0": "uid-0", "pod-1": "uid-1", "pod-x": "uid-x"}

    def registry(self, state_dir: Path) -> Registry:
        reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a",
                       clock=lambda: self.now, history=History(FileHistory(str(state_dir))))
        reg.pod_alive = lambda ns, pod, uid: self.pods.get(pod) == uid
        return reg


def hello(reg: Registry, pod: str, uid: str, rank: int, instance: str) -> Connection:
    """Rank ``rank``'s Hello on a stream whose credentials are pod ``pod`` (``uid``)."""
    conn = Connection(f"peer-{pod}", pod_uid=uid)
    reg.hello(conn, pb.Hello(job="j", rank=rank, world_size=2, pod=pod, node="n",
                             agent_instance=instance))
    return conn


def refused(reg: Registry, pod: str, uid: str, rank: int) -> str:
    with pytest.raises(Refused) as e:
        hello(reg, pod, uid, rank, "intruder")
    assert e.value.code is grpc.StatusCode.PERMISSION_DENIED
    return e.value.reason


def running_job(w: World, state_dir: Path) -> None:
    """Both ranks registered by their pods; the arbiter is then SIGKILLed (its history
    file is all that is left)."""
    reg = w.registry(state_dir)
    conns = [hello(reg, f"pod-{r}", f"uid-{r}", r, f"i{r}") for r in range(2)]
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    # before the restart another pod's Hello for rank 0 is refused, its agent away or not
    reg.disconnect(conns[0])
    assert refused(reg, "pod-x", "uid-x", 0) == "rank_owned"
    reg.history.close()


def test_a_restarted_arbiter_refuses_another_pod_for_an_owned_rank(tmp_path: Path) -> None:
    w = World()
    running_job(w, tmp_path)
    w.now += 30
    reg = w.registry(tmp_path)
    # the job is not live yet (no agent is back): the record's owner decides
    assert refused(reg, "pod-x", "uid-x", 0) == "rank_owned"
    assert not reg.jobs
    # rank 1's agent is back: the job is live; rank 0 is still pod-0's
    hello(reg, "pod-1", "uid-1", 1, "i1")
    assert refused(reg, "pod-x", "uid-x", 0) == "rank_owned"
    # its own pod takes it back
    hello(reg, "pod-0", "uid-0", 0, "i0")
    assert reg.jobs[("", "j")].ranks[0].pod_uid == "uid-0"


def test_a_rank_whose_owner_pod_is_gone_or_replaced_is_free(tmp_path: Path) -> None:
    w = World()
    running_job(w, tmp_path)
    del w.pods["pod-0"]  # deleted while the arbiter was away
    w.pods["pod-1"] = "uid-1b"  # replaced: same name, another uid
    reg = w.registry(tmp_path)
    hello(reg, "pod-x", "uid-x", 0, "x")
    hello(reg, "pod-1", "uid-1b", 1, "i1b")
    job = reg.jobs[("", "j")]
    assert (job.ranks[0].pod_uid, job.ranks[1].pod_uid) == ("uid-x", "uid-1b")
    assert job.owners == {0: ("pod-x", "uid-x"), 1: ("pod-1", "uid-1b")}


def test_an_owner_is_written_even_when_nothing_else_is(tmp_path: Path) -> None:
    """Rank 0 alone registered (no note rewrites the record): the tick writes its
    owner, and the arbiter restarted after it keeps the rank pod-0's."""
    w = World()
    reg = w.registry(tmp_path)
    hello(reg, "pod-0", "uid-0", 0, "i0")
    w.now += 1
    reg.tick()
    reg.history.close()
    reg = w.registry(tmp_path)
    assert refused(reg, "pod-x", "uid-x", 0) == "rank_owned"


def test_a_records_owners_are_checked_where_they_enter() -> None:
    rec = JobRecord.from_json({
        "job": "j", "world_size": 2, "owners": [
            [0, "pod-0", "uid-0"], [2, "pod-2", "uid-2"], [-1, "p", "u"], [True, "p", "u"],
            [1, "", "u"], [1, "p", ""], [1, "p" * 254, "u"], [1, "p", "u" * 129],
            "junk", [1, "p"]]})
    assert rec.owners == [[0, "pod-0", "uid-0"]]
    # never more than the job's world size, whatever the record says
    many = JobRecord.from_json({"job": "j", "world_size": 3, "owners": [
        [r % 3, f"pod-{r}", f"uid-{r}"] for r in range(10_000)]})
    assert len(many.owners) == 3
    assert JobRecord.from_json({"job": "j", "owners": "junk"}).owners == []


def test_owned_never_overrides_a_rank_registered_since() -> None:
    """Pure: the record's owners fill only ranks with none; a verified Hello sets its
    rank's owner; the fingerprint follows the content, not the order of changes."""
    from ftagent.arbiter.state import JobState, Owned, Registered, apply

    def registered(rank: int, pod: str, uid: str) -> Registered:
        return Registered(rank=rank, pod=pod, node="n", state="waiting", instance="i",
                          pod_uid=uid, gpus=(), generation=0, released_generation=-1,
                          running=False, restart_count=0, world_size=2, alert_only=False,
                          conn=object())

    a = JobState(job="j", world_size=2)
    apply(a, registered(0, "pod-0b", "uid-0b"), 1.0)
    apply(a, Owned(((0, "pod-0", "uid-0"), (1, "pod-1", "uid-1"))), 1.0)
    assert a.owners == {0: ("pod-0b", "uid-0b"), 1: ("pod-1", "uid-1")}
    b = JobState(job="j", world_size=2)
    apply(b, Owned(((0, "pod-0", "uid-0"), (1, "pod-1", "uid-1"))), 1.0)
    apply(b, registered(0, "pod-0b", "uid-0b"), 1.0)
    apply(b, registered(1, "pod-1", ""), 1.0)  # unverified: the owner is kept
    assert b.owners == a.owners and b.owners_print == a.owners_print


class CountingStore:
    """A history store that counts what it is asked to write (no file)."""

    def __init__(self) -> None:
        self.records = 0
        self.owner_rows = 0
        self.last_owners = 0

    def record(self, item: object) -> None:
        if isinstance(item, JobRecord):
            self.records += 1
            self.owner_rows += len(item.owners)
            self.last_owners = len(item.owners)

    def load(self) -> object:
        from ftagent.arbiter.history import Loaded

        return Loaded()

    def forget(self, namespace: str, job: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_hello_does_not_rewrite_every_owner() -> None:
    """The fixed cost of a pod's Hello: 1,000 ranks (re)connecting, as after a failover,
    each Hello noted on the timeline (here: each asks for more restarts than the
    arbiter's ceiling), write the job's owners once per tick, not once per Hello (each
    write is O(ranks): O(ranks^2) on the event loop before the last agent was back). Old
    code: 1,000 records and about 500,000 owner rows."""
    n = 1000
    now = [1_000_000.0]
    store = CountingStore()
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=lambda: now[0],
                   history=History(store))  # type: ignore[arg-type]
    reg.pod_alive = lambda ns, pod, uid: True
    for r in range(n):
        conn = Connection(f"peer-{r}", pod_uid=f"uid-{r}")
        reg.hello(conn, pb.Hello(job="j", rank=r, world_size=n, pod=f"pod-{r}", node="n",
                                 agent_instance=f"i{r}", max_restarts=1_000_000))
    assert store.records <= 3 and store.owner_rows <= 2 * n, (store.records, store.owner_rows)
    now[0] += 1
    reg.tick()  # the tick writes every owner, once
    assert store.owner_rows <= 3 * n and store.last_owners == n
    tick_rows = store.owner_rows
    reg.tick()  # nothing changed: nothing written
    assert store.owner_rows == tick_rows
