"""Stragglers named through a real arbiter: step timings travel in the agents' real
ProgressSummaries (gRPC on loopback), the arbiter's straggler check names the slow rank on
the timeline, in ``ftagent status`` and in ``ftagent_rank_straggler``; a healthy job has
none."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

from ftagent.model import CollectiveSample, Progress
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until
from tests.conftest import ftagent_cmd, wait_for

_METRICS = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


def status(address: str, job: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "ftagent", "status", "--arbiter", address,
                        "--json", "--timeline", "0", job], capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def stragglers(address: str, job: str) -> list[dict]:
    return [e for e in status(address, job).get("timeline", [])
            if e.get("kind") == "fault" and "straggler" in e.get("message", "")]


def stragglers_once_known(address: str, job: str) -> list[dict]:
    try:
        return stragglers(address, job)
    except AssertionError:  # the agents have not registered yet
        return []


def metrics_port(arbiter: ArbiterProcess) -> int:
    m = wait_for(lambda: _METRICS.search(arbiter.log_text()), 10, "the metrics port")
    return int(m.group(1))


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_synchronous_job_slow_compute_rank_named_not_its_waiting_peers() -> None:
    """Every rank's step takes the same 0.3 s (synchronous); rank 1 computes 0.28 s and
    waits 0.02 s in the all_reduce, the others compute 0.1 s and wait 0.2 s for it."""
    async def body(address: str, port: int) -> None:
        async with running_links(address, "synced", 3, progress_interval=0.2) as links:
            for lk in links:
                lk.arrive(0)
            assert all(await asyncio.gather(*(lk.wait_released(0, 10) for lk in links)))
            t0 = time.monotonic()

            async def feed() -> None:
                step = 0
                while True:
                    for lk in links:
                        wait = 0.02 if lk.identity.rank == 1 else 0.2
                        lk.observe_timing(CollectiveSample("all_reduce", 1 << 20, wait, 3))
                        lk.report_progress(Progress(step, ts=t0 + 0.3 * step),
                                           seconds_since_progress=0.0, hung=False)
                    step += 1
                    await asyncio.sleep(0.05)

            task = asyncio.create_task(feed())
            try:
                await wait_until(lambda: "ftagent_rank_straggler{" in scrape(port), 30,
                                 "a straggler in the arbiter's /metrics")
            finally:
                task.cancel()
            text = scrape(port)
            assert re.search(r'ftagent_rank_straggler\{job_name="synced",namespace="",'
                             r'node="node-1",rank="1"\} 1\.0', text), text
            assert re.search(r'ftagent_job_stragglers\{job_name="synced",namespace=""\} 1\.0', text)
            found = await asyncio.to_thread(stragglers, address, "synced")
        assert [e["rank"] for e in found] == [1]
        msg = found[0]["message"]
        assert "rank 1 on node node-1" in msg and "slow in compute" in msg
        got = await asyncio.to_thread(status, address, "synced")
        states = {r["rank"]: r["state"] for r in got["ranks"]}
        assert "straggler" in states[1] and "straggler" not in states[0] + states[2]
        decisions = [e for e in got["timeline"] if e.get("kind") == "decision"
                     and "straggler" in e.get("message", "")]
        assert decisions and all(e["action"] == "alert_only" for e in decisions)

    with ArbiterProcess("--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                        "--straggler-window", "1") as arbiter:
        asyncio.run(body(arbiter.address, metrics_port(arbiter)))


TRAINER = textwrap.dedent("""\
    import os, sys, time
    import ftagent
    slow = float(os.environ.get("EXTRA", "0"))
    for step in range(100000):
        time.sleep(0.05 + slow)  # the slow rank's step has a sleep of its own
        ftagent.step(step)
""")


def test_slow_rank_under_ftagent_run_named_healthy_job_none(tmp_path: Path) -> None:
    script = tmp_path / "steps.py"
    script.write_text(TRAINER)
    with ArbiterProcess("--straggler-window", "3") as arbiter:
        procs = []
        try:
            for job, extra in (("slowjob", {2: "0.15"}), ("healthy", {})):
                for rank in range(3):
                    cmd = ftagent_cmd("--arbiter", arbiter.address, "--job", job,
                                      "--rank", str(rank), "--world-size", "3",
                                      "--node", f"{job}-node-{rank}", "--progress", "sdk",
                                      cmd=[sys.executable, str(script)])
                    env = {"EXTRA": extra.get(rank, "0"), "PATH": "/usr/bin:/bin",
                           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
                    log = open(tmp_path / f"{job}-{rank}.log", "wb")  # noqa: SIM115
                    procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
                    log.close()
            found = wait_for(lambda: stragglers_once_known(arbiter.address, "slowjob"), 90,
                             "rank 2 of slowjob named a straggler", interval=1.0)
            assert [e["rank"] for e in found] == [2]
            assert "slowjob-node-2" in found[0]["message"]
            # the healthy job ran as long, through as many assessments: none
            assert stragglers(arbiter.address, "healthy") == []
            ranks = status(arbiter.address, "healthy")["ranks"]
            assert len(ranks) == 3 and all(r["step"] > 20 for r in ranks)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=30)
