"""The goodput ledger on a real 2-rank PyTorch job (gloo, CPU) under a real arbiter.

A checkpoint every 5 steps; rank 1 crashes at step 7 (first attempt), then hangs before
the all-reduce of step 12 (second attempt, after 6 steps: past the hang detector's 5
warm-up steps, so its learned budget applies); the job ends at step 15. Each time both
ranks restart, resume from the last checkpoint and redo the steps after it. The ledger's
categories must sum to the job's wall time (from the arbiter's first registration to "job
succeeded", as its timeline stamps them) within 1 %, and its recomputed steps must equal
the steps the trainers actually did twice (their logs: the last step before each restart
minus the step of the next "resumed from checkpoint at step N").
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from tests.arbiter_helpers import ArbiterProcess
from tests.e2e.jobs import FAST, needs_torch, start_job, status, timeline_text

pytestmark = needs_torch


def redone(log: str) -> int:
    """Steps done twice, from one rank's log: for each restart, the last step the run
    before it printed minus the step the next run resumed after."""
    runs = log.split("resumed from checkpoint at step ")
    assert len(runs) == 3, log[-3000:]
    total = 0
    for before, after in zip(runs, runs[1:], strict=False):
        reached = max(int(s) for s in re.findall(r"step=(\d+)/", before))
        total += reached - int(after.split(" ", 1)[0])
    return total


def test_a_crash_and_a_hang_are_accounted_second_by_second_and_step_by_step(
        tmp_path: Path) -> None:
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        launched = time.time()
        job = start_job(tmp_path, 2, flags=["--arbiter", arb.address, "--job", "e2e",
                                            "--max-restarts", "3", "--hang-timeout-min", "2",
                                            "--stop-timeout", "10"],
                        env={**FAST, "TRAIN_STEPS": "15", "TRAIN_STEP_SLEEP": "0.6",
                             "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                             "CHECKPOINT_EVERY": "5", "FAULT_RANK": "1",
                             "FAULT_CRASH_AT_STEP": "7", "FAULT_HANG_AT_STEP": "12",
                             "FAULT_HANG_ATTEMPT": "1"})
        try:
            codes = job.wait(180)
        except subprocess.TimeoutExpired:  # say where it stood (seen once, under a CPU hog)
            st = status(arb.address)
            raise AssertionError(f"the job did not finish in 180 s:\n{timeline_text(st)}\n"
                                 f"{job.log(0)[-1500:]}\n{job.log(1)[-1500:]}") from None
        finally:
            job.stop()
        assert codes == [0, 0], (job.log(0)[-1500:], job.log(1)[-1500:])
        ended = time.time()
        st = status(arb.address)
    g = st["goodput"]
    assert g is not None, st
    seconds = g["seconds"]
    # the arbiter's own stamps: first registration -> "job succeeded"
    stamps = [e["ts"] for e in st["timeline"]]
    done = [e["ts"] for e in st["timeline"] if "job succeeded" in e["message"]]
    assert done, timeline_text(st)
    wall = done[0] - stamps[0]
    assert abs(sum(seconds.values()) - g["wall_seconds"]) < 1e-6, g
    assert abs(g["wall_seconds"] - wall) <= 0.01 * wall, (g, wall)
    # the same job measured from the outside (process start to exit) only adds the agents'
    # own start-up before their first Hello and their exit after the last report
    assert g["wall_seconds"] <= ended - launched
    # every redone step is counted, no more
    want = {redone(job.log(r)) for r in (0, 1)}
    assert want == {g["recomputed_steps"]}, (want, g, timeline_text(st))
    assert g["incidents"] == 2 and st["restarts"] == 2, timeline_text(st)
    for c in ("startup", "productive", "recomputed", "detection", "decision", "restart"):
        assert seconds[c] > 0, (c, g)
    assert 0 < g["ratio"] < 1
    # each incident's stages; the resume step is the one the trainers printed ("resumed
    # from checkpoint at step N", read by the agents), not the first step seen
    incs = g["per_incident"]
    assert [i["resume_source"] for i in incs] == ["reported", "reported"], incs
    assert sum(i["recomputed_steps"] for i in incs) == g["recomputed_steps"], incs
    assert all(i["decide_seconds"] is not None and i["restart_seconds"] is not None
               for i in incs), incs
    assert abs(sum(i["recompute_seconds"] for i in incs) - seconds["recomputed"]) < 1e-6
    # the hang's detection runs from the job's last step: no hang is reported sooner than
    # the budget's floor (--hang-timeout-min 2) after it, whichever rank saw it first
    # (not from a summary's arrival, which can come a 5 s slot after the step)
    assert incs[1]["kind"] == "hang" and incs[1]["detect_seconds"] >= 2.0 - 0.1, incs[1]
    print(f"\nwall {wall:.2f}s (outside {ended - launched:.2f}s); goodput "
          f"{100 * g['ratio']:.1f}%; " + ", ".join(f"{k} {v:.2f}s" for k, v in
                                                      sorted(seconds.items())))
    for i in incs:
        print(f"  g{i['generation']} {i['kind']}: detect {i['detect_seconds']:.2f}s, decide "
              f"{i['decide_seconds']:.2f}s, restart {i['restart_seconds']:.2f}s, recompute "
              f"{i['recompute_seconds']:.2f}s ({i['recomputed_steps']} steps, resumed after "
              f"{i['resumed_step']}, {i['resume_source']})")
