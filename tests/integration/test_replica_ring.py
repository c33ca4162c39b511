"""The arbiter hands out the peer replica's ring and key over the wire: a real arbiter
process, agents as ArbiterLinks on loopback (as tests/integration/test_arbiter_spare.py),
real replica holders (checkpoint/replica.py) keyed with what the arbiter said.

* Two ranks on two nodes say their holders' ports; the barrier's release tells each the
  other's address (the stream's host, the port it said); both hold the job's key, and an
  agent of another job holds another key: a holder of job A refuses it (the handshake),
  and the fetch says so and leaves the ladder to go on to disk.
* A fatal GPU fault replaces rank 1; the warm spare ASSIGNed rank 1 is told the holder of
  rank 1's replica (rank 0's agent), where it fetches it from before its trainer starts.
* The replica's lag is exported (``ftagent_snapshot_replica_lag_steps``) and falls to 0
  once the newest snapshot is copied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from ftagent.agent.reporter import ArbiterLink
from ftagent.checkpoint import layout, replica, replica_agent
from ftagent.checkpoint import replica_protocol as rp
from ftagent.checkpoint.settings import Settings
from ftagent.checkpoint.snapshots import Snapshotter
from ftagent.config import ArbiterClientConfig, IdentityConfig
from ftagent.metrics import AgentMetrics
from ftagent.model import ActionKind, Fault, FaultKind, ProcessExit, Severity, SnapshotsHeld
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer
from tests.arbiter_helpers import ArbiterProcess, all_released, wait_until
from tests.conftest import wait_for

TOKEN = "s3cret-for-the-replica-ring"


@pytest.fixture(scope="module")
def arbiter() -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--token", TOKEN) as a:
        yield a


def _link(address: str, job: str, rank: int, node: str, port: int, *,
          spare: bool = False) -> ArbiterLink:
    lk = ArbiterLink(ArbiterClientConfig(arbiter=address, token=TOKEN),
                     IdentityConfig(job=job, rank=rank, world_size=2, pod=f"{job}-{node}",
                                    node=node, spare=spare))
    lk.proto.replica_port = port  # what replica_agent sets from its holder
    return lk


def _saved(root: str, job: str, rank: int, step: int) -> None:
    s = Snapshotter(Settings(root=root, job=job, rank=rank, world_size=2),
                    report_held=lambda s: None, report_resumed=lambda s, src: None)
    assert s.save(step, {"w": torch.full((16, 16), float(step))}) and s.wait(30)
    s.close()


def test_the_arbiter_gives_each_rank_its_holder_and_each_job_its_key(
        arbiter: ArbiterProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        addr = arbiter.address
        links = [_link(addr, "ring-a", r, f"node-{r}", 7100 + r) for r in (0, 1)]
        other = _link(addr, "ring-b", 0, "node-5", 7105)
        tasks = [asyncio.create_task(lk.run()) for lk in (*links, other)]
        try:
            await wait_until(lambda: all(lk.connected for lk in (*links, other)), 10,
                             "the links to connect")
            assert await all_released(links)
            assert [lk.proto.replica_peer for lk in links] == ["127.0.0.1:7101",
                                                              "127.0.0.1:7100"]
            async with grpc.aio.insecure_channel(addr) as ch:  # ftagent status's view
                info = await pb_grpc.ArbiterStub(ch).GetJob(
                    pb.GetJobRequest(job="ring-a"), metadata=bearer(TOKEN), timeout=5)
            assert info.replicas == "ring by node over 2 nodes: 2 of 2 ranks have a holder"
            key_a = links[0].proto.replica_key
            assert len(key_a) == 32 and links[1].proto.replica_key == key_a
            key_b = other.proto.replica_key
            assert len(key_b) == 32 and key_b != key_a
            # a holder of job A (the key its arbiter gave) and an agent of job B
            a_root, b_root = str(tmp_path / "a"), str(tmp_path / "b")
            holder = replica.Holder(a_root, "ring-a", lambda: links[0].proto.replica_key
                                    ).start()
            try:
                _saved(str(tmp_path / "src"), "ring-a", 1, 4)
                assert replica.push(holder.address, key_a, str(tmp_path / "src"),
                                    "ring-a", 1) == 4
                with caplog.at_level(logging.INFO, "ftagent.checkpoint.replica"):
                    # job B's agent, with job B's key, asks for a rank of "ring-a"
                    assert replica_agent.fetch_before_start(
                        b_root, "ring-a", 1, key_b, holder.address) is None
                assert "does not hold this job's replica key" in caplog.text
                assert "the ladder goes on to disk" in caplog.text
                assert not layout.complete_steps(b_root, "ring-a", 1)
                # the job's own agent gets it
                assert replica_agent.fetch_before_start(
                    b_root, "ring-a", 1, key_a, holder.address, step=4) == 4
            finally:
                holder.close()
        finally:
            for lk in (*links, other):
                await lk.close()
            await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(body())


def test_a_spare_assigned_a_replaced_rank_is_told_where_its_replica_is(
        arbiter: ArbiterProcess, tmp_path: Path) -> None:
    async def body() -> None:
        addr = arbiter.address
        links = [_link(addr, "ring-s", r, f"node-{r}", 7200 + r) for r in (0, 1)]
        tasks = [asyncio.create_task(lk.run()) for lk in links]
        spare = _link(addr, "ring-s", 0, "node-9", 7209, spare=True)
        try:
            await wait_until(lambda: all(lk.connected for lk in links), 10, "links")
            assert await all_released(links)
            tasks.append(asyncio.create_task(spare.run()))
            await wait_until(lambda: spare.connected, 10, "the spare to connect")
            assert len(spare.proto.replica_key) == 32
            assert spare.proto.replica_key == links[0].proto.replica_key
            links[1].report_fault(Fault(FaultKind.GPU, "Xid 79: fallen off the bus",
                                        severity=Severity.FATAL))
            a0, a1 = await asyncio.gather(*(asyncio.wait_for(lk.commands.get(), 5)
                                            for lk in links))
            assert (a0.kind, a1.kind) == (ActionKind.RESTART, ActionKind.REPLACE)
            assert await spare.wait_assigned(5)
            # rank 1's replica is at rank 0's agent: the spare fetches it from there
            assert spare.proto.replica_peer == "127.0.0.1:7200"
            spare.arrive(1)
            links[0].arrive(1)
            links[1].report_exit(ProcessExit(pid=1, code=None, signal=9), 0)
            assert all(await asyncio.gather(spare.wait_released(1, 5),
                                            links[0].wait_released(1, 5)))
            assert spare.proto.replica_peer == "127.0.0.1:7200"
        finally:
            for lk in (*links, spare):
                await lk.close()
            await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(body())


def test_the_replica_lag_is_exported_and_falls_to_zero_once_copied(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    m = AgentMetrics(reg, {"job_name": "lag", "namespace": "", "pod": "p", "node": "n",
                           "rank": "1"})
    key = rp.replica_key("tok", "lag")
    holder = replica.Holder(str(tmp_path / "holder"), "lag", key).start()
    root = str(tmp_path / "pod")
    peer: list[tuple[str, int] | None] = [None]  # no holder known yet

    def lag() -> float | None:
        return reg.get_sample_value("ftagent_snapshot_replica_lag_steps",
                                    {"job_name": "lag", "namespace": "", "pod": "p",
                                     "node": "n", "rank": "1"})
    try:
        _saved(root, "lag", 1, 3)
        bg = replica_agent.BackgroundReplica(root, "lag", lambda: 1, key, lambda: peer[0],
                                             on_lag=m.snapshot_replica_lag.set)
        bg.observe(SnapshotsHeld((3,)))
        assert lag() == 3  # nothing replicated: every step so far
        peer[0] = holder.address
        _saved(root, "lag", 1, 6)
        bg.observe(SnapshotsHeld((3, 6)))
        wait_for(lambda: bg.pushed, 10, "the copy")
        assert bg.pushed[-1][0] == 6 and lag() == 0
    finally:
        holder.close()


def test_before_the_arbiters_key_nothing_is_copied_or_served(tmp_path: Path) -> None:
    """An agent whose Welcome has not come yet has no key: its holder refuses every
    connection and its push waits (no copy made with a key it does not have)."""
    key = rp.replica_key("tok", "nokey")
    now: list[bytes] = [b""]
    holder = replica.Holder(str(tmp_path / "holder"), "nokey", lambda: now[0]).start()
    root = str(tmp_path / "pod")
    try:
        _saved(root, "nokey", 1, 3)
        with pytest.raises(rp.Refused, match="no replica key yet"):
            replica.push(holder.address, key, root, "nokey", 1)
        bg = replica_agent.BackgroundReplica(root, "nokey", lambda: 1, lambda: now[0],
                                             lambda: holder.address)
        bg.observe(SnapshotsHeld((3,)))
        assert not bg.busy() and not bg.pushed and bg.lag_steps == 3
        now[0] = key  # the Welcome came
        bg.observe(SnapshotsHeld((3,)))
        wait_for(lambda: bg.pushed, 10, "the copy")
        assert holder.held(1) == 3
    finally:
        holder.close()


def test_a_holder_keeps_two_steps_and_serves_the_one_asked_for(tmp_path: Path) -> None:
    """The arbiter's resume step may be the one before the newest (a rank died before its
    peers' next snapshot): the holder keeps the newest two per rank and serves the step
    asked for where it has it, else its newest."""
    key = rp.replica_key("tok", "two")
    holder = replica.Holder(str(tmp_path / "holder"), "two", key).start()
    src = str(tmp_path / "src")
    try:
        for step in (3, 6, 9):
            _saved(src, "two", 1, step)
            assert replica.push(holder.address, key, src, "two", 1) == step
        assert layout.steps_in(replica.replica_dir(holder.root, "two", 1)) == [6, 9]
        for asked, got in ((6, 6), (9, 9), (None, 9), (3, 9), (7, 9)):
            root = str(tmp_path / f"pod-{asked}")
            assert replica.fetch(holder.address, key, root, "two", 1, step=asked) == got
            assert layout.complete_steps(root, "two", 1) == [got]
    finally:
        holder.close()
