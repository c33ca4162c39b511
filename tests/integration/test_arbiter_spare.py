"""Warm spares over the wire: a real arbiter process, agents as ArbiterLinks on loopback.

A fatal GPU fault on rank 1 REPLACEs it and ASSIGNs the connected spare rank 1 at the new
generation; the spare arrives, and once the replaced agent's trainer is gone the barrier
releases with it as rank 1; the replaced
pod, recreated, claims rank 1 again and is told to serve as the job's spare. Waits are on
conditions with deadlines, never bare sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from ftagent.agent.reporter import ArbiterLink
from ftagent.config import ArbiterClientConfig, IdentityConfig
from ftagent.model import EXIT_REPLACE, ActionKind, Fault, FaultKind, ProcessExit, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer
from tests.arbiter_helpers import ArbiterProcess, all_released, running_links, wait_until

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def arbiter() -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--token", TOKEN) as a:
        yield a


def link(address: str, job: str, pod: str, node: str, *, rank: int = 0,
         spare: bool = False) -> ArbiterLink:
    return ArbiterLink(ArbiterClientConfig(arbiter=address, token=TOKEN),
                       IdentityConfig(job=job, rank=rank, world_size=2, pod=pod, node=node,
                                      spare=spare))


async def get_job(address: str, job: str) -> pb.JobInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.ArbiterStub(ch).GetJob(pb.GetJobRequest(job=job),
                                                    metadata=bearer(TOKEN), timeout=5)


async def timeline(address: str, job: str) -> list[str]:
    return [e.message for e in (await get_job(address, job)).timeline]


def test_a_replaced_rank_goes_to_the_spare_and_the_pod_back_becomes_the_spare(
        arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        addr = arbiter.address
        async with running_links(addr, "sp", 2, token=TOKEN) as links:
            assert await all_released(links)
            spare = link(addr, "sp", "spare-pod", "node-9", spare=True)
            back = link(addr, "sp", "pod-1-new", "node-1", rank=1)
            tasks = [asyncio.create_task(spare.run())]
            try:
                await wait_until(lambda: spare.connected, 10, "the spare to connect")
                assert list((await get_job(addr, "sp")).spares) == ["spare-pod on node-9"]
                links[1].report_fault(Fault(FaultKind.GPU, "Xid 79: fallen off the bus",
                                            severity=Severity.FATAL))
                a0, a1 = await asyncio.gather(*(asyncio.wait_for(lk.commands.get(), 5)
                                                for lk in links))
                assert (a0.kind, a1.kind) == (ActionKind.RESTART, ActionKind.REPLACE)
                assert await spare.wait_assigned(5)
                assert spare.proto.assignment == (1, 1, 1)
                assert spare.proto.hello().rank == 1 and not spare.proto.hello().spare
                # the spare arrives as rank 1 with rank 0; generation 1 starts only once
                # the replaced agent's trainer is gone (no generation 0 beside 1)
                spare.arrive(1)
                links[0].arrive(1)
                assert not await spare.wait_released(1, 0.5)
                links[1].report_exit(ProcessExit(pid=1, code=None, signal=9), 0)
                assert all(await asyncio.gather(spare.wait_released(1, 5),
                                                links[0].wait_released(1, 5)))
                # the replaced pod comes back and claims rank 1: it is made the spare
                tasks.append(asyncio.create_task(back.run()))
                await wait_until(lambda: back.proto.spare, 10, "the pod back to be a spare")
                assert back.connected and back.proto.assignment is None
                info = await get_job(addr, "sp")
                assert list(info.spares) == ["pod-1-new on node-1"]
                assert [(r.rank, r.pod) for r in info.ranks] == [(0, "pod-0"),
                                                                 (1, "spare-pod")]
                said = await timeline(addr, "sp")
                assert any("spare spare-pod on node node-9 takes rank 1 at generation 1" in m
                           for m in said), said
                assert any("spare spare-pod is rank 1 now" in m for m in said), said
                assert any("rank 1 is held by spare spare-pod" in m and "pod-1-new serves "
                           "as the job's spare" in m for m in said), said
            finally:
                for lk in (spare, back):
                    await lk.close()
                await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(body())


def test_a_spare_with_a_fatal_fault_of_its_own_is_retired(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        addr = arbiter.address
        async with running_links(addr, "sick", 2, token=TOKEN) as links:
            assert await all_released(links)
            spare = link(addr, "sick", "spare-pod", "node-9", spare=True)
            task = asyncio.create_task(spare.run())
            try:
                await wait_until(lambda: spare.connected, 10, "the spare to connect")
                spare.report_fault(Fault(FaultKind.GPU, "Xid 79 on the spare",
                                         severity=Severity.FATAL))
                action = await asyncio.wait_for(spare.commands.get(), 5)
                assert action.kind is ActionKind.REPLACE and action.exit_code == EXIT_REPLACE
                info = await get_job(addr, "sick")
                assert info.generation == 0 and info.restarts == 0
                assert list(info.spares) == ["spare-pod on node-9 (retired: a fatal fault)"]
                # rank 1's own fatal fault now finds no spare: the old REPLACE alone
                links[1].report_fault(Fault(FaultKind.GPU, "Xid 79", severity=Severity.FATAL))
                a1 = await asyncio.wait_for(links[1].commands.get(), 5)
                assert a1.kind is ActionKind.REPLACE
                said = await timeline(addr, "sick")
                assert not any("takes rank" in m for m in said), said
                assert any("retired as a spare" in m for m in said), said
            finally:
                await spare.close()
                await asyncio.gather(task, return_exceptions=True)
    asyncio.run(body())
