"""The agents' link carries the snapshots their trainers hold to a real arbiter process
(SnapshotReport, at once, at most one per SNAPSHOT_REPORT_INTERVAL, the newest flushed
before an exit); the arbiter's RESTART then names the newest step every rank holds; an
arbiter restarted under the links learns the steps again from them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from ftagent.agent import link_protocol
from ftagent.agent.reporter import ArbiterLink
from ftagent.model import ActionKind, Fault, FaultKind, ProcessExit, SnapshotsHeld
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def arbiter() -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--token", TOKEN) as a:
        yield a


async def snapshot_step(address: str, job: str) -> int | None:
    async with grpc.aio.insecure_channel(address) as ch:
        info = await pb_grpc.ArbiterStub(ch).GetJob(pb.GetJobRequest(job=job),
                                                    metadata=bearer(TOKEN), timeout=5)
    return info.snapshot_step if info.HasField("snapshot_step") else None


async def start(links: list[ArbiterLink], generation: int) -> None:
    for lk in links:
        lk.arrive(generation)
    assert all(await asyncio.gather(*(lk.wait_released(generation, 5) for lk in links)))


def test_held_snapshots_reach_the_arbiter_and_the_restart_names_the_step(
        arbiter: ArbiterProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # a report interval longer than the test: a second report can only go by the flush
    monkeypatch.setattr(link_protocol, "SNAPSHOT_REPORT_INTERVAL", 60.0)

    async def body() -> None:
        addr = arbiter.address
        async with running_links(addr, "snap", 2, token=TOKEN) as links:
            await start(links, 0)
            links[0].observe_trainer(SnapshotsHeld((3, 6)))
            links[1].observe_trainer(SnapshotsHeld((3,)))
            await wait_until(lambda: snapshot_step(addr, "snap"), 5, "step 3 known")
            assert await snapshot_step(addr, "snap") == 3
            # rank 1's step 6 completes just before its trainer crashes: within the report
            # interval of its last report, so it waits, and goes before the exit (without
            # the flush the restart would name step 3)
            links[1].observe_trainer(SnapshotsHeld((3, 6)))
            links[1].report_exit(ProcessExit(pid=1, code=3), 0)
            links[1].report_fault(Fault(FaultKind.CRASH, "exit 3", evidence={"exit_status": 3}))
            actions = await asyncio.gather(*(asyncio.wait_for(lk.commands.get(), 5)
                                             for lk in links))
            assert {(a.kind, a.resume_step) for a in actions} == {(ActionKind.RESTART, 6)}

    asyncio.run(body())


def test_an_arbiter_restarted_under_the_links_learns_the_steps_again() -> None:
    async def body(arbiter: ArbiterProcess) -> None:
        async with running_links(arbiter.address, "again", 1, token=TOKEN) as links:
            await start(links, 0)
            links[0].observe_trainer(SnapshotsHeld((4,)))
            await wait_until(lambda: snapshot_step(arbiter.address, "again"), 5, "known")
            arbiter.kill()  # a crashed Deployment: it knows nothing when it comes back
            await wait_until(lambda: not links[0].connected, 5, "disconnect")
            await asyncio.to_thread(arbiter.start)
            await wait_until(lambda: links[0].connected, 30, "reconnected")
            await wait_until(lambda: snapshot_step(arbiter.address, "again"), 10,
                             "known again")
            assert await snapshot_step(arbiter.address, "again") == 4

    with ArbiterProcess("--token", TOKEN) as a:
        asyncio.run(body(a))
