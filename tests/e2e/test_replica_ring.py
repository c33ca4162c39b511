"""A replaced pod resumes from the peer replica the arbiter placed: a real 2-rank PyTorch
job (gloo, CPU) under a real arbiter, one ``ftagent run`` per rank ("pod"), each with its
own memory root, its own node name (node-a, node-b) and ``--replica-listen 127.0.0.1:0``
(no ``--replica-peer``, no job token): the arbiter's Welcome gives the job's replica key,
its commands each rank's holder (the ring by node: rank 0's agent keeps rank 1's replica
and back).

Mid-run, one step past a snapshot, rank 1's pod is killed (agent and trainer, SIGKILL: a
lost node) and its memory root deleted; rank 0's trainer fails in its next collective and
the arbiter restarts the job. A new pod for rank 1 (a new agent on another node, node-c,
an empty root, another port) registers; the arbiter keeps rank 1's holder (rank 0's
agent: the ring is sticky); the new agent fetches rank 1's shard from there before its
trainer starts; every rank resumes at the newest complete snapshot step (rank 1 from
``peer``, rank 0 from ``memory``), and the ledger's recomputed steps equal the steps
redone, its incident's source ``peer``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import PY, free_port, ftagent_cmd, wait_for
from tests.e2e.jobs import FAST, TRAIN, needs_torch, status, timeline_text

pytestmark = needs_torch
JOB = "e2e"
EVERY = 3


def _start(tmp: Path, tag: str, rank: int, master: int, root: Path, arbiter: str,
           node: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.update(FAST, TRAIN_STEPS="15", TRAIN_STEP_SLEEP="0.3", SNAPSHOT_EVERY=str(EVERY))
    cmd = ftagent_cmd("--rank", str(rank), "--world-size", "2", "--job", JOB,
                      "--arbiter", arbiter, "--max-restarts", "3", "--stop-timeout", "10",
                      "--node", node,
                      "--snapshot-dir", str(root), "--replica-listen", "127.0.0.1:0",
                      "--nic", "lo", "--events-file", str(tmp / f"{tag}.jsonl"),
                      cmd=[PY, TRAIN])
    out = open(tmp / f"{tag}.out", "wb")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True)  # its own group: the "pod", killed whole
    out.close()
    return p


def _log(tmp: Path, tag: str) -> str:
    return (tmp / f"{tag}.out").read_text(errors="replace")


def _steps_in(d: Path) -> list[int]:
    try:
        names = os.listdir(d)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"step-(\d+)", n)))


def _loaded(log: str) -> list[int | None]:
    return [None if m.group(1) == "none" else int(m.group(2))
            for m in re.finditer(r"snapshot loaded: (none|step (\d+))", log)]


def _last_step(log: str) -> int:
    return max((int(s) for s in re.findall(r"step=(\d+)/", log)), default=0)


def test_a_replaced_pod_resumes_from_the_replica_the_arbiter_placed(tmp_path: Path) -> None:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    base = shm / f"ftagent-test-{uuid.uuid4().hex[:8]}"
    roots = [base / "pod-0", base / "pod-1", base / "pod-1-new"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with ArbiterProcess(log_dir=str(tmp_path)) as arb:
            master = free_port()
            procs = [_start(tmp_path, f"rank{r}", r, master, roots[r], arb.address,
                            f"node-{'ab'[r]}") for r in (0, 1)]
            held = roots[0] / JOB / "replica" / "rank-1"  # rank 0's agent keeps rank 1's
            wait_for(lambda: any(s >= 2 * EVERY for s in _steps_in(held)), 180,
                     "rank 1's replica (step >= 6) at rank 0's agent")
            # mid-interval (a step past the snapshot), so that work is redone
            wait_for(lambda: _last_step(_log(tmp_path, "rank1")) % EVERY != 0, 60,
                     "rank 1 to step past its snapshot")
            assert _steps_in(roots[1] / JOB / "replica" / "rank-0"), \
                "rank 0's replica is not at rank 1's agent"
            # rank 1's pod is lost: agent and trainer killed, its memory gone
            os.killpg(procs[1].pid, signal.SIGKILL)
            procs[1].wait(30)
            killed_at = _last_step(_log(tmp_path, "rank1"))
            shutil.rmtree(roots[1])
            # its replacement: a new pod (another root, another port), same rank
            procs.append(_start(tmp_path, "rank1-new", 1, master, roots[2], arb.address,
                                "node-c"))
            try:
                codes = [procs[0].wait(240), procs[2].wait(240)]
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"the job did not finish:\n{timeline_text(status(arb.address))}\n"
                    f"{_log(tmp_path, 'rank0')[-2000:]}\n"
                    f"{_log(tmp_path, 'rank1-new')[-2000:]}") from None
            st = status(arb.address)
        log0, log1 = _log(tmp_path, "rank0"), _log(tmp_path, "rank1-new")
        assert codes == [0, 0], (log0[-2500:], log1[-2500:], timeline_text(st))
        assert "fetched rank 1's snapshot of step" in log1, log1[-3000:]
        m1 = re.search(r"resumed after step (\d+) from (\w+)", log1)
        m0 = re.findall(r"resumed after step (\d+) from (\w+)", log0)
        assert m1 is not None and m1.group(2) == "peer", log1[-3000:]
        assert m0 and m0[-1] == (m1.group(1), "memory"), (m0, log0[-3000:])
        resumed = int(m1.group(1))
        # the newest complete snapshot step: at most one interval behind where rank 1 died
        assert resumed % EVERY == 0 and killed_at - EVERY <= resumed <= killed_at, \
            (resumed, killed_at)
        assert _loaded(log1) == [resumed], log1[-3000:]
        # the ledger: the incident resumed there; its recomputed steps are the steps redone
        incs = st["goodput"]["per_incident"]
        assert incs and incs[-1]["resumed_step"] == resumed, (incs, timeline_text(st))
        assert incs[-1]["resume_source"] == "peer", incs  # the slowest rung the ranks took
        # rank 0's first attempt reached reached0; the job redid reached0 - resumed steps
        first0 = log0.split("snapshot loaded: ")[1]
        reached0 = _last_step(first0)
        assert st["goodput"]["recomputed_steps"] == reached0 - resumed, \
            (st["goodput"], reached0, resumed)
        assert reached0 - resumed <= EVERY + 1, (reached0, resumed)
        print(f"\nrank 1's pod replaced at step {killed_at}: resumed after step {resumed} "
              f"(rank 1 from its peer replica, rank 0 from memory), "
              f"{reached0 - resumed} steps redone; incident {incs[-1]}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        shutil.rmtree(base, ignore_errors=True)
