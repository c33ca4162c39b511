"""Last words: SIGTERM to ``ftagent run`` (the pod is evicted) persists the newest complete
in-memory snapshot to --checkpoint-dir, which plain ``torch.distributed.checkpoint.load``
reads without ftagent; the agent says how long it took. A real trainer
(examples/train.py, SNAPSHOT_EVERY), a real agent, real signals."""

from __future__ import annotations

import re
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT, ftagent_cmd, popen, wait_for

torch = pytest.importorskip("torch")


def _state() -> dict[str, object]:
    from torch import nn
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_sigterm_persists_the_newest_snapshot_and_plain_dcp_loads_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    snapdir = shm / f"ftagent-test-{uuid.uuid4().hex[:8]}"
    durable = tmp_path / "durable"
    out = tmp_path / "out.log"
    try:
        with open(out, "wb") as f:
            agent = popen(ftagent_cmd("--job", "lw", "--snapshot-dir", str(snapdir),
                                      "--checkpoint-dir", str(durable), "--nic", "lo",
                                      cmd=[PY, str(ROOT / "examples" / "train.py")]),
                          env={"TRAIN_STEPS": "100000", "TRAIN_STEP_SLEEP": "0.02",
                               "SNAPSHOT_EVERY": "5", "RANK": "0", "WORLD_SIZE": "1"},
                          stdout=f, stderr=f)
        rank_dir = snapdir / "lw" / "rank-0"
        # two complete snapshots held (their markers written last)
        wait_for(lambda: len(list(rank_dir.glob("step-*/ftagent-snapshot.json"))) >= 2,
                 timeout=120, what="two snapshots in memory")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) in (143, 0, -15), out.read_text()[-2000:]
        log = out.read_text()
        m = re.search(r"last words: rank 0's snapshot of step (\d+) persisted to (\S+) "
                      r"in ([0-9.]+)s", log)
        assert m, log[-2000:]
        step = int(m.group(1))
        held = sorted(int(p.name.split("-")[1]) for p in rank_dir.glob("step-*"))
        assert step == held[-1], (step, held)  # the newest complete one
        # plain DCP, no ftagent: the persisted rank directory is a standard checkpoint
        target = _state()
        dcp.load(target, checkpoint_id=str(durable / f"step-{step}" / "rank-0"))
        memory = _state()
        dcp.load(memory, checkpoint_id=str(rank_dir / f"step-{step}"))
        w = target["model"]["0.weight"]  # type: ignore[index]
        assert w.abs().sum() > 0  # filled (the target started at zeros)
        assert torch.equal(w, memory["model"]["0.weight"])  # type: ignore[index]
        print(f"\nlast words: step {step} persisted in {m.group(3)} s")
    finally:
        shutil.rmtree(snapdir, ignore_errors=True)
