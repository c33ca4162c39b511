"""How a rank ended reaches the arbiter: its last step, and an exit while the arbiter is away.

Issue 23, seen under arbiter chaos: `ftagent status` showed step 1 for ranks that had
printed 30 steps (the last progress was not sent with the exit). A job whose agents all
exit 0 while their arbiter restarts is recorded succeeded: test_arbiter_chaos.py's last
kill (it replaced a one-agent test of that here, to keep the suite's time).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc

from ftagent.model import ProcessExit, Progress
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from tests.arbiter_helpers import ArbiterProcess, ftagent_cmd, running_links, wait_until


async def get_job(address: str, job: str) -> pb.JobInfo | None:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            return await pb_grpc.ArbiterStub(ch).GetJob(pb.GetJobRequest(job=job), timeout=5)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                return None
            raise


def test_the_last_progress_goes_with_the_exit() -> None:
    async def body(arbiter: ArbiterProcess) -> None:
        # progress summaries are due every 60 s: only the first is sent at once
        async with running_links(arbiter.address, "last", 1, progress_interval=60) as (lk,):
            lk.arrive(0)
            assert await lk.wait_released(0, 5)
            lk.started(0, released=True)
            lk.report_progress(Progress(step=1), seconds_since_progress=0, hung=False)

            async def rank(step: int | None = None) -> pb.RankInfo | None:
                info = await get_job(arbiter.address, "last")
                r = info.ranks[0] if info and info.ranks else None
                return r if r is not None and (step is None or r.step == step) else None

            await wait_until(lambda: rank(1), 5, "step 1 at the arbiter", interval=0.05)
            lk.report_progress(Progress(step=30), seconds_since_progress=0, hung=False)
            lk.report_exit(ProcessExit(pid=1, code=0, signal=None), 0)

            async def exited() -> bool:
                r = await rank()
                return r is not None and r.HasField("last_exit_status")

            await wait_until(exited, 5, "the exit at the arbiter", interval=0.05)
            r = await rank()
            assert r is not None and r.step == 30 and r.last_exit_status == 0, r

    with ArbiterProcess() as arbiter:
        asyncio.run(body(arbiter))


def test_an_exit_written_to_an_arbiter_killed_unread_reaches_its_successor() -> None:
    """CI's chaos run ended "gone: no agent for 0s (was running)": the arbiter was SIGKILLed
    and the trainers exited 0 before the agents noticed, so each exit went to the dead
    stream (or waited in its queue) and the link dropped it on reconnecting; the rank said
    Hello to the new arbiter and left without its exit. Here the kill, the exit and the
    restart happen with the agent's event loop held (it cannot notice in between): the
    exit is handed to the dead stream every time, and must reach the new arbiter."""
    async def body(arbiter: ArbiterProcess) -> None:
        async with running_links(arbiter.address, "unread", 1) as (lk,):
            lk.arrive(0)
            assert await lk.wait_released(0, 5)
            lk.started(0, released=True)
            arbiter.kill()
            assert lk.connected  # not noticed: the loop has not run since the kill
            lk.report_exit(ProcessExit(pid=1, code=0, signal=None), 0)
            arbiter.start()

            async def succeeded() -> bool:
                info = await get_job(arbiter.address, "unread")
                return info is not None and info.state == "succeeded"

            await wait_until(succeeded, 20, "the job succeeded at the new arbiter",
                             interval=0.05)
            assert await lk.finish(10)  # the new arbiter confirms it read it all

    with ArbiterProcess() as arbiter:
        asyncio.run(body(arbiter))


def test_an_exit_no_arbiter_confirmed_is_left_for_the_next_one(tmp_path: Path) -> None:
    """Issue 36, item 6, outside the cluster: a real agent whose arbiter is gone when its
    trainer exits 0 waits --arbiter-fail-open-after, exits 0 all the same and leaves the exit
    in --exit-notes-dir (the arbiter's --state-dir); the next arbiter reads it and the job
    reads succeeded, not "gone: no agent for Ns (was running)". On the old agent nothing
    was left (checked: with the agent's note removed this fails at the note's line)."""
    state, go = tmp_path / "state", tmp_path / "go"
    trainer = ("import os, sys, time\n"
               "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.02)\n")
    with ArbiterProcess("--state-dir", str(state), log_dir=str(tmp_path)) as arbiter:
        agent = subprocess.Popen(
            [*ftagent_cmd("run"), "--metrics-port=-1", "--arbiter", arbiter.address,
             "--job", "left", "--rank", "0", "--world-size", "1",
             "--arbiter-fail-open-after", "1", "--exit-notes-dir", str(state),
             "--", sys.executable, "-c", trainer, str(go)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            async def running() -> bool:
                info = await get_job(arbiter.address, "left")
                return info is not None and info.state == "running"

            asyncio.run(wait_until(running, 60, "the job running", interval=0.1))
            arbiter.kill()
            go.write_text("done")  # the trainer exits 0 with no arbiter to hear it
            assert agent.wait(60) == 0  # the trainer's code, after the fail-open wait
            err = agent.stderr.read().decode(errors="replace") if agent.stderr else ""
            assert "left this rank's exit (status 0)" in err, err[-2000:]
            notes = list((state / "exits").iterdir())
            assert len(notes) == 1, notes
            arbiter.start()

            async def succeeded() -> bool:
                info = await get_job(arbiter.address, "left")
                return info is not None and info.state == "succeeded"

            asyncio.run(wait_until(succeeded, 30, "the job succeeded", interval=0.1))
            assert not list((state / "exits").iterdir())  # read and removed
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
