"""The peer replica over real TCP on loopback: real DCP shards, two agents' holders and
pushers (ftagent/checkpoint/replica.py), a replaced pod's fetch, and what must be refused.

Each "agent" here is its memory root plus the replica parts the agent runs (a Holder, a
BackgroundReplica, fetch_before_start); the trainer is a Snapshotter in this process.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from ftagent.checkpoint import layout, replica, replica_agent
from ftagent.checkpoint import replica_protocol as rp
from ftagent.checkpoint.settings import Settings
from ftagent.checkpoint.snapshots import Snapshotter
from ftagent.model import SnapshotsHeld
from tests.conftest import wait_for

JOB = "job-r"
KEY = rp.replica_key("the-job-token", JOB)


def _state(v: float) -> dict[str, object]:
    return {"model": {"w": torch.full((64, 64), v)}, "step": int(v)}


def _snap(root: str, rank: int = 1, **kw: object) -> Snapshotter:
    return Snapshotter(Settings(root=root, job=JOB, rank=rank, world_size=2, **kw),  # type: ignore[arg-type]
                       report_held=lambda s: None, report_resumed=lambda s, src: None)


def _saved(root: str, step: int, rank: int = 1) -> None:
    s = _snap(root, rank)
    assert s.save(step, _state(float(step))) and s.wait(30)
    s.close()


@pytest.fixture
def holder(tmp_path):
    h = replica.Holder(str(tmp_path / "node-b"), JOB, KEY, ranks={1}).start()
    yield h
    h.close()


def test_a_shard_is_replicated_and_a_replaced_pod_resumes_from_it(tmp_path, holder):
    a = str(tmp_path / "node-a")
    _saved(a, 3)
    _saved(a, 5)
    bg = replica_agent.BackgroundReplica(a, JOB, lambda: 1, KEY, lambda: holder.address)
    bg.observe(SnapshotsHeld((3, 5)))
    wait_for(lambda: bg.pushed or bg.failed, 30, "the push")
    assert [s for s, _ in bg.pushed] == [5], bg.failed
    assert holder.held(1) == 5
    layout.verify(os.path.join(replica.replica_dir(holder.root, JOB, 1), "step-5"),
                  job=JOB, rank=1, step=5)
    # the pod is replaced: a fresh memory root; its agent fetches before the trainer starts
    c = str(tmp_path / "node-c")
    assert replica_agent.fetch_before_start(c, JOB, 1, KEY, holder.address) == 5
    target = _state(0.0)
    trainer = _snap(c, resume_step=5)
    assert trainer.load(target) == 5
    assert trainer.last_load[1] == "peer"
    assert torch.equal(target["model"]["w"], torch.full((64, 64), 5.0))  # type: ignore[index]
    # a warm restart (the shard is in memory) fetches nothing
    assert replica_agent.fetch_before_start(c, JOB, 1, KEY, holder.address) is None


def test_an_older_step_is_not_taken_over_a_newer_one(tmp_path, holder):
    a = str(tmp_path / "node-a")
    _saved(a, 5)
    assert replica.push(holder.address, KEY, a, JOB, 1) == 5
    old = str(tmp_path / "stale")
    _saved(old, 4)
    with pytest.raises(rp.Refused, match="holds step 5"):
        replica.push(holder.address, KEY, old, JOB, 1)
    assert holder.held(1) == 5
    # nor the same step again; and a holder that keeps any rank checks it too
    with pytest.raises(rp.Refused, match="holds step 5"):
        replica.push(holder.address, KEY, a, JOB, 1)
    anyrank = replica.Holder(str(tmp_path / "node-d"), JOB, KEY).start()
    try:
        assert replica.push(anyrank.address, KEY, a, JOB, 1) == 5
        with pytest.raises(rp.Refused, match="holds step 5"):
            replica.push(anyrank.address, KEY, old, JOB, 1)
    finally:
        anyrank.close()


def test_the_holders_cap_counts_every_rank_it_holds(tmp_path):
    a = str(tmp_path / "node-a")
    _saved(a, 2, rank=0)
    _saved(a, 2, rank=1)
    one = layout.read_marker(layout.step_dir(a, JOB, 0, 2)).nbytes
    h = replica.Holder(str(tmp_path / "node-b"), JOB, KEY, max_bytes=one + one // 2).start()
    try:
        assert replica.push(h.address, KEY, a, JOB, 0) == 2
        with pytest.raises(rp.Refused, match="replica cap"):
            replica.push(h.address, KEY, a, JOB, 1)
        _saved(a, 4, rank=0)  # rank 0's newer one replaces its own: within the cap
        assert replica.push(h.address, KEY, a, JOB, 0) == 4
    finally:
        h.close()


def test_foreign_shards_and_peers_are_refused(tmp_path, holder):
    a = str(tmp_path / "node-a")
    _saved(a, 2, rank=0)  # a rank this holder does not keep
    with pytest.raises(rp.Refused, match="rank 0"):
        replica.push(holder.address, KEY, a, JOB, 0)
    _saved(a, 2, rank=1)
    with pytest.raises(rp.Refused):  # another job's key: the handshake fails
        replica.push(holder.address, rp.replica_key("the-job-token", "job-x"), a, JOB, 1)
    with pytest.raises(rp.Refused, match="job 'job-x'"):  # another job's hello
        replica.fetch(holder.address, KEY, str(tmp_path / "c"), "job-x", 1)
    assert holder.held(1) is None
    # the holder writes each refusal down in its own thread, after the peer already saw the
    # refusal (a failed handshake closes first): under load the count may lag the raise
    wait_for(lambda: len(holder.refused) >= 3, 10, "the holder's three refusals")
    assert len(holder.refused) == 3, holder.refused
    # and a fetch of a rank it holds nothing of
    with pytest.raises(rp.Refused, match="no replica of rank 1"):
        replica.fetch(holder.address, KEY, str(tmp_path / "c"), JOB, 1)


def test_a_torn_stream_leaves_nothing_behind(tmp_path, holder):
    a = str(tmp_path / "node-a")
    _saved(a, 7)
    d = layout.step_dir(a, JOB, 1, 7)
    marker = layout.verify(d, job=JOB, rank=1, step=7)
    sock = socket.create_connection(holder.address, timeout=10)
    f = sock.makefile("rb")
    nonce = "1" * 32
    sock.sendall(rp.hello(JOB, "push", nonce))
    sn = rp.check_challenge(f.readline(), KEY, nonce)
    sock.sendall(rp.response(KEY, nonce, sn))
    sock.sendall(rp.offer(marker))
    name = sorted(marker.files)[-1]
    with open(os.path.join(d, name), "rb") as g:
        sock.sendall(g.read(1000))  # part of the shard... and the sender dies
    f.close()
    sock.close()
    wait_for(lambda: holder.refused, 10, "the holder's refusal")
    assert "torn" in holder.refused[-1]
    rdir = replica.replica_dir(holder.root, JOB, 1)
    wait_for(lambda: not os.path.isdir(rdir) or not os.listdir(rdir), 10, "the temp dir gone")
    assert holder.held(1) is None


def test_a_stalled_holder_never_blocks_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(replica, "IO_TIMEOUT", 1.0)
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(4)  # accepts (the backlog), never answers
    try:
        a = str(tmp_path / "node-a")
        trainer = _snap(a)
        assert trainer.save(1, _state(1.0)) and trainer.wait(30)
        bg = replica_agent.BackgroundReplica(a, JOB, lambda: 1, KEY,
                                       lambda: stalled.getsockname()[:2])
        t0 = time.monotonic()
        bg.observe(SnapshotsHeld((1,)))
        assert trainer.save(2, _state(2.0))  # the training goes on meanwhile
        assert trainer.wait(30)
        assert time.monotonic() - t0 < 5.0 and bg.busy() or bg.failed
        wait_for(lambda: bg.failed, 10, "the push to give up")
        assert "timed out" in bg.failed[-1] and not bg.pushed
        trainer.close()
    finally:
        stalled.close()


def test_a_flood_of_idle_connections_is_bounded_and_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(replica, "MAX_CONNECTIONS", 2)
    os.makedirs(os.path.join(replica.replica_dir(str(tmp_path / "node-b"), JOB, 1),
                             ".step-3.1.2.tmp"))  # a dead holder's half-received shard
    h = replica.Holder(str(tmp_path / "node-b"), JOB, KEY).start()
    idle = [socket.create_connection(h.address, timeout=10) for _ in range(2)]
    # both idle connections hold their slots before the flood: a connection is taken by
    # its handler thread, which a loaded machine may schedule after the flood's (ci11: the
    # flood's push took a slot and its shard was placed, so no later push could be)
    wait_for(lambda: _slots_free(h) == 0, 10, "both idle connections served")
    try:
        assert os.listdir(replica.replica_dir(h.root, JOB, 1)) == []  # cleared at start
        a = str(tmp_path / "node-a")
        _saved(a, 3)
        wait_for(lambda: _refused_flood(h, a), 10, "the third connection closed")
        assert any("too many connections" in r for r in h.refused)
        for s in idle:
            s.close()
        wait_for(lambda: _pushed(h, a), 20, "a push once the idle ones are gone")
        assert h.held(1) == 3
    finally:
        for s in idle:
            s.close()
        h.close()


def _slots_free(h: replica.Holder) -> int:
    """How many more connections the holder would serve now (its semaphore's count)."""
    return int(h._slots._value)  # type: ignore[attr-defined]


def _refused_flood(h: replica.Holder, root: str) -> bool:
    try:
        replica.push(h.address, KEY, root, JOB, 1)
    except rp.Refused:
        return True
    return False


def _pushed(h: replica.Holder, root: str) -> bool:
    try:
        return replica.push(h.address, KEY, root, JOB, 1) == 3
    except (rp.Refused, OSError):
        return False
