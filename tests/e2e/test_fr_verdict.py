"""The arbiter names a hang's culprit from PyTorch's flight recorder, on real gloo jobs, one
``ftagent run`` per rank (issue 22's list): a rank that never enqueues the all-reduce, a
SIGSTOPped trainer and a frozen rank (one examples/train.py job, unchanged); an op then a
size mismatch (restarted, then stopped); a culprit in the inner group of a 3-group job.
The agents dump their ranks' flight recorders through the sitecustomize trigger when the
arbiter asks for stacks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from ftagent.model import EXIT_STOP
from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import PY, free_port, ftagent_cmd, wait_for
from tests.e2e.jobs import (
    connected,
    needs_torch,
    start_job,
    status,
    steps,
    timeline_text,
    trainer_pid,
)

pytestmark = needs_torch

# --nic lo: the agents watch only loopback, these jobs' transport; a link another test on
# the machine creates and deletes would otherwise raise NIC faults that defer the hang's
# decision until "the link is back" (seen on a shared host: no restart within minutes).
FLOOR = ["--hang-timeout-min", "2", "--output-interval", "0.1", "--nic", "lo"]


# A user's program with a bug, at step 10, different on each attempt (the attempt number is
# the agent's FTAGENT_RESTART_COUNT, as examples/train.py's fault knobs read it): first rank
# 1 calls all_gather where rank 0 calls all_reduce (an op mismatch); after the restart both
# call all_reduce with different sizes, 4 MB and 8 MB (a size mismatch: gloo does not
# abort on it at these sizes, rank 0 completes its half and waits in #11, rank 1 waits
# for the rest in #10 -- smaller tensors make gloo abort the receiver, a crash). Nothing
# else in it knows of ftagent; progress is its own "step=N/M" lines.
MISMATCH = """
import datetime, os, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
attempt = int(os.environ.get("FTAGENT_RESTART_COUNT", "0"))
t = torch.ones(4)
for step in range(1, 31):
    if step == 10 and rank == 1 and attempt == 0:
        dist.all_gather([torch.empty(4), torch.empty(4)], t)
    elif step == 10 and attempt > 0:
        dist.all_reduce(torch.ones(1_000_000 * (rank + 1)))
    else:
        dist.all_reduce(t)
    time.sleep(0.05)
    print(f"step={step}/30 loss=1.0", flush=True)
"""


def test_op_then_size_mismatches_are_named_each_restarted_once_then_stopped(
        tmp_path: Path) -> None:
    """The op mismatch restarts; the size mismatch is another mismatch, so it restarts
    too; the same size mismatch again at the same place STOPs: a program error."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    port = free_port()
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        procs = []
        for r in range(2):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
            cmd = ftagent_cmd("--arbiter", arb.address, "--job", "e2e", "--rank", str(r),
                              "--world-size", "2", *FLOOR,
                              cmd=[PY, str(script)])
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
    assert [e["action"] for e in decisions] == ["restart", "restart", "stop"], \
        timeline_text(st)
    op, sizes, stop = (d["message"] for d in decisions)
    assert "flight recorder: collective mismatch (op) at #10 of process group 0: " \
        "rank 0 all_reduce([4] Float) but rank 1 all_gather([4] Float)" in op, op
    assert "flight recorder: collective mismatch (sizes) at #10 of process group 0: " \
        "rank 0 all_reduce([1000000] Float) but rank 1 all_reduce([2000000] Float)" \
        in sizes, sizes
    assert "the same collective mismatch as before the last restart" in stop, stop
    assert "collective mismatch (sizes) at #10" in stop, stop
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
            ranks = {r["rank"]: r for r in status(arb.address)["ranks"]}
        finally:
            for p in procs:
                p.kill()
                p.wait()
    text = restart["message"]
    assert "flight recorder: rank 3 at #9 never reached collective #10 (all_reduce) of " \
        "process group 2; rank 2 waits in it" in text, text
    assert restart["rank"] == 3, restart
    # the culprit as data in the status JSON, and named in the message's one form
    pod, node = ranks[3]["pod"], ranks[3]["node"]
    assert restart["culprits"] == [{"rank": 3, "pod": pod, "node": node}], restart
    assert f"; culprit ranks 3 (pod {pod or '-'}, node {node or '-'}); every rank restarts" \
        in text, text


def _restarts(address: str) -> list[dict[str, Any]]:
    return [e for e in status(address)["timeline"] if e.get("action") == "restart"]


# examples/train.py, unchanged, with its fault triggers (FAULT_TRIGGER_DIR): rank 0 is slow
# throughout (slow.0: its steps sleep 0.1 s, rank 1's 0.02 s), so rank 1 spends ~80 % of
# its time inside the all-reduce, waiting for rank 0. One job, four faults on rank 1:
# 1. it stops before its step's all-reduce (hang.1): it never enqueues collective #N+1,
#    rank 0 waits in it;
# 2. after the restart its trainer is SIGSTOPped (inside the all-reduce, mostly): its agent
#    answers the arbiter, the trainer cannot dump; rank 0's dump shows it waiting;
# 3. on the next attempt it spins in pure Python at step SPIN_AT (FAULT_SPIN_AT_STEP, attempt
#    2 only) while rank 0 waits on it in the all-reduce: rank 0 is verified waiting and asks
#    the arbiter, whose stacks show rank 1 spinning and rank 0 waiting: BUSY, rank 1 the
#    spin culprit, declared at --hang-culprit-spin-timeout (CULPRIT_SPIN s, not the 120 s of
#    --hang-spin-timeout) and restarted, named;
# 4. after the next restart all of rank 1 (agent and trainer) is frozen: a node gone dark,
#    whose sockets stay open, so rank 0 waits rather than fails; rank 1 sends nothing.
# --max-restarts 4: one per fault (the arbiter's default, 3, stops at the fourth).
# --stacks-timeout 6: the frozen rank is named at that deadline; the stopped trainer's agent
# answers within it (its verification window, 2 s, and the dump trigger's 2 s, together;
# before evidence.py stopped retrying py-spy on a stopped process, ~14 s).
SPIN_AT = 12
CULPRIT_SPIN = 4.0


def test_a_rank_behind_a_stopped_trainer_a_spinning_one_and_a_frozen_rank_are_named(
        tmp_path: Path) -> None:
    trig = tmp_path / "trig"
    trig.mkdir()
    (trig / "slow.0").write_text("5")
    frozen: list[int] = []
    with ArbiterProcess("--stacks-timeout", "6", "--max-restarts", "4",
                        log_dir=str(tmp_path)) as arb:
        job = start_job(tmp_path, 2, flags=["--arbiter", arb.address, "--job", "e2e",
                                            "--stop-timeout", "1",
                                            "--hang-culprit-spin-timeout", str(CULPRIT_SPIN),
                                            *FLOOR],
                        env={"TRAIN_STEP_SLEEP": "0.02", "TRAIN_PG_TIMEOUT": "120",
                             "TRAIN_STEPS": "100000", "FAULT_TRIGGER_DIR": str(trig),
                             "FAULT_RANK": "1", "FAULT_SPIN_AT_STEP": str(SPIN_AT),
                             "FAULT_SPIN_ATTEMPT": "2"})
        try:
            def trains(generation: int, count: int) -> None:
                """Rank 1 at ``generation`` past its hang detector's warm-up (5 steps)."""
                at = steps(job, 1)
                wait_for(lambda: trainer_pid(job, 1, generation) and
                         steps(job, 1) >= at + count, 120,
                         f"rank 1 training at generation {generation}", interval=0.2)

            trains(0, 8)
            (trig / "hang.1").touch()
            wait_for(lambda: _restarts(arb.address), 120, "the first restart", interval=0.3)
            trains(1, 8)
            frozen.append(trainer_pid(job, 1, 1))
            os.kill(frozen[-1], signal.SIGSTOP)
            wait_for(lambda: _restarts(arb.address)[1:], 120, "the second restart",
                     interval=0.3)
            with contextlib.suppress(ProcessLookupError):  # the agent's SIGKILL may be later
                os.kill(frozen.pop(), signal.SIGKILL)
            # attempt 2 spins at step SPIN_AT by itself
            wait_for(lambda: _restarts(arb.address)[2:], 120, "the spin's restart",
                     interval=0.3)
            trains(3, 8)
            frozen += [job.procs[1].pid, trainer_pid(job, 1, 3)]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            wait_for(lambda: _restarts(arb.address)[3:], 120, "the fourth restart",
                     interval=0.3)
        finally:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.stop()
        behind, stopped, spun, dead = _restarts(arb.address)[:4]
    assert [d["rank"] for d in (behind, stopped, spun, dead)] == [1, 1, 1, 1], \
        (behind, stopped, spun, dead)
    # every restart names rank 1 as data and in one form, whichever rank reported the
    # hang first (rank 0 waiting on it, or rank 1's own agent: the spin)
    for d in (behind, stopped, spun, dead):
        assert [c["rank"] for c in d["culprits"]] == [1], d
        assert "; culprit ranks 1 (pod " in d["message"], d["message"]
    text = behind["message"]
    assert "flight recorder: rank 1 at #" in text and "never reached collective #" in text, text
    assert "(all_reduce) of process group 0; rank 0 waits in it" in text, text
    # the spin: rank 1 named the culprit by the arbiter's BUSY, declared at the short budget
    assert "rank 1" in spun["message"], spun
    (culprit,) = job.records(1, "peer", "culprit")
    assert culprit["spin_budget_seconds"] == CULPRIT_SPIN, culprit
    assert "wait(s) on it in a collective" in culprit["message"], culprit
    (spin,) = [f for f in job.faults(1, "hang") if f.get("verdict") == "spinning"]
    assert spin["severity"] == "error" and spin["last_step"] == SPIN_AT - 1, spin
    assert spin["message"].startswith("spinning in spin (train.py:"), spin["message"]
    # at the culprit budget (from the last step), or half a second after the BUSY that
    # named it if that came later; never the 120 s --hang-spin-timeout
    assert CULPRIT_SPIN <= spin["stall_seconds"] <= CULPRIT_SPIN + 4.0, spin
    # rank 0 waited on it: a question to the arbiter (a state), never a hang fault, for
    # that episode (issue 35: waiting is not a fault of any severity)
    assert [a for a in job.records(0, "peer", "asking") if a.get("last_step") == SPIN_AT - 1]
    waits = [f for f in job.faults(0, "hang") if f.get("last_step") == SPIN_AT - 1]
    assert not waits, [(f["severity"], f["message"]) for f in waits]
    # the agents' own hang faults (rank 0: its questions to the arbiter) carried the
    # dumps' summaries as evidence too
    for r, first in ((0, job.records(0, "peer", "asking")[0]), (1, job.faults(1, "hang")[0])):
        fr = first["flight_recorder"]
        assert [s["rank"] for s in fr["summaries"]] == [r], fr
    text = stopped["message"]
    assert "flight recorder: rank 1 gave no flight-recorder dump (its agent answered, its " \
        "trainer did not: stopped, or a main thread holding the GIL) while rank 0 waits in " \
        "collective #" in text, text
    assert "(all_reduce) of process group 0" in text and "stacks from 2/2 ranks" in text, text
    text = dead["message"]
    assert "stacks from 1/2 ranks" in text, text
    assert "flight recorder: rank 1 sent nothing (dead, or its pod unresponsive) while " \
        "rank 0 waits in collective #" in text, text
