"""Start real multi-rank PyTorch (gloo, CPU) jobs of examples/train.py, one agent per rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PY, ROOT, free_port, ftagent_cmd, read_events

TRAIN = str(ROOT / "examples" / "train.py")

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:  # pragma: no cover
    HAVE_TORCH = False

needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="needs torch (make venv installs it)")


@dataclass
class Job:
    tmp: Path
    world: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def events(self, rank: int) -> list[dict[str, Any]]:
        return read_events(self.tmp / f"rank{rank}.jsonl")

    def faults(self, rank: int, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events(rank) if e["event"] == "fault" and e["kind"] == kind]

    def records(self, rank: int, event: str, kind: str | None = None) -> list[dict[str, Any]]:
        """Events of one type (``verify``, ``phase``, ...), of one kind if given."""
        return [e for e in self.events(rank)
                if e["event"] == event and (kind is None or e["kind"] == kind)]

    def kinds(self, rank: int, event: str) -> list[str]:
        """The kinds of one event type in order: verification verdicts, phases."""
        return [e["kind"] for e in self.events(rank) if e["event"] == event]

    def log(self, rank: int) -> str:
        p = self.tmp / f"rank{rank}.out"
        return p.read_text(errors="replace") if p.exists() else ""

    def wait(self, timeout: float) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_job(tmp: Path, world: int, flags: Sequence[str] = (), env: dict[str, str] | None = None,
              rank_env: dict[int, dict[str, str]] | None = None,
              rank_flags: dict[int, Sequence[str]] | None = None) -> Job:
    """One ``ftagent run`` per rank; output of each rank in tmp/rank{r}.out."""
    job = Job(tmp, world)
    port = free_port()
    for r in range(world):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                 **(env or {}), **((rank_env or {}).get(r, {})))
        out = open(tmp / f"rank{r}.out", "wb")  # noqa: SIM115 - closed with the process
        cmd = ftagent_cmd("--events-file", str(tmp / f"rank{r}.jsonl"), "--rank", str(r),
                          "--world-size", str(world), *flags,
                          *((rank_flags or {}).get(r, ())), cmd=[PY, TRAIN])
        job.procs.append(subprocess.Popen(cmd, env=e, stdout=out, stderr=subprocess.STDOUT))
        out.close()
    return job


# Under a real arbiter (moved here from the e2e tests the drills in tests/drills replaced)
FAST = {"TRAIN_STEP_SLEEP": "0.05", "TRAIN_PG_TIMEOUT": "120"}


def status(address: str, job: str = "e2e") -> dict[str, Any]:
    r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", address, job, "--json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def connected(address: str) -> int:
    """Agents connected for the job; 0 while the (restarted) arbiter does not know it yet."""
    r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", address, "e2e", "--json"],
                       capture_output=True, text=True, timeout=30)
    return int(json.loads(r.stdout)["connected"]) if r.returncode == 0 else 0


def timeline_text(st: dict[str, Any]) -> str:
    """The timeline as lines, for an assertion message a person can read."""
    return "\n".join(f"{e['kind']:9} {e.get('action', ''):16} g{e['generation']} "
                     f"r{e.get('rank', '-')} {e['message']}" for e in st["timeline"])


def kinds(st: dict[str, Any]) -> list[str]:
    """Timeline kinds, decisions by their action (restart, dump_stacks, stop, ...)."""
    return [e["action"] if e["kind"] == "decision" else e["kind"] for e in st["timeline"]]


def trainer_pid(job: Job, rank: int, generation: int) -> int:
    """The pid of ``rank``'s trainer at ``generation`` (its agent's "running" event), or 0."""
    running = [e for e in job.events(rank) if e["event"] == "state"
               and e["kind"] == "running" and e["generation"] == generation]
    return int(running[-1]["pid"]) if running else 0


def steps(job: Job, rank: int) -> int:
    """How many step lines ``rank``'s trainer has printed so far."""
    return job.log(rank).count("step=")
