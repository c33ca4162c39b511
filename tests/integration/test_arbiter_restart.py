"""The arbiter is stateless: SIGKILL it, start it again, and the agents rebuild the job."""

from __future__ import annotations

import asyncio
import time

import grpc

from ftagent.model import ActionKind, Fault, FaultKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until


async def get_job(address: str, job: str) -> pb.JobInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.ArbiterStub(ch).GetJob(pb.GetJobRequest(job=job),
                                                    metadata=bearer("k"), timeout=5)


def test_killed_arbiter_is_rebuilt_and_a_queued_fault_arrives_once() -> None:
    async def body(arbiter: ArbiterProcess) -> None:
        async with running_links(arbiter.address, "phoenix", 3, token="k") as links:
            for lk in links:
                lk.arrive(0)
            assert all(await asyncio.gather(*(lk.wait_released(0, 5) for lk in links)))
            links[2].report_fault(Fault(FaultKind.CRASH, "first"), exit_status=1)
            for lk in links:
                action = await asyncio.wait_for(lk.commands.get(), 5)
                assert action.generation == 1
                lk.proto.lifecycle.restart(action)  # as the worker carries it out
                lk.arrive(1)
            assert all(await asyncio.gather(*(lk.wait_released(1, 5) for lk in links)))

            arbiter.kill()
            await wait_until(lambda: not any(lk.connected for lk in links), 5,
                             "links to notice the dead arbiter")
            queued = Fault(FaultKind.CRASH, "while the arbiter was down")
            links[0].report_fault(queued, exit_status=9)
            await asyncio.to_thread(arbiter.start)
            up = time.monotonic()
            await wait_until(lambda: all(lk.connected for lk in links), 5.5,
                             "every link to re-register")
            print(f"re-registered {time.monotonic() - up:.2f}s after the restart")
            actions = [await asyncio.wait_for(lk.commands.get(), 5) for lk in links]
            assert {(a.kind, a.generation) for a in actions} == {(ActionKind.RESTART, 2)}
            # ranks that re-registered after the decision are told to rejoin generation 2
            assert queued.id in {a.fault_id for a in actions}
            await wait_until(lambda: not links[0].proto.faults, 5, "the queued fault's ack")
            info = await get_job(arbiter.address, "phoenix")
            assert (info.generation, info.restarts, info.connected) == (2, 2, 3)
            faults = [e for e in info.timeline if e.kind == "fault"]
            assert [e.fault_id for e in faults] == [queued.id]
            restarts = [e for e in info.timeline if e.action == "restart"]
            assert len(restarts) == 1 and restarts[0].generation == 2
            assert restarts[0].fault_id == queued.id
            for lk in links:
                lk.arrive(2)
            assert all(await asyncio.gather(*(lk.wait_released(2, 5) for lk in links)))

    with ArbiterProcess("--token", "k") as arbiter:
        asyncio.run(body(arbiter))


def test_restarted_arbiter_honours_a_barrier_released_before_it_died() -> None:
    """An agent that already runs generation 1 proves the barrier completed; the others,
    which re-send their arrival, are released instead of waiting forever."""
    async def body(arbiter: ArbiterProcess) -> None:
        async with running_links(arbiter.address, "half", 2) as links:
            links[0].proto.lifecycle.release(1)  # as if it got RELEASE just before the kill
            links[0].proto.lifecycle.reached(1)  # the generation's owner (lifecycle.py)
            links[1].proto.lifecycle.reached(1)
            arbiter.kill()
            await wait_until(lambda: not any(lk.connected for lk in links), 5, "disconnect")
            links[1].arrive(1)
            await asyncio.to_thread(arbiter.start)
            assert await links[1].wait_released(1, 8)

    with ArbiterProcess() as arbiter:
        asyncio.run(body(arbiter))
