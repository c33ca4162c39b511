"""A replaced pod resumes from the peer replica the arbiter placed: real 2- and 4-rank
PyTorch jobs (gloo, CPU) under a real arbiter, one ``ftagent run`` per rank ("pod"), each
with its own memory root, a node name (node-a, node-b; two ranks a node at 4) and
``--replica-listen 127.0.0.1:0`` (no ``--replica-peer``, no job token): the arbiter's
Welcome gives the job's replica key, its commands each rank's holder (the ring by node:
a rank's replica is at the agent of the same place on the other node).

Mid-run, one step past a snapshot, the last rank's pod is killed (agent and trainer,
SIGKILL: a lost node) and its memory root deleted; the others' trainers fail in their next
collective and the arbiter restarts the job. A new pod for that rank (a new agent on
another node, node-c, an empty root, another port) registers; the arbiter keeps the rank's
holder (the ring is sticky); the new agent fetches the rank's shard from there before its
trainer starts; every rank resumes at the newest complete snapshot step (the replaced one
from ``peer``, the others from ``memory``), and the ledger's recomputed steps equal the
steps redone, its incident's source ``peer``. And a warm spare given a replaced rank
(a fatal Xid on its node) fetches that rank's replica before its trainer starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import grpc
import pytest

from ftagent.model import EXIT_REPLACE
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import PY, free_port, ftagent_cmd, wait_for
from tests.e2e.jobs import FAST, TRAIN, needs_torch, status, timeline_text

pytestmark = needs_torch
JOB = "e2e"
EVERY = 3


def _start(tmp: Path, tag: str, rank: int, world: int, master: int, root: Path,
           arbiter: str, node: str, *, spare: bool = False,
           steps: int = 15) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.update(FAST, TRAIN_STEPS=str(steps), TRAIN_STEP_SLEEP="0.3",
               SNAPSHOT_EVERY=str(EVERY))
    if spare:
        del env["RANK"]  # the arbiter gives it one
    who = ["--spare"] if spare else ["--rank", str(rank)]
    cmd = ftagent_cmd(*who, "--world-size", str(world), "--job", JOB,
                      "--arbiter", arbiter, "--max-restarts", "3", "--stop-timeout", "10",
                      "--node", node, "--pod", f"{JOB}-{tag}",
                      "--snapshot-dir", str(root), "--replica-listen", "127.0.0.1:0",
                      "--nic", "lo", "--events-file", str(tmp / f"{tag}.jsonl"),
                      cmd=[PY, TRAIN])
    out = open(tmp / f"{tag}.out", "wb")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True)  # its own group: the "pod", killed whole
    out.close()
    return p


def _spares(address: str) -> list[str]:
    """The job's spares, or none while the arbiter does not know the job yet."""
    r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", address, JOB, "--json"],
                       capture_output=True, text=True, timeout=30)
    return list(json.loads(r.stdout).get("spares", [])) if r.returncode == 0 else []


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


@pytest.mark.parametrize("world", [2, 4])
def test_a_replaced_pod_resumes_from_the_replica_the_arbiter_placed(
        tmp_path: Path, world: int) -> None:
    """Ranks 0..W/2-1 on node-a, the rest on node-b; the last rank's pod is replaced onto
    node-c. Its replica is at the agent of the same place on the other node (the ring by
    node): rank W-1 - W/2."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    base = shm / f"ftagent-test-{uuid.uuid4().hex[:8]}"
    roots = [base / f"pod-{r}" for r in range(world)] + [base / "pod-new"]
    victim, keeper = world - 1, world - 1 - world // 2
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with ArbiterProcess(log_dir=str(tmp_path)) as arb:
            master = free_port()
            procs = [_start(tmp_path, f"rank{r}", r, world, master, roots[r], arb.address,
                            "node-a" if r < world // 2 else "node-b") for r in range(world)]
            held = roots[keeper] / JOB / "replica" / f"rank-{victim}"
            wait_for(lambda: any(s >= 2 * EVERY for s in _steps_in(held)), 240,
                     f"rank {victim}'s replica (step >= 6) at rank {keeper}'s agent")
            # mid-interval (a step past the snapshot), so that work is redone
            wait_for(lambda: _last_step(_log(tmp_path, f"rank{victim}")) % EVERY != 0, 60,
                     f"rank {victim} to step past its snapshot")
            assert _steps_in(roots[victim] / JOB / "replica" / f"rank-{keeper}"), \
                f"rank {keeper}'s replica is not at rank {victim}'s agent"
            # the victim's pod is lost: agent and trainer killed, its memory gone
            os.killpg(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait(30)
            killed_at = _last_step(_log(tmp_path, f"rank{victim}"))
            shutil.rmtree(roots[victim])
            # its replacement: a new pod on another node (another root, port), same rank
            procs.append(_start(tmp_path, "new", victim, world, master, roots[-1],
                                arb.address, "node-c"))
            alive = [p for r, p in enumerate(procs) if r != victim]
            try:
                codes = [p.wait(300) for p in alive]
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"the job did not finish:\n{timeline_text(status(arb.address))}\n"
                    f"{_log(tmp_path, 'rank0')[-2000:]}\n"
                    f"{_log(tmp_path, 'new')[-2000:]}") from None
            st = status(arb.address)
        logs = [_log(tmp_path, f"rank{r}") for r in range(world - 1)]
        new = _log(tmp_path, "new")
        assert codes == [0] * world, ([lg[-1500:] for lg in logs], new[-2500:],
                                      timeline_text(st))
        assert f"fetched rank {victim}'s snapshot of step" in new, new[-3000:]
        m = re.search(r"resumed after step (\d+) from (\w+)", new)
        assert m is not None and m.group(2) == "peer", new[-3000:]
        for log in logs:
            said = re.findall(r"resumed after step (\d+) from (\w+)", log)
            assert said and said[-1] == (m.group(1), "memory"), (said, log[-3000:])
        resumed = int(m.group(1))
        # the newest complete snapshot step: at most one interval behind where it died
        assert resumed % EVERY == 0 and killed_at - EVERY <= resumed <= killed_at, \
            (resumed, killed_at)
        assert _loaded(new) == [resumed], new[-3000:]
        # the ledger: the incident resumed there; its recomputed steps are the steps redone
        incs = st["goodput"]["per_incident"]
        assert incs and incs[-1]["resumed_step"] == resumed, (incs, timeline_text(st))
        assert incs[-1]["resume_source"] == "peer", incs  # the slowest rung the ranks took
        # the job's first attempt reached `reached` (the furthest rank); redone: past resumed
        reached = max(_last_step(log.split("snapshot loaded: ")[1]) for log in logs)
        assert st["goodput"]["recomputed_steps"] == reached - resumed, \
            (st["goodput"], reached, resumed)
        assert reached - resumed <= EVERY + 1, (reached, resumed)
        print(f"\n{world} ranks, rank {victim}'s pod replaced at step {killed_at}: resumed "
              f"after step {resumed} (rank {victim} from its replica at rank {keeper}'s "
              f"agent, the others from memory), {reached - resumed} steps redone; "
              f"incident {incs[-1]}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        shutil.rmtree(base, ignore_errors=True)


def test_a_warm_spare_given_a_replaced_rank_fetches_its_replica(tmp_path: Path) -> None:
    """Rank 1's node reports a fatal Xid (its node agent's ReportNode, at the moment the
    test picks: one step past a snapshot): the arbiter replaces rank 1 and ASSIGNs the warm
    spare (node-c) rank 1; the spare's agent fetches rank 1's shard from the holder the
    ASSIGN names (rank 0's agent) before its trainer starts, and resumes from ``peer``."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    base = shm / f"ftagent-test-{uuid.uuid4().hex[:8]}"
    roots = [base / "pod-0", base / "pod-1", base / "spare"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with ArbiterProcess(log_dir=str(tmp_path)) as arb:
            master = free_port()
            procs = [_start(tmp_path, f"rank{r}", r, 2, master, roots[r], arb.address,
                            f"node-{'ab'[r]}", steps=60) for r in (0, 1)]
            procs.append(_start(tmp_path, "spare", 0, 2, master, roots[2], arb.address,
                                "node-c", spare=True, steps=60))
            wait_for(lambda: _spares(arb.address), 180, "the spare to join", interval=0.5)
            held = roots[0] / JOB / "replica" / "rank-1"
            wait_for(lambda: any(s >= 2 * EVERY for s in _steps_in(held)), 240,
                     "rank 1's replica (step >= 6) at rank 0's agent")
            wait_for(lambda: _last_step(_log(tmp_path, "rank1")) % EVERY != 0, 60,
                     "rank 1 to step past its snapshot")
            with grpc.insecure_channel(arb.address) as ch:  # rank 1's node: GPU fell off
                pb_grpc.ArbiterStub(ch).ReportNode(pb.NodeReport(node="node-b", faults=[
                    pb.Fault(id="xid79", kind=pb.FAULT_KIND_GPU, severity=pb.SEVERITY_FATAL,
                             scope=pb.SCOPE_NODE, message="Xid 79: fallen off the bus",
                             detected_at=1.0)]), timeout=10)
            try:
                assert procs[1].wait(120) == EXIT_REPLACE
                codes = [procs[0].wait(300), procs[2].wait(300)]
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"the job did not finish:\n{timeline_text(status(arb.address))}\n"
                    f"{_log(tmp_path, 'rank0')[-2000:]}\n"
                    f"{_log(tmp_path, 'spare')[-2000:]}") from None
            st = status(arb.address)
        log0, spare = _log(tmp_path, "rank0"), _log(tmp_path, "spare")
        assert codes == [0, 0], (log0[-2500:], spare[-2500:], timeline_text(st))
        assert "fetched rank 1's snapshot of step" in spare, spare[-3000:]
        m = re.search(r"resumed after step (\d+) from (\w+)", spare)
        assert m is not None and m.group(2) == "peer", spare[-3000:]
        said = re.findall(r"resumed after step (\d+) from (\w+)", log0)
        assert said and said[-1] == (m.group(1), "memory"), (said, log0[-3000:])
        incs = st["goodput"]["per_incident"]
        assert incs and incs[-1]["resumed_step"] == int(m.group(1)), incs
        assert incs[-1]["resume_source"] == "peer", incs
        print(f"\nrank 1 moved to the warm spare: resumed after step {m.group(1)} from its "
              f"replica at rank 0's agent; incident {incs[-1]}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        shutil.rmtree(base, ignore_errors=True)
