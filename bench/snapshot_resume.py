"""One shard, two ways to resume it: verify then load (two passes over the shard) and
ftagent's load (one pass: each file mapped, its checksum computed over the mapping, DCP
reading those pages), alternated in one process so both see the same machine.

    PYTHONPATH=. .venv/bin/python bench/snapshot_resume.py --gib 0.25 --rounds 8

The two-pass way is what ``checkpoint.load`` did before (layout.verify with checksums, then
a reader that does not check them again); both refuse the same shards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.snapshot import fresh_like, make_state  # noqa: E402
from ftagent.checkpoint import layout  # noqa: E402
from ftagent.checkpoint.settings import Settings  # noqa: E402
from ftagent.checkpoint.snapshots import Snapshotter  # noqa: E402
from ftagent.checkpoint.storage import SnapshotReader  # noqa: E402

JOB = "bench"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.25, help="model state, GiB")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else
                    tempfile.gettempdir(), help="memory-backed directory")
    a = ap.parse_args(argv)
    root = os.path.join(a.shm, f"ftagent-resume-bench-{uuid.uuid4().hex[:8]}")
    state = make_state(a.gib)
    s = Snapshotter(Settings(root=root, job=JOB, rank=0, world_size=1, keep=1),
                    report_held=lambda steps: None, report_resumed=lambda step, src: None)
    try:
        assert s.save(1, state) and s.wait()
        s.close()
        d = layout.step_dir(root, JOB, 0, 1)

        def two_pass(t: dict[str, Any]) -> float:  # the check's seconds
            t0 = time.perf_counter()
            layout.verify(d, job=JOB, rank=0, step=1, state_fingerprint=layout.fingerprint(t))
            checked = time.perf_counter() - t0
            dcp.load(t, storage_reader=SnapshotReader(d, job=JOB, rank=0, step=1,
                                                      checksums=False), no_dist=True)
            return checked

        def one_pass(t: dict[str, Any]) -> float:
            t0 = time.perf_counter()
            r = SnapshotReader(d, job=JOB, rank=0, step=1, fingerprint=layout.fingerprint(t))
            r.check()
            checked = time.perf_counter() - t0
            dcp.load(t, storage_reader=r, no_dist=True)
            return checked

        ways: dict[str, Callable[[dict[str, Any]], float]] = {
            "two passes (before)": two_pass, "one pass (ftagent)": one_pass}
        took: dict[str, list[float]] = {k: [] for k in ways}
        check: dict[str, list[float]] = {k: [] for k in ways}
        first = next(iter(state["model"]))
        for i in range(a.rounds):  # alternate which goes first
            for name in (list(ways) if i % 2 == 0 else list(reversed(ways))):
                t = fresh_like(state)
                t0 = time.perf_counter()
                check[name].append(ways[name](t))
                took[name].append(time.perf_counter() - t0)
                assert torch.equal(t["model"][first], state["model"][first])
        print(f"state {a.gib:.2f} GiB, {a.rounds} rounds, torch {torch.__version__}, "
              f"{os.cpu_count()} CPUs, {a.shm}")
        for name, v in took.items():
            c = statistics.median(check[name])
            print(f"{name:22} median {statistics.median(v):.3f} s  "
                  f"(min {min(v):.3f}, max {max(v):.3f}; checks {c:.3f} s, then DCP "
                  f"{statistics.median(v) - c:.3f} s)")
        base = statistics.median(took["two passes (before)"])
        print(f"one pass / two passes: {statistics.median(took['one pass (ftagent)']) / base:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
