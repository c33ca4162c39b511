"""Side by side: what a save blocks the training step for, what a resume takes, and the
work a fault redoes.

One process, one model state of ``--gib`` GiB (float32 tensors of 64 MiB; a state dict of
``model`` + ``optim``, as a trainer hands it over), the same step loop (``--step-seconds``
of sleep, then every tensor's first element moves), ``--saves`` saves one every
``--every`` steps, then ``--faults`` faults, each at a random step after a save (the
same steps for every method, ``--seed``): the trainer's state is lost, the method resumes
into a fresh state of the same shapes (checked against the saved values) and the steps
since are redone. For:

* ``ftagent``: ``ftagent.checkpoint``'s Snapshotter into a memory-backed directory
  (``/dev/shm``): blocks for the copy into its staging buffers; DCP writes the shard in the
  background; the resume verifies sizes and checksums first.
* ``dcp-async``: ``torch.distributed.checkpoint.async_save`` to local disk (its default
  stager: a copy to host memory, then the write in a thread).
* ``torch.save``: a plain ``torch.save`` of the state to local disk (blocks for all of it).
* ``dlrover-flash``: DLRover's flash checkpoint (``DdpCheckpointer``, memory storage: a
  copy into shared memory its saver process owns), run by bench/snapshot_dlrover.py in
  DLRover's own virtualenv (``.bench-venvs/dlrover``, ``bash bench/peers.sh``); without
  it, printed as not run and why.

Per method: the first save's blocking time (it allocates: staging buffers, shared
memory), the median blocking time of the saves after it, the background part, the median
time to resume, the steps redone per fault, the interval at which its blocking time is at
most 1 % of the training time (what ``--snapshot-budget 0.01`` chooses) and the work a
fault at a random point of that interval redoes (half of it on average). Then issue 34's
bar: ftagent's blocking time at most the fastest peer's and at most 1 % at its interval.
``--json FILE`` writes the figures (bench/goodput_projection.py --from reads them). The
machine is shared and loaded: compare the methods within one run, not across runs::

    PYTHONPATH=. .venv/bin/python bench/snapshot.py --gib 1 --saves 3 --json snapshot.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
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
BUDGET = 0.01  # the share of training time saves may block (--snapshot-budget)


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


def chosen_interval(blocking: float, step_seconds: float, budget: float = BUDGET) -> int:
    """Steps between two saves so that saves block at most ``budget`` of the training time:
    the rule the agent applies with ``--snapshot-budget`` (settings.interval_due)."""
    if blocking <= 0 or step_seconds <= 0 or budget <= 0:
        return 1
    return max(1, math.ceil(blocking / (budget * step_seconds)))


def redone_at(interval: int, step_seconds: float) -> dict[str, float]:
    """Work redone by a fault at a uniformly random point of an ``interval``-step interval:
    the steps since the last complete save, ``(interval - 1) / 2`` on average (0 to
    ``interval - 1`` whole steps, plus the step in flight, which every method redoes),
    ``interval`` at most; in steps and in seconds of training."""
    mean = (interval - 1) / 2 + 1
    return {"steps_mean": mean, "steps_max": float(interval),
            "seconds_mean": mean * step_seconds, "seconds_max": interval * step_seconds}


def run(method: Method, state: dict[str, Any], saves: int, every: int,
        step_seconds: float, faults: int = 0, rng: random.Random | None = None,
        ) -> dict[str, Any]:
    """``saves`` saves, one every ``every`` steps (each save's background part waited for
    and timed apart: in training it overlaps the next steps), then ``faults`` faults, each
    at a random step of the next interval: the state in the trainer's memory is lost (a
    fresh state of the same shapes), the method resumes from its newest save, and the
    steps from it to the fault are redone before the next save. Resume time: the median
    over the faults (one resume after the saves when ``faults`` is 0)."""
    rng = rng or random.Random(0)
    blocking, background, resumes, redone = [], [], [], []
    i = 0

    marks: dict[str, float] = {}  # each tensor's moving element at the newest save

    def save() -> None:
        marks.update({k: float(v[0]) for k, v in state["model"].items()})
        t0 = time.perf_counter()
        method.save(i, state)
        blocking.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        method.finish()
        background.append(time.perf_counter() - t1)

    def resume() -> int:
        target = fresh_like(state)
        t0 = time.perf_counter()
        got = method.resume(target)
        resumes.append(time.perf_counter() - t0)
        assert got is not None, (method.name, "nothing to resume from")
        assert target["optim"]["step"] == got, (method.name, target["optim"]["step"], got)
        for k, v in target["model"].items():
            assert float(v[0]) == marks[k] and torch.equal(v[1:], state["model"][k][1:]), \
                (method.name, k)
        state["model"], state["optim"] = target["model"], target["optim"]  # trains on from it
        return got

    for _ in range(saves):
        for _ in range(every):
            i += 1
            step(state, step_seconds, i)
        save()
    saved = i
    if faults <= 0:
        assert resume() == i, (method.name, i)
    for _ in range(faults):
        at = saved + rng.randrange(0, every) + 1  # the fault's step: 1..every after the save
        while i < at:
            i += 1
            step(state, step_seconds, i)
        got = resume()
        assert got == saved, (method.name, got, saved)
        redone.append(at - got)
        i = got  # the steps after it are done again
        while i < saved + every:
            i += 1
            step(state, step_seconds, i)
        save()
        saved = i
    later = blocking[1:] or blocking  # the first save allocates (ftagent: its buffers)
    return {"first": blocking[0], "blocking": statistics.median(later),
            "background": statistics.median(background), "resume": statistics.median(resumes),
            "saves": len(blocking), "faults": len(redone),
            "redone_steps": statistics.mean(redone) if redone else math.nan,
            "redone_steps_max": max(redone) if redone else math.nan}


DLROVER_VENV = Path(os.environ.get("BENCH_VENVS", Path(__file__).resolve().parent.parent
                                   / ".bench-venvs")) / "dlrover"


def dlrover_row(a: argparse.Namespace, tag: str) -> tuple[dict[str, Any] | None, str]:
    """DLRover's flash checkpoint, run by bench/snapshot_dlrover.py in DLRover's own
    virtualenv (its torch, not the project's): (its row, '') or (None, why not)."""
    py = DLROVER_VENV / "bin" / "python"
    if not py.exists():
        return None, (f"no virtualenv at {DLROVER_VENV} (bash bench/peers.sh installs "
                      "dlrover[k8s,torch] there)")
    here = Path(__file__).resolve().parent
    cmd = [str(py), str(here / "snapshot_dlrover.py"), "--gib", str(a.gib), "--saves",
           str(a.saves), "--every", str(a.every), "--step-seconds", str(a.step_seconds),
           "--faults", str(a.faults), "--seed", str(a.seed), "--disk",
           os.path.join(a.disk, f"dlrover-bench-{tag}")]
    shm = os.path.isdir("/dev/shm")
    shm_before = set(os.listdir("/dev/shm")) if shm else set()
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        # its own session: DLRover's saver process (forked, holding the output) is ended
        # with it, by the group's id
        p = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, cwd=here.parent,
                             start_new_session=True)
        try:
            rc: int | None = p.wait(timeout=a.peer_timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            shutil.rmtree(os.path.join(a.disk, f"dlrover-bench-{tag}"), ignore_errors=True)
            if shm:  # the shared memory its saver made and did not remove (1 GiB a run)
                for name in set(os.listdir("/dev/shm")) - shm_before:
                    if name.startswith("ckpt_shm_"):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join("/dev/shm", name))
        out_f.seek(0)
        err_f.seek(0)
        stdout, stderr = out_f.read(), err_f.read()
    if rc is None:
        return None, f"timed out after {a.peer_timeout:.0f} s: {' '.join(cmd)}"
    out = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if rc != 0 or not out:
        tail = (stderr.strip().splitlines() or ["no output"])[-1][:300]
        return None, f"exit {rc}: {tail}"
    row: dict[str, Any] = json.loads(out[-1])
    return row, ""


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's row over alternated rounds: each figure's median, and the rounds'
    blocking times as they came."""
    out: dict[str, Any] = {k: statistics.median(float(r[k]) for r in rounds)
                           for k in rounds[0] if isinstance(rounds[0][k], (int, float))}
    out["blocking_rounds"] = [float(r["blocking"]) for r in rounds]
    return out


def rows_with_intervals(rows: list[tuple[str, dict[str, Any]]], step_seconds: float,
                        budget: float = BUDGET) -> list[dict[str, Any]]:
    """Each method's row with the interval it can afford (saves blocking at most
    ``budget`` of the training time) and the work a fault redoes at that interval."""
    out = []
    for name, r in rows:
        interval = chosen_interval(r["blocking"], step_seconds, budget)
        out.append({"method": name, **r, "interval_steps": interval,
                    "interval_seconds": interval * step_seconds,
                    "redone_at_interval": redone_at(interval, step_seconds)})
    return out


def verdict(rows: list[dict[str, Any]], step_seconds: float,
            budget: float = BUDGET) -> dict[str, Any]:
    """Issue 34's bar: ftagent's blocking time per save at most the fastest peer's, and at
    most ``budget`` of the training time at its chosen interval."""
    by = {r["method"]: r for r in rows}
    f = by.get("ftagent")
    peers = [r for r in rows if r["method"] != "ftagent"]
    if f is None or not peers:
        return {"ok": False, "why": "ftagent and at least one peer must have run"}
    fastest = min(peers, key=lambda r: r["blocking"])
    share = f["blocking"] / (f["interval_steps"] * step_seconds)
    return {"fastest_peer": fastest["method"], "ratio": f["blocking"] / fastest["blocking"],
            "share_at_interval": share, "le_fastest_peer": f["blocking"] <= fastest["blocking"],
            "le_budget": share <= budget + 1e-12,
            "ok": f["blocking"] <= fastest["blocking"] and share <= budget + 1e-12}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model state per rank, GiB")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=5, help="steps between two saves")
    ap.add_argument("--step-seconds", type=float, default=0.2)
    ap.add_argument("--faults", type=int, default=2,
                    help="faults per method, each at a random step after a save")
    ap.add_argument("--seed", type=int, default=0, help="where the faults land")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds over the methods, the order reversed every other round "
                    "(the figures: medians over the rounds)")
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="local disk directory")
    ap.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else
                    tempfile.gettempdir(), help="memory-backed directory")
    ap.add_argument("--only", default="", help="comma-separated methods to run")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    ap.add_argument("--peer-timeout", type=float, default=900.0,
                    help="seconds DLRover's run may take")
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
    only = {m for m in a.only.split(",") if m} or {*makers, "dlrover-flash"}
    tensors = len(state["model"]) + len(state["optim"]["state"])
    head = (f"state {nbytes / (1 << 30):.2f} GiB in {tensors} tensors; {a.saves} saves, one "
            f"every {a.every} steps of {a.step_seconds:.2f} s, then {a.faults} faults; "
            f"torch {torch.__version__}, {os.cpu_count()} CPUs, load "
            f"{os.getloadavg()[0]:.1f}; memory dir {a.shm}, disk {a.disk}")
    print(head, flush=True)
    per: dict[str, list[dict[str, Any]]] = {}
    missing: dict[str, str] = {}
    names = [n for n in [*makers, "dlrover-flash"] if n in only]
    for rnd in range(a.rounds):  # alternate the order: the machine's load moves
        for name in names if rnd % 2 == 0 else names[::-1]:
            if name == "dlrover-flash":  # its own process builds its own state
                row, why = dlrover_row(a, f"{tag}-{rnd}")
                if row is None:
                    missing[name] = why
                    continue
                version = row.pop("version", "")
                per.setdefault(name, []).append(row)
                print(f"  round {rnd + 1}: {name} (DLRover {version}): blocking "
                      f"{row['blocking']:.3f} s", flush=True)
                continue
            m = makers[name]()
            try:
                r = run(m, state, a.saves, a.every, a.step_seconds, a.faults,
                        random.Random(a.seed))
            finally:
                m.close()
            per.setdefault(name, []).append(r)
            print(f"  round {rnd + 1}: {name}: blocking {r['blocking']:.3f} s", flush=True)
    rows = [(n, merge_rounds(per[n])) for n in names if n in per]
    table = rows_with_intervals(rows, a.step_seconds)
    print(f"\n{'method':14} {'first save':>11} {'blocking/save':>14} {'background':>11} "
          f"{'resume':>9} {'redone/fault':>13} {'interval for <=1% blocking':>27} "
          f"{'redone/fault there':>19}")
    for r in table:
        red = r["redone_at_interval"]
        print(f"{r['method']:14} {r['first']:10.3f}s {r['blocking']:13.3f}s "
              f"{r['background']:10.3f}s {r['resume']:8.3f}s "
              f"{r['redone_steps']:7.1f} steps {r['interval_steps']:>16d} steps "
              f"({r['interval_seconds']:.0f} s) {red['seconds_mean']:>14.0f} s mean")
    for name, why in missing.items():
        print(f"{name:14} not run: {why}")
    v = verdict(table, a.step_seconds)
    if "ratio" in v:
        print(f"\nftagent blocking / fastest peer's ({v['fastest_peer']}): {v['ratio']:.2f}; "
              f"at its chosen interval saves block {100 * v['share_at_interval']:.2f} % of the "
              f"training time; bar (<= fastest peer, <= {100 * BUDGET:.0f} %): "
              f"{'met' if v['ok'] else 'NOT met'}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "bench": "snapshot", "command": " ".join(sys.argv), "head": head,
            "gib": a.gib, "bytes": nbytes, "step_seconds": a.step_seconds, "every": a.every,
            "rounds": a.rounds,
            "budget": BUDGET, "load": os.getloadavg()[0], "methods": table,
            "not_run": missing, "verdict": v}, indent=1))
        print(f"figures in {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
