"""The arbiter in a real process, agents as ArbiterLinks over loopback gRPC.

Covers the job-wide flows: crash -> RESTART everywhere -> barrier; the per-job budget;
stale faults; REPLACE; a job hang decided from stacks; a barrier that never fills;
``ftagent status``. Waits are on conditions with deadlines, never bare sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator

import grpc
import pytest

from ftagent.agent.reporter import ArbiterLink
from ftagent.model import EXIT_REPLACE, Action, ActionKind, Fault, FaultKind, Progress, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer
from tests.arbiter_helpers import ArbiterProcess, ftagent_cmd, running_links, wait_until

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def arbiter() -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--token", TOKEN, "--stacks-timeout", "5") as a:
        yield a


async def get_job(address: str, job: str) -> pb.JobInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.ArbiterStub(ch).GetJob(pb.GetJobRequest(job=job),
                                                    metadata=bearer(TOKEN), timeout=5)


async def next_actions(links: list[ArbiterLink], timeout: float = 5) -> list[Action]:
    return list(await asyncio.gather(*(asyncio.wait_for(lk.commands.get(), timeout)
                                       for lk in links)))


async def start(links: list[ArbiterLink], generation: int) -> None:
    for lk in links:
        lk.arrive(generation)
    assert all(await asyncio.gather(*(lk.wait_released(generation, 5) for lk in links)))


async def timeline(address: str, job: str, kind: str = "") -> list[pb.TimelineEntry]:
    info = await get_job(address, job)
    return [e for e in info.timeline if not kind or e.kind == kind or e.action == kind]


def test_crash_restarts_every_rank_and_the_barrier_waits_for_all(
        arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        addr = arbiter.address
        async with grpc.aio.insecure_channel(addr) as ch:
            watch = pb_grpc.ArbiterStub(ch).WatchEvents(
                pb.WatchEventsRequest(job="crash"), metadata=bearer(TOKEN))
            async with running_links(addr, "crash", 3, token=TOKEN) as links:
                await start(links, 0)
                links[1].report_fault(Fault(FaultKind.CRASH, "trainer exited with code 3",
                                            evidence={"exit_status": 3}))
                actions = await next_actions(links)
                assert {(a.kind, a.generation) for a in actions} == {(ActionKind.RESTART, 1)}
                assert all(lk.generation == 0 for lk in links)  # until they arrive at 1
                assert "rank 1" in actions[0].reason
                links[0].arrive(1)
                links[1].arrive(1)

                async def two_arrived() -> bool:
                    return "2/3 arrived" in (await get_job(addr, "crash")).barrier
                await wait_until(two_arrived, 5, "2 of 3 arrivals")
                assert links[0].released_generation == 0
                links[2].arrive(1)
                assert all(await asyncio.gather(*(lk.wait_released(1, 5) for lk in links)))
                info = await get_job(addr, "crash")
                assert (info.generation, info.restarts, info.state) == (1, 1, "running")
                assert [r.state for r in info.ranks] == ["running"] * 3
            kinds = []
            async for e in watch:
                kinds.append(e.action or e.kind)
                if e.action == "release_barrier" and e.generation == 1:
                    break
            watch.cancel()
            assert kinds.index("fault") < kinds.index("restart") < len(kinds) - 1
    asyncio.run(body())


def test_restart_budget_is_per_job_then_stop_with_the_exit_code(
        arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        async with running_links(arbiter.address, "budget", 2, token=TOKEN,
                                 max_restarts=1) as links:
            await start(links, 0)
            links[0].report_fault(Fault(FaultKind.CRASH, "boom", evidence={"exit_status": 1}))
            assert {a.kind for a in await next_actions(links)} == {ActionKind.RESTART}
            await start(links, 1)
            # a late fault of generation 0 from the other rank decides nothing
            late = Fault(FaultKind.CRASH, "late")
            links[1].report_fault(late, generation=0)
            await wait_until(lambda: not links[1].proto.faults, 5, "the late fault's ack")
            ignored = await timeline(arbiter.address, "budget", "ignore")
            assert len(ignored) == 1 and ignored[0].fault_id == late.id
            links[1].report_fault(Fault(FaultKind.CRASH, "again"), exit_status=5)
            actions = await next_actions(links)
            assert {(a.kind, a.exit_code) for a in actions} == {(ActionKind.STOP, 5)}
            assert "budget spent (1/1)" in actions[0].reason
            assert all(lk.commands.empty() for lk in links)
            assert (await get_job(arbiter.address, "budget")).state == "stopped"
    asyncio.run(body())


def test_fatal_gpu_fault_replaces_its_rank(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        async with running_links(arbiter.address, "gpu", 3, token=TOKEN) as links:
            await start(links, 0)
            links[2].report_fault(Fault(FaultKind.GPU, "Xid 79: fallen off the bus",
                                        severity=Severity.FATAL))
            actions = await next_actions(links)
            assert [a.kind for a in actions] == [ActionKind.RESTART, ActionKind.RESTART,
                                                 ActionKind.REPLACE]
            assert actions[2].exit_code == EXIT_REPLACE and actions[2].target_rank == 2
            assert {a.generation for a in actions} == {1}
    asyncio.run(body())


def test_job_hang_collects_stacks_and_names_the_culprit(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        async with running_links(arbiter.address, "hang", 3, token=TOKEN) as links:
            await start(links, 0)
            for lk in links:
                lk.report_progress(Progress(step=41), seconds_since_progress=90, hung=False)

            async def steps_seen() -> bool:
                return all(r.step == 41 for r in (await get_job(arbiter.address,
                                                                "hang")).ranks)
            await wait_until(steps_seen, 5, "progress of every rank")
            links[0].report_fault(Fault(FaultKind.HANG, "no step for 90s"))
            dumps = await next_actions(links)
            assert {a.kind for a in dumps} == {ActionKind.DUMP_STACKS}
            for r, (lk, a) in enumerate(zip(links, dumps, strict=True)):
                fn = "__next__" if r == 1 else "all_reduce"
                lk.report_stacks(a.id, json.dumps([{"thread_name": "MainThread", "frames": [
                    {"name": fn, "filename": "x.py", "line": 3}]}]))
            restarts = await next_actions(links)
            assert {(a.kind, a.generation) for a in restarts} == {(ActionKind.RESTART, 1)}
            assert "culprit ranks 1 (pod " in restarts[0].reason
            (decided,) = [e for e in (await get_job(arbiter.address, "hang")).timeline
                          if e.action == "restart"]
            assert [c.rank for c in decided.culprits] == [1]  # the culprit as data
    asyncio.run(body())


def test_barrier_timeout_stops_the_job_naming_the_missing_rank() -> None:
    async def body(address: str) -> None:
        async with running_links(address, "short", 3, ranks=(0, 1)) as links:
            for lk in links:
                lk.arrive(0)
            actions = await next_actions(links, timeout=10)
            assert {a.kind for a in actions} == {ActionKind.STOP}
            assert "missing rank 2" in actions[0].reason
            assert not links[0].released_generation >= 0
    with ArbiterProcess("--barrier-timeout", "1") as a:
        asyncio.run(body(a.address))


def test_status_cli_shows_ranks_and_timeline(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        async with running_links(arbiter.address, "shown", 2, token=TOKEN) as links:
            await start(links, 0)
            links[1].report_progress(Progress(step=7, loss=2.5), seconds_since_progress=1,
                                     hung=False)
            links[0].report_fault(Fault(FaultKind.CRASH, "segfault"), exit_status=139)
            await next_actions(links)
            env = {"FTAGENT_ARBITER": arbiter.address, "FTAGENT_TOKEN": TOKEN}

            def status(*args: str) -> str:
                p = subprocess.run(ftagent_cmd("status", *args), capture_output=True, text=True,
                                   timeout=30, env={**os.environ, **env})
                assert p.returncode == 0, p.stderr
                return p.stdout
            listing = await asyncio.to_thread(status)
            assert "shown" in listing and "restarting" in listing
            human = await asyncio.to_thread(status, "shown")
            assert "pod-1" in human and "segfault" in human and "restart" in human
            data = json.loads(await asyncio.to_thread(status, "shown", "--json"))
            assert data["generation"] == 1 and data["restarts"] == 1
            assert [(r["rank"], r["step"], r["loss"]) for r in data["ranks"]] == [
                (0, -1, None), (1, 7, 2.5)]
            assert any(e["action"] == "restart" for e in data["timeline"])
            bad = subprocess.run(ftagent_cmd("status", "--arbiter", arbiter.address, "nope"),
                                 capture_output=True, text=True, timeout=30,
                                 env={**os.environ, "FTAGENT_TOKEN": TOKEN})
            assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr
    asyncio.run(body())


def test_a_stopped_job_starts_afresh_once_all_its_agents_are_gone(
        arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        async with running_links(arbiter.address, "again", 2, token=TOKEN,
                                 max_restarts=0) as links:
            links[0].report_fault(Fault(FaultKind.CRASH, "boom"), exit_status=2)
            assert {a.kind for a in await next_actions(links)} == {ActionKind.STOP}

        async def all_gone() -> bool:
            return (await get_job(arbiter.address, "again")).connected == 0
        await wait_until(all_gone, 5, "the stopped run's agents to leave")
        async with running_links(arbiter.address, "again", 2, token=TOKEN) as links:
            await start(links, 0)
            info = await get_job(arbiter.address, "again")
            assert (info.state, info.restarts, info.max_restarts) == ("running", 0, 3)
            assert any("new run" in e.message for e in info.timeline)
    asyncio.run(body())
