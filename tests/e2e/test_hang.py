"""Hang detection on real PyTorch DDP jobs (gloo, CPU), one agent per rank."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import wait_for
from tests.e2e.jobs import needs_torch, start_job

pytestmark = needs_torch

FAST = {"TRAIN_STEP_SLEEP": "0.05", "TRAIN_PG_TIMEOUT": "300"}


def stacks(fault: dict) -> str:  # type: ignore[type-arg]
    return "\n".join(p.get("stack") or "" for p in fault.get("processes", []))


def test_hang_in_collective_is_detected_on_every_rank_with_stacks(tmp_path: Path) -> None:
    job = start_job(tmp_path, 2, flags=["--hang-action", "alert", "--hang-timeout-min", "2"],
                    env={**FAST, "TRAIN_STEPS": "100000", "FAULT_RANK": "1",
                         "FAULT_HANG_AT_STEP": "30"})
    try:
        for r in (0, 1):
            wait_for(lambda r=r: job.faults(r, "hang"), 90, f"hang fault on rank {r}",
                     interval=0.2)
        f1 = job.faults(1, "hang")[0]
        f0 = job.faults(0, "hang")[0]
        # the culprit is stuck in our function; its peer waits inside DDP's backward
        assert "hang_before_collective" in stacks(f1), stacks(f1)
        assert "backward" in stacks(f0), stacks(f0)
        for f in (f0, f1):
            # detected within the budget the detector had learned, plus a second
            assert f["seconds_since_progress"] <= f["budget_seconds"] + 1.0, f
            assert f["last_lines"]
        assert len(job.faults(0, "hang")) == 1, "one fault per hang episode"
    finally:
        job.stop()


def test_data_loading_stall_with_chatty_logs_is_a_hang(tmp_path: Path) -> None:
    job = start_job(tmp_path, 1, flags=["--hang-action", "alert", "--hang-timeout-min", "2"],
                    env={**FAST, "TRAIN_STEPS": "100000", "FAULT_DATA_STALL_AT_STEP": "20"})
    try:
        fault = wait_for(lambda: job.faults(0, "hang"), 90, "hang fault", interval=0.2)[0]
        assert "waiting for data" in job.log(0)
        assert "wait_for_data" in stacks(fault)
    finally:
        job.stop()


def test_healthy_run_with_checkpoint_pauses_raises_no_hang(tmp_path: Path) -> None:
    # A 30x-step checkpoint pause would exceed a learned step budget with this low
    # floor; the "saving checkpoint" markers make it a phase with its own budget.
    job = start_job(tmp_path, 2, flags=["--hang-timeout-min", "0.5"],
                    env={**FAST, "TRAIN_STEPS": "120", "CKPT_EVERY": "30",
                         "CKPT_FACTOR": "30"})
    codes = job.wait(180)
    assert codes == [0, 0], (job.log(0)[-2000:], job.log(1)[-2000:])
    for r in (0, 1):
        assert "saving checkpoint" in job.log(r)
        assert not job.faults(r, "hang"), job.faults(r, "hang")
