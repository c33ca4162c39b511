"""Side by side: what a save blocks the training step for, and what a resume takes.

One process, one model state of ``--gib`` GiB (float32 tensors of 64 MiB; a state dict of
``model`` + ``optim``, as a trainer hands it over), the same step loop (``--step-seconds``
of sleep, then every tensor's first element moves) and ``--saves`` saves each, for:

* ``ftagent``: ``ftagent.checkpoint.save`` into a memory-backed directory (``/dev/shm``):
  blocks for the copy into its staging buffers; DCP writes the shard in the background.
* ``dcp-async``: ``torch.distributed.checkpoint.async_save`` to local disk (its default
  stager: a copy to host memory, then the write in a thread).
* ``torch.save``: a plain ``torch.save`` of the state to local disk (blocks for all of it).
* ``dlrover-flash``: DLRover's flash checkpoint, run only when its virtualenv exists
  (``.bench-venvs/dlrover``); otherwise printed as not run.

Per method: the first save's blocking time (it allocates: ftagent's staging buffers), the
median blocking time of the saves after it, the time the background part took, the
time to resume (a fresh state of the same shapes filled from the newest save: ftagent's
load verifies sizes and checksums first), and the snapshot interval at which its blocking
time is at most 1 % of the step loop's time. The machine is shared and loaded: compare
the methods within one run, not across runs. Usage::

    PYTHONPATH=. .venv/bin/python bench/snapshot.py --gib 1 --saves 3
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

CHUNK = 16 << 20  # float32 elements per tensor: 64 MiB


def make_state(gib: float) -> dict[str, Any]:
    n = max(1, int(gib * (1 << 30) / (CHUNK * 4)))
    params = {f"layer{i}.weight": torch.randn(CHUNK) for i in range((n + 1) // 2)}
    moments = {f"layer{i}.exp_avg": torch.zeros(CHUNK) for i in range(n // 2)}
    return {"model": params, "optim": {"state": moments, "step": 0}}


def fresh_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "optim": {"state": {k: torch.empty_like(v)
                                for k, v in state["optim"]["state"].items()}, "step": -1}}


def step(state: dict[str, Any], seconds: float, i: int) -> None:
    time.sleep(seconds)
    for t in state["model"].values():
        t[0] += 1.0
    state["optim"]["step"] = i


class Method:
    name = ""

    def save(self, i: int, state: dict[str, Any]) -> None: ...
    def finish(self) -> None: ...  # the background part of the last save
    def resume(self, target: dict[str, Any]) -> int | None: ...
    def close(self) -> None: ...


class Ftagent(Method):
    name = "ftagent"

    def __init__(self, root: str) -> None:
        from ftagent.checkpoint.settings import Settings
        from ftagent.checkpoint.snapshots import Snapshotter
        self.root = root
        self.settings = Settings(root=root, job="bench", rank=0, world_size=1, keep=1)
        self.snap = Snapshotter(self.settings, report_held=lambda s: None,
                                report_resumed=lambda s, src: None)

    def save(self, i: int, state: dict[str, Any]) -> None:
        assert self.snap.save(i, state), "the previous snapshot was still being written"

    def finish(self) -> None:
        self.snap.wait()

    def resume(self, target: dict[str, Any]) -> int | None:
        from ftagent.checkpoint.snapshots import Snapshotter
        return Snapshotter(self.settings, report_held=lambda s: None,
                           report_resumed=lambda s, src: None).load(target)

    def close(self) -> None:
        self.snap.close()
        shutil.rmtree(self.root, ignore_errors=True)


class DcpAsync(Method):
    name = "dcp-async"

    def __init__(self, root: str) -> None:
        self.root = root
        self.future: Any = None
        self.last = -1

    def save(self, i: int, state: dict[str, Any]) -> None:
        if self.future is not None:
            self.future.result()
        self.future = dcp.async_save(state, checkpoint_id=os.path.join(self.root, f"s{i}"),
                                     no_dist=True)
        self.last = i

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()

    def resume(self, target: dict[str, Any]) -> int | None:
        dcp.load(target, checkpoint_id=os.path.join(self.root, f"s{self.last}"), no_dist=True)
        return self.last

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class TorchSave(Method):
    name = "torch.save"

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.last = -1

    def save(self, i: int, state: dict[str, Any]) -> None:
        torch.save(state, os.path.join(self.root, "ckpt.pt"))
        self.last = i

    def resume(self, target: dict[str, Any]) -> int | None:
        loaded = torch.load(os.path.join(self.root, "ckpt.pt"))
        for k, v in loaded["model"].items():
            target["model"][k].copy_(v)
        for k, v in loaded["optim"]["state"].items():
            target["optim"]["state"][k].copy_(v)
        target["optim"]["step"] = loaded["optim"]["step"]
        return self.last

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def run(method: Method, state: dict[str, Any], saves: int, every: int,
        step_seconds: float) -> dict[str, float]:
    blocking, background = [], []
    i = 0
    for _ in range(saves):
        for _ in range(every):
            i += 1
            step(state, step_seconds, i)
        t0 = time.perf_counter()
        method.save(i, state)
        blocking.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        method.finish()  # measured apart: in training it overlaps the next steps
        background.append(time.perf_counter() - t1)
    target = fresh_like(state)
    t0 = time.perf_counter()
    got = method.resume(target)
    resume = time.perf_counter() - t0
    assert got == i, (method.name, got, i)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v), (method.name, k)
    later = blocking[1:] or blocking  # the first save allocates (ftagent: its buffers)
    return {"first": blocking[0], "blocking": statistics.median(later),
            "background": statistics.median(background), "resume": resume}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model state per rank, GiB")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=5, help="steps between two saves")
    ap.add_argument("--step-seconds", type=float, default=0.2)
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="local disk directory")
    ap.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else
                    tempfile.gettempdir(), help="memory-backed directory")
    ap.add_argument("--only", default="", help="comma-separated methods to run")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    state = make_state(a.gib)
    nbytes = sum(t.numel() * t.element_size() for d in (state["model"], state["optim"]["state"])
                 for t in d.values())
    tag = uuid.uuid4().hex[:8]
    makers: dict[str, Callable[[], Method]] = {
        "ftagent": lambda: Ftagent(os.path.join(a.shm, f"ftagent-bench-{tag}")),
        "dcp-async": lambda: DcpAsync(os.path.join(a.disk, f"dcp-bench-{tag}")),
        "torch.save": lambda: TorchSave(os.path.join(a.disk, f"torchsave-bench-{tag}")),
    }
    only = {m for m in a.only.split(",") if m} or set(makers)
    tensors = len(state["model"]) + len(state["optim"]["state"])
    print(f"state {nbytes / (1 << 30):.2f} GiB in {tensors} tensors; {a.saves} saves, one "
          f"every {a.every} steps of {a.step_seconds:.2f} s; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs; memory dir {a.shm}, disk {a.disk}")
    rows = []
    for name, make in makers.items():
        if name not in only:
            continue
        m = make()
        try:
            r = run(m, state, a.saves, a.every, a.step_seconds)
        finally:
            m.close()
        rows.append((name, r))
    dl = Path(".bench-venvs") / "dlrover"
    print(f"\n{'method':14} {'first save':>11} {'blocking/save':>14} {'background':>11} "
          f"{'resume':>9} {'interval for <=1% blocking':>27}")
    for name, r in rows:
        interval = max(1, math.ceil(r["blocking"] / (0.01 * a.step_seconds)))
        print(f"{name:14} {r['first']:10.3f}s {r['blocking']:13.3f}s {r['background']:10.3f}s "
              f"{r['resume']:8.3f}s {interval:>18d} steps ({interval * a.step_seconds:.0f} s)")
    if not dl.is_dir():
        print(f"{'dlrover-flash':14} not run: no virtualenv at {dl} (DLRover's flash "
              "checkpoint needs dlrover[torch] in its own venv)")
    base = dict(rows)
    if "ftagent" in base:
        fastest = min((r["blocking"] for n, r in rows if n != "ftagent"), default=math.nan)
        print(f"\nftagent blocking / fastest peer's: {base['ftagent']['blocking'] / fastest:.2f}"
              if fastest == fastest else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
