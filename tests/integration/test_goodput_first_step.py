"""A new trainer's first step reaches the arbiter at once (agent/reporter.py, issue 24).

Progress summaries are coalesced to one per progress interval; the goodput ledger takes
the first step every rank reports in a new generation as the step the job resumed at and
the moment it trains again. Coalesced, that first summary waited for the next slot and
then carried a later step: the resume step came out too high and the restart too long.
The last steps of a trainer that ended go at once too: the ledger's "reached" step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from ftagent.agent.reporter import ArbiterLink
from ftagent.model import ProcessExit, Progress
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until


async def step_at_arbiter(address: str, job: str) -> int | None:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            info = await pb_grpc.ArbiterStub(ch).GetJob(pb.GetJobRequest(job=job), timeout=5)
        except grpc.aio.AioRpcError:
            return None
    return info.ranks[0].step if info.ranks else None


async def first_step_seen(lk: ArbiterLink, address: str, job: str
                          ) -> Callable[[int], Awaitable[bool]]:
    """Generation 0 released and its step 1 at the arbiter; returns "is step N there?"."""
    lk.arrive(0)
    assert await lk.wait_released(0, 5)
    lk.started(0, released=True)
    lk.report_progress(Progress(step=1), seconds_since_progress=0, hung=False)

    async def at(step: int) -> bool:
        return await step_at_arbiter(address, job) == step

    await wait_until(lambda: at(1), 5, "step 1 at the arbiter", interval=0.05)
    return at


def test_the_first_step_of_a_new_trainer_is_not_held_for_the_next_slot() -> None:
    async def body(arbiter: ArbiterProcess) -> None:
        async with running_links(arbiter.address, "first", 1, progress_interval=60) as (lk,):
            at = await first_step_seen(lk, arbiter.address, "first")
            lk.report_progress(Progress(step=7), seconds_since_progress=0, hung=False)
            lk.report_exit(ProcessExit(pid=1, code=1, signal=None), 0)  # flushes step 7
            await wait_until(lambda: at(7), 5, "step 7 with the exit", interval=0.05)
            lk.arrive(1)
            assert await lk.wait_released(1, 5)
            lk.started(1, released=True)
            # the next slot is 60 s away: the new trainer's first step goes now anyway
            lk.report_progress(Progress(step=6), seconds_since_progress=0, hung=False)
            await wait_until(lambda: at(6), 5, "generation 1's first step", interval=0.05)

    with ArbiterProcess() as arbiter:
        asyncio.run(body(arbiter))


def test_the_last_step_of_a_trainer_stopped_for_a_restart_goes_before_the_arrival() -> None:
    """A RESTART stops the trainer without an exit report: its last summary was held for
    the next slot, so the ledger's "reached" step (and the steps redone) came out low."""
    async def body(arbiter: ArbiterProcess) -> None:
        async with running_links(arbiter.address, "stopped", 1, progress_interval=60) as (lk,):
            at = await first_step_seen(lk, arbiter.address, "stopped")
            lk.report_progress(Progress(step=9), seconds_since_progress=0, hung=False)
            lk.arrive(1)  # the trainer was stopped by a restart: step 9 goes first
            await wait_until(lambda: at(9), 5, "step 9 with the arrival", interval=0.05)

    with ArbiterProcess() as arbiter:
        asyncio.run(body(arbiter))


def test_the_steps_read_after_a_trainer_exit_go_before_its_agent_closes() -> None:
    """A trainer stopped for a REPLACE: the lines still in its pipe are read after its exit
    was reported (worker._after_exit drains the pipe to EOF once the trainer is gone).
    They were held for the next slot, and a replaced rank's agent closes at once: its last
    step never reached the ledger, which counted the steps redone short (the e2e Xid 79
    drill under load: 14 redone, step 15 printed)."""
    async def body(arbiter: ArbiterProcess) -> None:
        async with running_links(arbiter.address, "ended", 1, progress_interval=60) as (lk,):
            at = await first_step_seen(lk, arbiter.address, "ended")
            lk.report_progress(Progress(step=11), seconds_since_progress=0, hung=False)
            lk.report_exit(ProcessExit(pid=1, code=None, signal=15), 0)  # flushes step 11
            lk.report_progress(Progress(step=13), seconds_since_progress=0, hung=False)
            # what the agent does before it closes the link (arbiter_decider._flush)
            await wait_until(lambda: lk.pending() == 0, 5, "nothing left to send")
            await lk.close()
            await wait_until(lambda: at(13), 5, "step 13 at the arbiter", interval=0.05)

    with ArbiterProcess() as arbiter:
        asyncio.run(body(arbiter))
