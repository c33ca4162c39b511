"""A replaced pod resumes from its peer's replica: a real 2-rank PyTorch job (gloo, CPU),
one ``ftagent run`` per rank, each with its own memory root (two "nodes"), replicas in a
ring (rank 0's agent keeps rank 1's, rank 1's keeps rank 0's: --replica-listen/--peer,
the job token as the channel's key).

Run 1 snapshots every 3 steps to step 9 and ends. Then rank 1's pod is replaced: its
memory root is gone. Run 2: rank 1's agent fetches its shard from rank 0's agent before
its trainer starts; both ranks resume at the same step (the newest both hold), rank 1's
from ``peer`` and rank 0's from ``memory``, without a durable checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

from tests.conftest import PY, free_port, ftagent_cmd, wait_for
from tests.e2e.jobs import FAST, TRAIN, needs_torch

pytestmark = needs_torch
TOKEN = "e2e-job-token"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start(tmp: Path, tag: str, rank: int, master: int, roots: list[Path],
           ports: list[int]) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **FAST,
               TRAIN_STEPS="12", SNAPSHOT_EVERY="3")
    cmd = ftagent_cmd("--rank", str(rank), "--world-size", "2", "--job", "e2e-replica",
                      "--token", TOKEN, "--snapshot-dir", str(roots[rank]),
                      "--replica-listen", f"127.0.0.1:{ports[rank]}",
                      "--replica-peer", f"127.0.0.1:{ports[1 - rank]}",
                      "--nic", "lo", cmd=[PY, TRAIN])
    out = open(tmp / f"{tag}-rank{rank}.out", "wb")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return p


def _log(tmp: Path, tag: str, rank: int) -> str:
    return (tmp / f"{tag}-rank{rank}.out").read_text(errors="replace")


def test_a_replaced_pod_resumes_from_the_peer_replica(tmp_path: Path) -> None:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    base = shm / f"ftagent-test-{uuid.uuid4().hex[:8]}"
    roots = [base / "node-a", base / "node-b"]
    ports = [free_port(), free_port()]
    try:
        # run 1: steps 1..TRAIN_STEPS of a fresh job, a snapshot every 3, replicated
        procs = []
        master = free_port()
        for r in (0, 1):
            p = _start(tmp_path, "run1", r, master, roots, ports)
            procs.append(p)
        codes = [p.wait(240) for p in procs]
        assert codes == [0, 0], (_log(tmp_path, "run1", 0)[-2000:],
                                 _log(tmp_path, "run1", 1)[-2000:])
        held = roots[0] / "e2e-replica" / "replica" / "rank-1"
        steps = sorted(int(m.group(1)) for n in (os.listdir(held) if held.is_dir() else [])
                       if (m := re.fullmatch(r"step-(\d+)", n)))
        assert steps, ("rank 1 was never replicated to rank 0's agent",
                       _log(tmp_path, "run1", 1)[-3000:])
        # rank 1's pod is replaced: a new node, nothing in its memory
        shutil.rmtree(roots[1])
        master = free_port()
        p0 = _start(tmp_path, "run2", 0, master, roots, ports)
        wait_for(lambda: _listening(ports[0]), 60, "rank 0's replica holder")
        p1 = _start(tmp_path, "run2", 1, master, roots, ports)
        codes = [p0.wait(240), p1.wait(240)]
        logs = [_log(tmp_path, "run2", r) for r in (0, 1)]
        assert codes == [0, 0], (logs[0][-2000:], logs[1][-2000:])
        m1 = re.search(r"resumed after step (\d+) from (\w+)", logs[1])
        m0 = re.search(r"resumed after step (\d+) from (\w+)", logs[0])
        assert m1 and m1.group(2) == "peer", logs[1][-3000:]
        assert m0 and m0.group(2) == "memory", logs[0][-3000:]
        assert m0.group(1) == m1.group(1) and int(m1.group(1)) in steps, (m0, m1, steps)
        assert "fetched rank 1's snapshot" in logs[1], logs[1][-3000:]
        print(f"\nrank 1 (replaced) resumed after step {m1.group(1)} from its peer's replica")
    finally:
        shutil.rmtree(base, ignore_errors=True)
