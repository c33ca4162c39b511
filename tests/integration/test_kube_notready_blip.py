"""NotReady is not death: the fake API server flaps a node while the job's ranks there
keep stepping (their agents report progress) -- no replacement, a timeline entry says
so; ranks that stop while the node stays NotReady -- replaced as before."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ftagent.v1 import ftagent_pb2 as pb
from tests.arbiter_helpers import wait_until
from tests.integration.test_kube_actions import NS, cluster, run


async def stepping(s: Any, ranks: list[int], stop: asyncio.Event) -> None:
    """The agents of ``ranks`` report a new step every 0.1 s until ``stop``."""
    step = 100
    while not stop.is_set():
        step += 1
        for r in ranks:
            s.reg.handle(s.conns[r], pb.AgentMessage(progress=pb.ProgressSummary(
                step=step, ts=s.reg.clock(), seconds_since_progress=0.0)), s.reg.clock())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


def notes(s: Any) -> list[str]:
    return [e.message for e in s.reg.timeline.entries("llm", NS, 0)]


def test_a_notready_node_whose_ranks_keep_stepping_is_a_blip_then_a_loss_once_they_stop(
        ) -> None:
    async def body() -> None:
        async with cluster(node_notready_grace=1.0) as s:
            s.cluster.step_window = 0.0  # steps every 0.1 s here: the grace (1 s) is enough
            job = s.reg.jobs[(NS, "llm")]
            stop = asyncio.Event()
            steps = asyncio.create_task(stepping(s, [0, 1, 2, 3], stop))
            try:
                s.fake.set_node_ready("node-2", "Unknown")
                await wait_until(lambda: any("a blip, no replacement" in m
                                             for m in notes(s)), 20, "the blip noted")
                await asyncio.sleep(1.5)  # noqa: ASYNC110 -- past the grace: nothing follows
                assert job.generation == 0 and s.fake.count("delete", "pods") == 0
                assert s.fake.count("update", "nodes") == 0
                blip = [m for m in notes(s) if "a blip" in m]
                assert len(blip) == 1 and "node node-2 not Ready" in blip[0] and \
                    "rank 2 there still stepping" in blip[0]
                # back Ready: the blip is over, said once
                s.fake.set_node_ready("node-2", True)
                await wait_until(lambda: any("blip passed" in m for m in notes(s)), 20,
                                 "the blip's end noted")
                # flapping every few ticks while stepping: never a replacement
                for i in range(6):
                    s.fake.set_node_ready("node-2", "False" if i % 2 == 0 else "True")
                    await asyncio.sleep(0.3)  # noqa: ASYNC110 -- the flapping's period
                assert job.generation == 0 and s.fake.count("delete", "pods") == 0
                # a real loss: NotReady and rank 2 stops stepping (the others go on)
                stop.set()
                await steps
                stop = asyncio.Event()
                steps = asyncio.create_task(stepping(s, [0, 1, 3], stop))
                s.fake.set_node_ready("node-2", "Unknown")
                await wait_until(lambda: job.generation == 1, 20, "the node loss decided")
                assert [c.kind for c in s.commands(2)][-1] == pb.COMMAND_KIND_REPLACE
                await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "delete")
            finally:
                stop.set()
                await steps
    run(body)


def test_a_notready_node_with_silent_ranks_is_replaced_at_the_grace_as_before() -> None:
    async def body() -> None:
        async with cluster(node_notready_grace=0.5) as s:
            job = s.reg.jobs[(NS, "llm")]
            s.fake.set_node_ready("node-1", "False")
            await wait_until(lambda: job.generation == 1, 20, "the decision")
            assert not any("a blip" in m for m in notes(s))
    run(body)
