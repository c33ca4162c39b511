"""Closing the agent's link loses nothing it wrote (agent/reporter.py).

The agent's last message is the trainer's exit. The link used to cancel its stream as soon
as that message was written; an arbiter that had not read it yet (a busy event loop, a
loaded node) then lost it, and a job whose ranks all exited 0 never read "succeeded".
Here the arbiter is a minimal in-process servicer that holds its reads until the agent is
already closing: the exit must still be read. Fails on the cancelling close.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from ftagent.agent.reporter import ArbiterLink
from ftagent.config import ArbiterClientConfig, IdentityConfig
from ftagent.model import ProcessExit
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from tests.arbiter_helpers import wait_until


class SlowReader(pb_grpc.ArbiterServicer):
    """Answers Hello with Welcome, then reads nothing until ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.bodies: list[str] = []

    async def Connect(self, request_iterator: AsyncIterator[pb.AgentMessage],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ArbiterMessage]:
        it = request_iterator.__aiter__()
        first = await it.__anext__()
        self.bodies.append(str(first.WhichOneof("body")))
        yield pb.ArbiterMessage(welcome=pb.Welcome(generation=0, arbiter_id="slow"))
        await self.gate.wait()
        async for m in it:
            self.bodies.append(str(m.WhichOneof("body")))


def test_the_exit_written_before_closing_is_read_by_a_slow_arbiter() -> None:
    async def body() -> None:
        server = grpc.aio.server()
        servicer = SlowReader()
        pb_grpc.add_ArbiterServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            link = ArbiterLink(ArbiterClientConfig(arbiter=f"127.0.0.1:{port}"),
                               IdentityConfig(job="close", rank=0, world_size=1, pod="pod-0",
                                              node="node-0"))
            task = asyncio.create_task(link.run())
            await wait_until(lambda: link.connected, 10, "the link to connect")
            link.report_exit(ProcessExit(pid=1, code=0, signal=None), 0)
            await wait_until(lambda: link.pending() == 0, 10, "the exit written")
            closing = asyncio.create_task(link.close())
            await wait_until(lambda: link._closed.is_set(), 10, "the link closing")
            servicer.gate.set()  # the arbiter reads only now
            await closing
            await asyncio.gather(task, return_exceptions=True)
            assert "exit" in servicer.bodies, servicer.bodies
        finally:
            await server.stop(None)

    asyncio.run(body())


def test_finishing_gives_up_when_no_arbiter_comes_back() -> None:
    """The agent ends with its trainer's code whatever the arbiter does: ``finish`` waits
    only its timeout for an arbiter to confirm, and says it did not."""
    async def body() -> None:
        server = grpc.aio.server()
        servicer = SlowReader()
        servicer.gate.set()
        pb_grpc.add_ArbiterServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        link = ArbiterLink(ArbiterClientConfig(arbiter=f"127.0.0.1:{port}"),
                           IdentityConfig(job="close", rank=0, world_size=1, pod="pod-0",
                                          node="node-0"))
        task = asyncio.create_task(link.run())
        try:
            await wait_until(lambda: link.connected, 10, "the link to connect")
            await server.stop(None)  # gone for good
            link.report_exit(ProcessExit(pid=1, code=0, signal=None), 0)
            assert not await link.finish(0.5)
            assert link.proto.last_exit is not None  # never confirmed
        finally:
            await link.close()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)

    asyncio.run(body())
