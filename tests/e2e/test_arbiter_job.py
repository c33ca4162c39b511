"""Job-wide decisions on real PyTorch DDP jobs: one agent per rank, a real arbiter."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import PY, wait_for
from tests.e2e.jobs import Job, needs_torch, start_job

pytestmark = needs_torch

FAST = {"TRAIN_STEP_SLEEP": "0.05", "TRAIN_PG_TIMEOUT": "120"}


def status(address: str, job: str = "e2e") -> dict[str, Any]:
    r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", address, job, "--json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def connected(address: str) -> int:
    """Agents connected for the job; 0 while the (restarted) arbiter does not know it yet."""
    r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", address, "e2e", "--json"],
                       capture_output=True, text=True, timeout=30)
    return int(json.loads(r.stdout)["connected"]) if r.returncode == 0 else 0


def timeline_text(st: dict[str, Any]) -> str:
    """The timeline as lines, for an assertion message a person can read."""
    return "\n".join(f"{e['kind']:9} {e.get('action', ''):16} g{e['generation']} "
                     f"r{e.get('rank', '-')} {e['message']}" for e in st["timeline"])


def kinds(st: dict[str, Any]) -> list[str]:
    """Timeline kinds, decisions by their action (restart, dump_stacks, stop, ...)."""
    return [e["action"] if e["kind"] == "decision" else e["kind"] for e in st["timeline"]]


def run_to_success(tmp_path: Path, flags: list[str], fault: dict[str, str]
                   ) -> tuple[Job, dict[str, Any]]:
    """A 2-rank job of 40 steps under a real arbiter with ``fault`` on rank 1; both ranks
    must end with exit 0. Returns the job and the arbiter's final status."""
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        job = start_job(tmp_path, 2, flags=["--arbiter", arb.address, "--job", "e2e", *flags],
                        env={**FAST, "TRAIN_STEPS": "40", "FAULT_RANK": "1", **fault})
        try:
            assert job.wait(150) == [0, 0], (job.log(0)[-1500:], job.log(1)[-1500:])
        finally:
            job.stop()
        return job, status(arb.address)


def test_crash_on_one_rank_restarts_every_rank_through_the_barrier(tmp_path: Path) -> None:
    job, st = run_to_success(tmp_path, [], {"FAULT_CRASH_AT_STEP": "15"})
    k = kinds(st)
    assert k.count("restart") == 1 and k.count("barrier") == 2, timeline_text(st)
    assert k.index("fault") < k.index("restart") < len(k) - 1 - k[::-1].index("barrier")
    assert k[-1] == "succeeded"
    for r in (0, 1):
        ev = job.events(r)
        # both ranks ran twice: generation 0, then 1 after the barrier released
        runs = [e for e in ev if e["event"] == "state" and e["kind"] == "running"]
        assert [e["generation"] for e in runs] == [0, 1]
        assert [e["generation"] for e in ev if e["kind"] == "released"] == [0, 1]
        assert "step=40/40" in job.log(r)
    crash = job.faults(1, "crash")
    assert len(crash) == 1 and crash[0]["exit_code"] == 3


def test_job_hang_dumps_stacks_names_the_culprit_and_restarts(tmp_path: Path) -> None:
    _, st = run_to_success(tmp_path, ["--hang-timeout-min", "2"], {"FAULT_HANG_AT_STEP": "15"})
    k = kinds(st)
    assert "dump_stacks" in k and k.count("restart") == 1, timeline_text(st)
    restart = next(e for e in st["timeline"] if e["action"] == "restart")
    assert "rank 1 is not in a collective" in restart["message"], restart
    assert "hang_before_collective" in restart["message"]


def test_arbiter_killed_mid_job_training_goes_on_and_agents_reregister(tmp_path: Path) -> None:
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        job = start_job(tmp_path, 2, flags=["--arbiter", arb.address, "--job", "e2e"],
                        env={**FAST, "TRAIN_STEPS": "300"})
        try:
            wait_for(lambda: "step=20/" in job.log(0), 90, "training under way", interval=0.1)
            arb.kill()
            steps_at_kill = job.log(0).count("step=")
            wait_for(lambda: job.log(0).count("step=") > steps_at_kill + 20, 30,
                     "training going on without the arbiter", interval=0.1)
            arb.start()  # same port, empty state
            wait_for(lambda: connected(arb.address) == 2, 10,
                     "both agents re-registered", interval=0.2)
            assert job.wait(150) == [0, 0]
        finally:
            job.stop()
        assert kinds(status(arb.address))[-1] == "succeeded"
    for r in (0, 1):
        assert not [e for e in job.events(r) if e["event"] == "action"], "no restart needed"
