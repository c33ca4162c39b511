"""No false hang on a real PyTorch DDP job (gloo, CPU) with checkpoint pauses.

Real hangs (in a collective, in data loading, on a lock) are declared in
tests/e2e/test_hang_verify.py, on the same kind of job."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.jobs import needs_torch, start_job

pytestmark = needs_torch

FAST = {"TRAIN_STEP_SLEEP": "0.05", "TRAIN_PG_TIMEOUT": "300"}


def test_healthy_run_with_checkpoint_pauses_raises_no_hang(tmp_path: Path) -> None:
    # A 30x-step checkpoint pause would exceed a learned step budget with this low
    # floor; the "saving checkpoint" markers make it a phase with its own budget. Two
    # pauses (steps 20 and 40, both past the 5 warm-up steps) show it; 60 steps, not 120.
    job = start_job(tmp_path, 2, flags=["--hang-timeout-min", "0.5"],
                    env={**FAST, "TRAIN_STEPS": "60", "CKPT_EVERY": "20",
                         "CKPT_FACTOR": "30"})
    codes = job.wait(180)
    assert codes == [0, 0], (job.log(0)[-2000:], job.log(1)[-2000:])
    for r in (0, 1):
        assert "saving checkpoint" in job.log(r)
        assert not job.faults(r, "hang"), job.faults(r, "hang")
