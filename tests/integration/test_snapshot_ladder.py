"""The ladder across ranks: two real processes in a gloo process group call
``ftagent.checkpoint.load``. When one rank's shard of the step the arbiter named is torn,
no rank loads that step: every rank falls to the durable copy together (a collective), and
each says why. Without the arbiter's step, the ranks agree on the newest step both hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT, free_port

pytest.importorskip("torch")

SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist
from ftagent.checkpoint import persist
from ftagent.checkpoint.snapshots import Settings, Snapshotter

phase, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
s = Settings.from_env()
snap = Snapshotter(s, report_held=lambda steps: None, report_resumed=lambda a, b: None)

def state(v):
    return {"w": torch.full((8,), float(v)), "step": int(v)}

if phase == "save":
    for step in (1, 2):
        snap.save(step, state(step + rank * 100))
        snap.wait(60)
    persist.persist(os.path.join(snap.my_dir, "step-1"), s.durable, rank=rank, step=1)
    if rank == 0:  # rank 1 died before its step 3 was complete
        snap.save(3, state(3))
        snap.wait(60)
else:
    target = state(-1)
    step = snap.load(target)
    with open(out, "w") as f:
        json.dump({"step": step, "source": snap.last_load[1], "why": snap.last_load[2],
                   "w": target["w"][0].item()}, f)
dist.destroy_process_group()
"""


def _run(tmp: Path, phase: str, resume: str | None,
         resume1: str | None = "same") -> list[dict[str, object]]:
    """Both ranks run ``phase``; rank 0 is told ``resume``, rank 1 ``resume1`` (default:
    the same)."""
    port = free_port()
    script = tmp / "ladder.py"
    script.write_text(SCRIPT)
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), FTAGENT_SNAPSHOT_DIR=str(tmp / "mem"),
                   FTAGENT_JOB="ladder", FTAGENT_CHECKPOINT_DIR=str(tmp / "durable"),
                   PYTHONPATH=str(ROOT))
        env.pop("FTAGENT_RESUME_STEP", None)
        told = resume if r == 0 or resume1 == "same" else resume1
        if told is not None:
            env["FTAGENT_RESUME_STEP"] = told
        procs.append(subprocess.Popen([PY, str(script), phase, str(tmp / f"out{r}.json")],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    if phase == "save":
        return []
    return [json.loads((tmp / f"out{r}.json").read_text()) for r in range(2)]


def test_a_torn_shard_on_one_rank_sends_every_rank_to_disk(tmp_path: Path) -> None:
    _run(tmp_path, "save", None)
    # without the arbiter: the newest step both hold is 2 (rank 0's 3 is alone)
    got = _run(tmp_path, "load", None)
    assert [g["step"] for g in got] == [2, 2] and [g["source"] for g in got] == ["memory"] * 2
    assert [g["w"] for g in got] == [2.0, 102.0]
    # rank 1's step 2 is torn (its data file cut short); the arbiter names step 2
    d = tmp_path / "mem" / "ladder" / "rank-1" / "step-2"
    data = next(p for p in d.iterdir() if p.name.endswith(".distcp"))
    with open(data, "r+b") as f:
        f.truncate(16)
    got = _run(tmp_path, "load", "2")
    assert [g["step"] for g in got] == [1, 1], got
    assert [g["source"] for g in got] == ["disk", "disk"], got
    assert [g["w"] for g in got] == [1.0, 101.0], got  # each its own rank's shard
    why0, why1 = (" | ".join(g["why"]) for g in got)  # type: ignore[arg-type]
    assert "not loadable on every rank (ranks [1])" in why0, why0
    assert "truncated" in why1 and "peer: no replica" in why1, why1
    # rank 1 told nothing (a replaced pod's agent): the same collectives on every rank,
    # they agree on the newest step both hold, rank 1's is torn: both to disk again
    got = _run(tmp_path, "load", "2", None)
    assert [(g["step"], g["source"]) for g in got] == [(1, "disk"), (1, "disk")], got
    assert all("not all told the same resume step" in " ".join(g["why"])  # type: ignore[arg-type]
               for g in got), got
    assert sys.version_info >= (3, 10)
