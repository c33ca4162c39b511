"""The pod agent (agent/pod.py): N workers built from specs, the pod's reaper and local
group, and a RunResult in torch elastic's shape."""

from __future__ import annotations

import json
import subprocess
import sys

from ftagent.agent.decider import LocalDecider
from ftagent.agent.pod import PodAgent, RunResult, WorkerFailure
from ftagent.agent.worker import WorkerSpec
from ftagent.cmd.run import parse
from ftagent.model import TrainerState


def test_the_exit_status_is_the_first_failing_local_ranks() -> None:
    failed = RunResult(TrainerState.FAILED, {0: 0},
                       {3: WorkerFailure(3, 9, TrainerState.FAILED),
                        1: WorkerFailure(1, 137, TrainerState.FAILED)})
    assert failed.exit_status == 137
    assert RunResult(TrainerState.SUCCEEDED, {0: 0, 1: 0}).exit_status == 0


def test_workers_share_the_pods_reaper_and_decider_and_are_not_patched() -> None:
    pod = PodAgent()
    specs = [WorkerSpec(parse(["--max-restarts", "0", "--", "true"], {}), local_rank=i)
             for i in range(2)]
    workers = [pod.add(s) for s in specs]
    assert all(w.reaper is pod.reaper and w.spec is s for w, s in zip(workers, specs,
                                                                       strict=True))
    assert isinstance(pod.decider, LocalDecider)
    assert all(w.decider is pod.decider for w in workers)  # one decider per pod
    assert pod.decider.workers == workers


POD_SCRIPT = """
import asyncio, json
from ftagent.agent.pod import PodAgent
from ftagent.agent.worker import WorkerSpec
from ftagent.cmd.run import parse
pod = PodAgent()
for i, code in enumerate((0, 4)):
    cfg = parse(["--max-restarts", "0", "--metrics-port", "-1", "--",
                 "sh", "-c", f"exit {code}"], {})
    pod.add(WorkerSpec(cfg, {"PATH": "/usr/bin:/bin"}, local_rank=i))
r = asyncio.run(asyncio.wait_for(pod.run(), 60))
print(json.dumps({"state": r.state.value, "exit": r.exit_status,
                  "failures": {k: [f.exit_status, f.state.value] for k, f in r.failures.items()},
                  "running": [w.trainer.running for w in pod.workers]}))
"""


def test_a_pod_of_two_real_trainers_returns_each_ranks_end() -> None:
    """Local rank 1 exits 4 with no restarts left: the group stops both; the result says
    FAILED, rank 1's own status, and the pod exits with it. (In a process of its own: a
    pod makes its process a sub-reaper and installs signal handlers.)"""
    out = subprocess.run([sys.executable, "-c", POD_SCRIPT], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    got = json.loads(out.splitlines()[-1])
    assert got["state"] == "failed" and got["exit"] == 4
    assert got["failures"]["1"] == [4, "failed"]
    assert got["running"] == [False, False]


BROKEN_CLOSE_SCRIPT = """
import asyncio, json
from ftagent.agent.decider import LocalDecider
from ftagent.agent.pod import PodAgent
from ftagent.agent.worker import WorkerSpec
from ftagent.cmd.run import parse

class BrokenClose(LocalDecider):
    async def close(self, worker):
        await super().close(worker)
        raise AttributeError("the decider's close broke")

pod = PodAgent(BrokenClose())
cfg = parse(["--max-restarts", "0", "--metrics-port", "-1", "--", "sh", "-c", "exit 5"], {})
pod.add(WorkerSpec(cfg, {"PATH": "/usr/bin:/bin"}))
r = asyncio.run(asyncio.wait_for(pod.run(), 60))
print(json.dumps({"exit": r.exit_status, "state": r.state.value}))
"""


def test_a_decider_that_fails_to_close_keeps_the_trainers_exit_status() -> None:
    """The trainer's exit code comes first: a fault in telling the arbiter how the rank
    ended (the decider's close) is logged, and the pod still exits with the trainer's
    status (5 here), not 1 for "worker failed" as on the old code."""
    done = subprocess.run([sys.executable, "-c", BROKEN_CLOSE_SCRIPT], capture_output=True,
                          text=True, timeout=60, check=True)
    got = json.loads(done.stdout.splitlines()[-1])
    assert got == {"exit": 5, "state": "failed"}, done.stderr[-2000:]
    assert "the decider's close broke" in done.stderr
