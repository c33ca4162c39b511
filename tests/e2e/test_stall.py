"""Issue 35 on real gloo jobs (examples/train.py, one ``ftagent run`` per rank): a frozen
rank, a first save blocked forever, slow remote reads. Floors lowered as in
tests/e2e/test_hang_verify.py so that each job takes seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import wait_for
from tests.e2e.jobs import Job, needs_torch, start_job, status, timeline_text

pytestmark = needs_torch

FLOOR = ["--hang-timeout-min", "2", "--output-interval", "0.1", "--nic", "lo"]


def _trainer_pid(job: Job, rank: int, generation: int) -> int:
    running = [e for e in job.events(rank) if e["event"] == "state"
               and e["kind"] == "running" and e["generation"] == generation]
    return int(running[-1]["pid"]) if running else 0


def _steps(job: Job, rank: int) -> int:
    return job.log(rank).count("step=")


def _frozen(job: Job) -> list[dict[str, Any]]:
    return [f for f in job.faults(1, "hang") if f.get("verdict") == "frozen"]


def test_a_sigstopped_rank_in_a_collective_is_named_frozen_and_trains_again_in_10s(
        tmp_path: Path) -> None:
    """Rank 1's trainer is SIGSTOPped (mostly inside the all-reduce: rank 0 is slower, so
    rank 1 waits in it most of each step). Its agent names it frozen from /proc (state T)
    without stacks it cannot give, and the restart SIGKILLs it at once: a stopped process
    does not act on SIGTERM, which waited out --stop-timeout (30 s) before."""
    trig = tmp_path / "trig"
    trig.mkdir()
    (trig / "slow.0").write_text("5")
    stopped: list[int] = []
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        job = start_job(tmp_path, 2, flags=["--arbiter", arb.address, "--job", "e2e", *FLOOR],
                        env={"TRAIN_STEP_SLEEP": "0.02", "TRAIN_PG_TIMEOUT": "120",
                             "TRAIN_STEPS": "100000", "FAULT_TRIGGER_DIR": str(trig)})
        try:
            wait_for(lambda: _trainer_pid(job, 1, 0) and _steps(job, 1) >= 10, 120,
                     "rank 1 past its warm-up", interval=0.2)
            stopped.append(_trainer_pid(job, 1, 0))
            os.kill(stopped[0], signal.SIGSTOP)
            wait_for(lambda: _frozen(job), 60, "rank 1 named frozen", interval=0.05)
            declared = time.monotonic()
            at = _steps(job, 1)
            wait_for(lambda: _trainer_pid(job, 1, 1) and _steps(job, 1) > at, 60,
                     "rank 1 training at generation 1", interval=0.05)
            again = time.monotonic() - declared
            print(f"frozen: declared -> training again in {again:.1f}s")
            st = status(arb.address)
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.stop()
    (f,) = _frozen(job)
    assert f["rule"] == "F1" and f["culprits"] == [1], f
    assert "frozen: pid " in f["message"] and "stopped" in f["message"], f["message"]
    assert f["severity"] == "error", f
    assert again <= 10.0, (again, timeline_text(st))
    restarts = [e for e in st["timeline"] if e.get("action") == "restart"]
    assert restarts and restarts[0].get("rank") == 1, timeline_text(st)
