"""GPU fault drills: the real ``ftagent run`` with ``--gpu-backend simulated:FILE``, 2 ranks,
a real arbiter. One timeline file drives the job (``rank=1`` lines are rank 1's); the
trainer is a small script printing steps (the GPU path does not need PyTorch).

* a restart-class Xid (13) on rank 1: the arbiter restarts every rank in place;
* a GPU lost mid-run (NVML's GpuIsLost from the poll), Xid 79 (fell off the bus) or Xid 95
  (uncontained ECC: reset the GPU) on rank 1: the arbiter replaces rank 1 (its agent exits
  with the replace status), rank 0 restarts and waits at the barrier until a replacement
  rank 1 (a new agent, as a rescheduled pod) arrives.

Each checks ``ftagent status --json``, the events files and, for the first, ``/metrics``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ftagent.model import EXIT_REPLACE
from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import PY, free_port, ftagent_cmd, read_events, wait_for

JOB = "e2e-gpu"
TRAINER = """\
import os, sys, time
steps = int(os.environ.get("STEPS", "40"))
print("resumed from checkpoint at step 0", flush=True)  # no checkpoint: step 1 is next
for i in range(1, steps + 1):
    print(f"step={i}/{steps} loss={1.0 / i:.4f}", flush=True)
    time.sleep(0.1)
"""


def status(address: str) -> dict[str, Any]:
    r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", address, JOB, "--json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def status_soon(address: str) -> dict[str, Any]:
    """The job's status, or an empty timeline while the arbiter does not know it yet."""
    r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", address, JOB, "--json"],
                       capture_output=True, text=True, timeout=30)
    return dict(json.loads(r.stdout)) if r.returncode == 0 else {"timeline": []}


def decisions(st: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [e for e in st["timeline"] if e["kind"] == "decision" and e["action"] == action]


def gpu_faults(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in st["timeline"] if e["kind"] == "fault" and "gpu (" in e["message"]]


class Agents:
    """``ftagent run`` processes of the job, each with its events file and output."""

    def __init__(self, tmp: Path, address: str, timeline: Path) -> None:
        self.tmp, self.address, self.timeline = tmp, address, timeline
        (tmp / "train.py").write_text(TRAINER)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, rank: int, timeline: Path | None = None,
              steps: int = 40) -> subprocess.Popen[bytes]:
        out = (self.tmp / f"{name}.out").open("wb")
        cmd = ftagent_cmd("--events-file", str(self.tmp / f"{name}.jsonl"), "--rank", str(rank),
                          "--world-size", "2", "--arbiter", self.address, "--job", JOB,
                          "--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                          "--gpu-backend", f"simulated:{timeline or self.timeline}",
                          "--gpu-poll-interval", "0.2", "--progress", "log",
                          "--hang-verify-window", "0",
                          cmd=[PY, str(self.tmp / "train.py")])
        env = {**os.environ, "STEPS": str(steps), "MASTER_PORT": str(free_port())}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        out.close()
        self.procs[name] = proc
        return proc

    def events(self, name: str) -> list[dict[str, Any]]:
        return read_events(self.tmp / f"{name}.jsonl")

    def faults(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events(name) if e["event"] == "fault" and e["kind"] == "gpu"]

    def metrics(self, name: str) -> str:
        port = next(e["metrics_port"] for e in self.events(name) if e.get("metrics_port"))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def log(self, name: str) -> str:
        p = self.tmp / f"{name}.out"
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def dump(self) -> None:
        for name in self.procs:
            sys.stderr.write(f"--- {name}\n{self.log(name)[-3000:]}\n")


def test_restart_class_xid_restarts_every_rank_in_place(tmp_path: Path) -> None:
    timeline = tmp_path / "gpus.txt"
    timeline.write_text("gpus 2\nt=1.5s rank=1 gpu=1 xid=13 detail=\"Graphics SM Warp "
                        "Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address\"\n")
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        agents = Agents(tmp_path, arb.address, timeline)
        try:
            r0, r1 = agents.start("rank0", 0), agents.start("rank1", 1)
            wait_for(lambda: decisions(status_soon(arb.address), "restart"), 60,
                     "the arbiter's restart", interval=0.2)
            # the trainer runs again at generation 1: /metrics shows the Xid and the GPUs
            wait_for(lambda: [e for e in agents.events("rank1") if e["event"] == "state"
                              and e["kind"] == "running" and e["generation"] == 1], 30,
                     "rank 1 running generation 1", interval=0.1)
            text = agents.metrics("rank1")
            assert r0.wait(90) == 0 and r1.wait(90) == 0
        except BaseException:
            agents.dump()
            raise
        finally:
            agents.stop()
        st = status(arb.address)
    (fault,) = gpu_faults(st)
    assert fault["rank"] == 1 and "Xid 13 (graphics engine exception)" in fault["message"]
    assert "GPU 1 (NVIDIA H100 80GB HBM3, GPU-00000000-0000-4000-8000-000000000001" in \
        fault["message"]
    (restart,) = decisions(st, "restart")
    assert restart["generation"] == 1 and "every rank restarts" in restart["message"]
    assert decisions(st, "succeeded")
    # the events file: one GPU fault with its evidence (NVML and kmsg saw it: counted once)
    (ev,) = agents.faults("rank1")
    assert (ev["xid"], ev["gpu"], ev["action"], ev["severity"]) == (13, 1, "restart", "error")
    assert ev["pci_bus_id"] == "00000000:2A:00.0" and ev["occurrences"] == 1
    assert ev["seen_by"] in (["nvml"], ["kmsg"])  # the first path raised it; the other counted
    assert agents.faults("rank0") == []
    xid_line = next(ln for ln in text.splitlines()
                    if ln.startswith("ftagent_gpu_xid_errors_total{") and 'xid="13"' in ln)
    assert 'gpu="1"' in xid_line and xid_line.endswith(" 1.0"), xid_line
    assert 'modelName="NVIDIA H100 80GB HBM3"' in xid_line and 'rank="1"' in xid_line
    assert "ftagent_gpu_temperature_celsius{" in text and "ftagent_gpu_nvlink_up{" in text
    healthy = [ln for ln in text.splitlines() if ln.startswith("ftagent_gpu_healthy{")]
    assert len(healthy) == 2 and all(ln.endswith(" 1.0") for ln in healthy), healthy


@pytest.mark.parametrize(("event", "cause", "scope", "action", "words"), [
    ("lost", "lost", "node", "replace_node", "GPU is lost"),  # NVMLError_GpuIsLost, mid-run
    ("xid=79", "xid:79", "node", "replace_node", "Xid 79 (GPU has fallen off the bus)"),
    ("xid=95", "xid:95", "pod", "reset_gpu", "Xid 95 (uncontained ECC error)"),
])
def test_a_gpu_that_must_go_replaces_the_rank_and_a_new_one_takes_over(
        tmp_path: Path, event: str, cause: str, scope: str, action: str, words: str) -> None:
    timeline = tmp_path / "gpus.txt"
    timeline.write_text(f"gpus 1\nt=1.5s rank=1 gpu=0 {event}\n")
    clean = tmp_path / "clean.txt"
    clean.write_text("gpus 1\n")
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        agents = Agents(tmp_path, arb.address, timeline)
        launched = time.time()
        try:
            r0, r1 = agents.start("rank0", 0, steps=60), agents.start("rank1", 1, steps=60)
            assert r1.wait(60) == EXIT_REPLACE, agents.log("rank1")[-2000:]
            st = status(arb.address)
            assert decisions(st, "replace"), st["timeline"]
            # rank 0 restarted and waits at the barrier; the rescheduled pod's agent arrives
            new1 = agents.start("rank1-new", 1, timeline=clean, steps=20)
            assert new1.wait(90) == 0 and r0.wait(90) == 0
        except BaseException:
            agents.dump()
            raise
        finally:
            agents.stop()
        st = status(arb.address)
    (replace,) = decisions(st, "replace")
    assert "replacing rank 1" in replace["message"] and words in replace["message"], replace
    assert replace["generation"] == 1
    assert decisions(st, "succeeded")
    (fault,) = agents.faults("rank1")
    assert (fault["cause"], fault["severity"], fault["scope"], fault["action"]) == (
        cause, "fatal", scope, action)
    assert fault["uuid"] == "GPU-00000000-0000-4000-8000-000000000000"
    assert any(e["event"] == "action" and e["kind"] == "replace"
               for e in agents.events("rank1"))
    runs = [e["generation"] for e in agents.events("rank0")
            if e["event"] == "state" and e["kind"] == "running"]
    assert runs == [0, 1], runs
    assert agents.faults("rank1-new") == []
    ledger_accounts(st, launched, [agents.log("rank0"), agents.log("rank1")])


def ledger_accounts(st: dict[str, Any], launched: float, logs: list[str]) -> None:
    """The goodput ledger of the fatal GPU fault (issue 24): its categories sum to the
    job's wall time within 1 %: from its first registration (after the test launched the
    agents, no later than the arbiter's first timeline entry: the last rank's) to the
    timeline's "job succeeded"; and its one incident redid the steps the trainers' logs
    show: the job had reached the highest step printed before the restart (rank 0's first
    run, the replaced rank 1's only one) and resumed after step 0 (what they print)."""
    g = st["goodput"]
    assert g is not None, st
    stamps = [e["ts"] for e in st["timeline"]]
    done = [e["ts"] for e in st["timeline"] if "job succeeded" in e["message"]]
    assert done, st["timeline"]
    assert launched <= g["started_at"] <= stamps[0], (launched, g["started_at"], stamps[0])
    wall = done[0] - g["started_at"]
    assert abs(sum(g["seconds"].values()) - g["wall_seconds"]) < 1e-6, g
    assert abs(g["wall_seconds"] - wall) <= 0.01 * wall, (g, wall)
    before = [log.split("resumed from checkpoint at step 0")[1] for log in logs]
    reached = max(int(n) for text in before for n in re.findall(r"step=(\d+)/", text))
    (inc,) = g["per_incident"]
    assert (inc["kind"], inc["resume_source"], inc["resumed_step"]) == ("gpu", "reported", 0)
    assert inc["recomputed_steps"] == reached == g["recomputed_steps"], (inc, reached)
