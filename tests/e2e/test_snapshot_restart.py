"""Restart from memory: a real 2-rank PyTorch job (gloo, CPU) under a real arbiter, with
in-memory snapshots (examples/train.py SNAPSHOT_EVERY=3: ``ftagent.checkpoint``).

Rank 1 crashes at step 8 (first attempt), then hangs before the all-reduce of step 14
(second attempt); the job ends at step 18. Each restart must resume at the newest step
whose snapshot every rank holds (6, then 12: the arbiter's FTAGENT_RESUME_STEP, loaded
from memory), and the ledger's recomputed steps must equal the steps the trainers redid
(their logs: the last step before each restart minus the next "snapshot loaded: step
N"), at most one snapshot interval each, its source "memory".
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from pathlib import Path

from tests.arbiter_helpers import ArbiterProcess
from tests.e2e.jobs import FAST, needs_torch, start_job, status, timeline_text

pytestmark = needs_torch

EVERY = 3
# the host's other links are other tests' veths (a shared machine): a NIC fault of theirs
# is not this job's (as in test_fr_verdict)
ONLY_LO = ["--nic", "lo"]


def loaded_and_redone(log: str) -> tuple[list[int | None], list[int]]:
    """The step each attempt loaded (None: none) and, per restart, the steps redone."""
    runs = log.split("snapshot loaded: ")[1:]  # one per attempt
    loads = [int(m.group(1)) if (m := re.match(r"step (\d+)", r)) else None for r in runs]
    redone = []
    for before, step in zip(runs, loads[1:], strict=False):
        reached = max(int(s) for s in re.findall(r"step=(\d+)/", before))
        redone.append(reached - (step or 0))
    return loads, redone


def test_a_crash_and_a_hang_resume_at_the_newest_complete_snapshot(tmp_path: Path) -> None:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    snapdir = shm / f"ftagent-test-{uuid.uuid4().hex[:8]}"  # tmpfs, as in a pod
    try:
        with ArbiterProcess(log_dir=str(tmp_path)) as arb:
            job = start_job(tmp_path, 2, flags=[
                "--arbiter", arb.address, "--job", "e2e", "--max-restarts", "3",
                "--hang-timeout-min", "2", "--stop-timeout", "10",
                "--snapshot-dir", str(snapdir), *ONLY_LO],
                env={**FAST, "TRAIN_STEPS": "18", "TRAIN_STEP_SLEEP": "0.5",
                     "SNAPSHOT_EVERY": str(EVERY), "FAULT_RANK": "1",
                     "FAULT_CRASH_AT_STEP": "8", "FAULT_HANG_AT_STEP": "14",
                     "FAULT_HANG_ATTEMPT": "1"})
            try:
                codes = job.wait(240)
            except subprocess.TimeoutExpired:
                st = status(arb.address)
                raise AssertionError(f"the job did not finish in 240 s:\n{timeline_text(st)}\n"
                                     f"{job.log(0)[-1500:]}\n{job.log(1)[-1500:]}") from None
            finally:
                job.stop()
            assert codes == [0, 0], (job.log(0)[-2000:], job.log(1)[-2000:])
            st = status(arb.address)
        logs = [job.log(r) for r in (0, 1)]
        for log in logs:
            loads, redone = loaded_and_redone(log)
            # attempt 0 found none; then the newest step both ranks held: 6, then 12
            assert loads == [None, 6, 12], (loads, log[-3000:])
            assert all(0 <= n <= EVERY for n in redone), (redone, log[-3000:])
            assert "resumed after step 6 from memory" in log
            assert "resumed after step 12 from memory" in log
        g = st["goodput"]
        incs = g["per_incident"]
        assert [i["kind"] for i in incs] == ["crash", "hang"], timeline_text(st)
        assert [i["resumed_step"] for i in incs] == [6, 12], incs
        assert [i["resume_source"] for i in incs] == ["memory", "memory"], incs
        want = {sum(loaded_and_redone(log)[1]) for log in logs}
        assert want == {g["recomputed_steps"]}, (want, incs)
        assert all(i["recomputed_steps"] <= EVERY for i in incs), incs
        # status shows the newest step every rank holds (after the job: 15, kept in memory)
        assert st.get("snapshot_step") == 15, st.get("snapshot_step")
        print("\n" + ", ".join(f"g{i['generation']} {i['kind']}: resumed after "
                               f"{i['resumed_step']} ({i['resume_source']}), "
                               f"{i['recomputed_steps']} steps redone" for i in incs))
    finally:
        shutil.rmtree(snapdir, ignore_errors=True)


def test_four_ranks_a_crash_resumes_every_rank_at_the_newest_complete_snapshot(
        tmp_path: Path) -> None:
    """4 ranks (one agent each); rank 3 crashes at step 8: every rank loads step 6 from
    memory, the ledger counts the steps redone."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    snapdir = shm / f"ftagent-test-{uuid.uuid4().hex[:8]}"
    try:
        with ArbiterProcess(log_dir=str(tmp_path)) as arb:
            job = start_job(tmp_path, 4, flags=[
                "--arbiter", arb.address, "--job", "e2e", "--max-restarts", "2",
                "--stop-timeout", "10", "--snapshot-dir", str(snapdir), *ONLY_LO],
                env={**FAST, "TRAIN_STEPS": "11", "TRAIN_STEP_SLEEP": "0.5",
                     "SNAPSHOT_EVERY": str(EVERY), "FAULT_RANK": "3",
                     "FAULT_CRASH_AT_STEP": "8"})
            try:
                codes = job.wait(300)
            except subprocess.TimeoutExpired:
                st = status(arb.address)
                raise AssertionError(f"the job did not finish in 300 s:\n{timeline_text(st)}\n"
                                     f"{job.log(3)[-1500:]}") from None
            finally:
                job.stop()
            assert codes == [0, 0, 0, 0], [job.log(r)[-1500:] for r in range(4)]
            st = status(arb.address)
        logs = [job.log(r) for r in range(4)]
        for log in logs:
            loads, redone = loaded_and_redone(log)
            assert loads == [None, 6], (loads, log[-3000:])
            assert all(0 <= n <= EVERY for n in redone), (redone, log[-3000:])
        (inc,) = st["goodput"]["per_incident"]
        assert (inc["kind"], inc["resumed_step"], inc["resume_source"]) == \
            ("crash", 6, "memory"), inc
        want = {sum(loaded_and_redone(log)[1]) for log in logs}
        assert want == {st["goodput"]["recomputed_steps"]}, (want, inc)
    finally:
        shutil.rmtree(snapdir, ignore_errors=True)
