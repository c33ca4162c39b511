"""Stragglers on real synchronous gloo DDP jobs: time from a rank turning slow to the
arbiter naming it, and stragglers named where there are none.

    .venv/bin/python bench/straggler.py [--window 30] [--minutes 4] [--factor 3]

Two 2-rank jobs of examples/train.py (DDP, gloo, CPU, ``INSTRUMENT=1``: the agents learn
where each step's time goes) under one arbiter with ``--straggler-window``: ``healthy``
runs clean throughout; in ``slowed``, rank 1's steps take ``--factor`` times longer from a
moment chosen after a healthy stretch (``FAULT_TRIGGER_DIR``: examples/train.py's
``slow.1`` file). In synchronous training both ranks of ``slowed`` then step at the same
slow rate: only the compute time per step tells which rank is slow. Reported: the time
from the slow-down to the straggler warning (goal: within the window + 30 s), and the
stragglers named in the healthy job and in ``slowed`` before its slow-down (goal: 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftagent.arbiter.process import ArbiterProcess  # noqa: E402
from tests.conftest import free_port  # noqa: E402

TRAIN = str(ROOT / "examples" / "train.py")


def status(address: str, job: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "ftagent", "status", "--arbiter", address,
                        "--json", "--timeline", "0", job], capture_output=True, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def stragglers(address: str, job: str) -> list[dict]:
    return [e for e in status(address, job).get("timeline", [])
            if e.get("kind") == "fault" and "straggler" in e.get("message", "")]


def start(tmp: Path, job: str, address: str, steps: int, trigger: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   TRAIN_STEPS=str(steps), TRAIN_STEP_SLEEP="0.1", INSTRUMENT="1",
                   FAULT_TRIGGER_DIR=str(trigger))
        out = open(tmp / f"{job}-{rank}.out", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ftagent", "run", "--metrics-port", "-1", "--arbiter",
             address, "--job", job, "--rank", str(rank), "--world-size", "2", "--node",
             f"{job}-node-{rank}", "--", sys.executable, TRAIN], env=env, stdout=out,
            stderr=subprocess.STDOUT))
        out.close()
    return procs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=30.0, help="--straggler-window SECONDS")
    ap.add_argument("--minutes", type=float, default=4.0, help="length of the run")
    ap.add_argument("--factor", type=float, default=3.0, help="the slow rank's slow-down")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ftagent-straggler-"))
    triggers = {j: tmp / f"trigger-{j}" for j in ("healthy", "slowed")}
    for d in triggers.values():
        d.mkdir()
    total = args.minutes * 60
    with ArbiterProcess("--straggler-window", str(args.window), log_dir=str(tmp)) as arb:
        procs = [p for j in triggers for p in start(tmp, j, arb.address, 100000, triggers[j])]
        try:
            began = time.monotonic()
            healthy_for = max(args.window * 2, total / 3)  # a healthy stretch first
            while time.monotonic() - began < healthy_for:
                time.sleep(1.0)
            before = stragglers(arb.address, "slowed")
            (triggers["slowed"] / "slow.1").write_text(str(args.factor))
            slowed_at, named_after = time.monotonic(), None
            while time.monotonic() - began < total:
                found = [e for e in stragglers(arb.address, "slowed") if e not in before]
                if found and named_after is None:
                    named_after = time.monotonic() - slowed_at
                    named = found[0]
                time.sleep(1.0)
            false_healthy = stragglers(arb.address, "healthy")
            steps = {j: [r.get("step") for r in status(arb.address, j).get("ranks", [])]
                     for j in triggers}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=60)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}; command: .venv/bin/python bench/straggler.py "
          f"--window {args.window:g} --minutes {args.minutes:g} --factor {args.factor:g}")
    print(f"  steps reached: {steps}")
    if named_after is None:
        print(f"  slowed rank 1 x{args.factor:g}: NOT named within {total - healthy_for:.0f} s")
    else:
        print(f"  slowed rank 1 x{args.factor:g}: named {named_after:.1f} s after the slow-down "
              f"(goal: within the {args.window:g} s window + 30 s); rank {named.get('rank')}: "
              f"{named.get('message', '')[:160]}")
    print(f"  false stragglers: {len(false_healthy)} in the healthy job over "
          f"{total:.0f} s, {len(before)} in the slowed job before its slow-down (goal: 0)")
    return 0 if named_after is not None and not false_healthy and not before else 1


if __name__ == "__main__":
    sys.exit(main())
