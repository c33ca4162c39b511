"""The arbiter names a hang's culprit from PyTorch's flight recorder, on a real 2-rank
gloo DDP job (examples/train.py, unchanged), one ``ftagent run`` per rank: rank 1 stops
before its step's all-reduce, rank 0 waits inside it. The agents dump their ranks'
flight recorders through the sitecustomize trigger when the arbiter asks for stacks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ftagent.model import EXIT_STOP
from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import PY, free_port, ftagent_cmd, wait_for
from tests.e2e.jobs import FAST, connected, needs_torch, start_job, status

pytestmark = needs_torch

FLOOR = ["--hang-timeout-min", "2", "--output-interval", "0.1"]


def test_rank_that_never_enqueues_the_allreduce_is_named_by_the_flight_recorder(
        tmp_path: Path) -> None:
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        job = start_job(tmp_path, 2, flags=["--arbiter", arb.address, "--job", "e2e", *FLOOR],
                        env={**FAST, "TRAIN_STEPS": "30", "FAULT_RANK": "1",
                             "FAULT_HANG_AT_STEP": "20"})
        try:
            codes = job.wait(240)
        finally:
            job.stop()
        st = status(arb.address)
    assert codes == [0, 0], (job.log(0)[-2000:], job.log(1)[-2000:])
    restarts = [e for e in st["timeline"] if "flight recorder:" in str(e)]
    assert len(restarts) == 1, st["timeline"]
    text = str(restarts[0])
    assert "rank 1 at #" in text and "never reached collective #" in text, text
    assert "(all_reduce) of process group 0; rank 0 waits in it" in text, text
    # the agents' own hang faults carry the dumps' summaries as evidence too
    for r in (0, 1):
        (f,) = job.faults(r, "hang")
        fr = f["flight_recorder"]
        assert [s["rank"] for s in fr["summaries"]] == [r], fr


# A user's program with a bug: at step 10 rank 1 calls all_gather where rank 0 calls
# all_reduce. Nothing in it knows of ftagent; progress is its own "step=N/M" lines.
MISMATCH = """
import datetime, os, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
t = torch.ones(4)
for step in range(1, 31):
    if step == 10 and rank == 1:
        dist.all_gather([torch.empty(4), torch.empty(4)], t)
    else:
        dist.all_reduce(t)
    time.sleep(0.05)
    print(f"step={step}/30 loss=1.0", flush=True)
"""


def test_a_collective_mismatch_is_named_restarted_once_then_stops(tmp_path: Path) -> None:
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    port = free_port()
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        procs = []
        for r in range(2):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
            cmd = ftagent_cmd("--arbiter", arb.address, "--job", "e2e", "--rank", str(r),
                              "--world-size", "2", *FLOOR, cmd=[PY, str(script)])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        try:
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        st = status(arb.address)
    decisions = [e for e in st["timeline"] if e.get("kind") == "decision"
                 and e.get("action") in ("restart", "stop")]
    assert [e["action"] for e in decisions] == ["restart", "stop"], decisions
    restart, stop = decisions[0]["message"], decisions[1]["message"]
    assert "flight recorder: collective mismatch (op) at #10 of process group 0: " \
        "rank 0 all_reduce([4] Float) but rank 1 all_gather([4] Float)" in restart, restart
    assert "the same collective mismatch as before the last restart" in stop, stop
    assert codes == [EXIT_STOP, EXIT_STOP]  # the agents' --exit-stop: a permanent failure


# Two data-parallel groups {0,1} and {2,3} inside the world group; at step 10 rank 3
# skips its data-parallel all-reduce: rank 2 waits in it, ranks 0, 1 and 3 in the world's
# all-reduce. Every rank's stack shows a collective; by stacks alone (--fr-buffer-size 0)
# the arbiter blames rank 2, a victim: "rank 2 stack differs from the other 3 ranks".
INNER = """
import datetime, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
dp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
t = torch.ones(4)
for step in range(1, 1000):
    if not (step == 10 and rank == 3):
        dist.all_reduce(t, group=dp)
    dist.all_reduce(t)
    time.sleep(0.05)
    print(f"step={step}/1000 loss=1.0", flush=True)
"""


def test_the_culprit_is_found_in_the_inner_group(tmp_path: Path) -> None:
    script = tmp_path / "inner.py"
    script.write_text(INNER)
    port = free_port()
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        procs = []
        for r in range(4):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
            cmd = ftagent_cmd("--arbiter", arb.address, "--job", "e2e", "--rank", str(r),
                              "--world-size", "4", *FLOOR, cmd=[PY, str(script)])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        try:
            wait_for(lambda: connected(arb.address) == 4, 120, "4 agents registered",
                     interval=0.2)
            restart = wait_for(lambda: [e for e in status(arb.address)["timeline"]
                                        if e.get("action") == "restart"], 180,
                               "the job hang's restart", interval=0.5)[0]
        finally:
            for p in procs:
                p.kill()
                p.wait()
    text = restart["message"]
    assert "flight recorder: rank 3 at #9 never reached collective #10 (all_reduce) of " \
        "process group 2; rank 2 waits in it" in text, text
    assert restart["rank"] == 3, restart
