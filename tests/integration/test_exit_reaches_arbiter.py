"""How a rank ended reaches the arbiter: its last step, and an exit while the arbiter is away.

Issue 23, seen under arbiter chaos: `ftagent status` showed step 1 for ranks that had
printed 30 steps (the last progress was not sent with the exit), and a job whose agents
all exited 0 while their arbiter restarted was recorded "gone (was running)".
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc

from ftagent.model import ProcessExit, Progress
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until
from tests.conftest import ftagent_cmd


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


def test_an_exit_while_the_arbiter_restarts_reaches_the_new_one(tmp_path: Path) -> None:
    go = tmp_path / "go"
    trainer = ["sh", "-c", f'echo "step: 1  loss: 1.0"; while [ ! -e {go} ]; do sleep 0.05; '
               'done; exit 0']
    with ArbiterProcess() as arbiter:
        agent = subprocess.Popen(
            ftagent_cmd("--arbiter", arbiter.address, "--job", "away", "--world-size", "1",
                        cmd=trainer), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        lines: list[str] = []
        try:
            async def running() -> bool:
                info = await get_job(arbiter.address, "away")
                return info is not None and info.state == "running" and info.connected == 1

            asyncio.run(wait_until(running, 30, "the job running", interval=0.1))
            arbiter.kill()
            go.touch()  # the trainer exits 0 while no arbiter runs
            assert agent.stderr is not None
            for line in agent.stderr:  # the agent waits for an arbiter before it leaves
                lines.append(line)
                if "the arbiter is away at exit" in line:
                    break
            else:
                raise AssertionError("the agent left without waiting:\n" + "".join(lines))
            arbiter.start()  # same port, empty state: the agent re-registers, then leaves
            lines.extend(agent.stderr)
            assert agent.wait(timeout=60) == 0, "".join(lines)[-3000:]
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        info = asyncio.run(get_job(arbiter.address, "away"))
        assert info is not None and info.state == "succeeded", (info, "".join(lines)[-3000:])
