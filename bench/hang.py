"""Hang detection under ``ftagent run`` with real training: latency, false positives, cost.

What is measured, all in one run, on loopback, with ``examples/train.py`` (PyTorch DDP,
gloo on CPU, steps of ``TRAIN_STEP_SLEEP=0.2`` s), one ``ftagent run`` per rank, with
hang verification on as by default (a budget running out is a suspicion, verified from
stack/CPU/I/O samples taken over the last ``--hang-verify-window`` 2 s of the budget).

1. **Detection latency**, for three real hangs on rank 0, every attempt
   (``FAULT_EVERY_ATTEMPT=1``): in a collective (blocked before the all-reduce of step
   ``--hang-at``), in data loading (a "waiting for data" loop that keeps logging) and on a
   lock (a lock-order deadlock with a helper thread). Each class runs twice under a real
   arbiter (``ftagent arbiter`` on loopback; ``--restart-backoff 0``): with default flags
   ("now") and with **today's** flags (``--hang-timeout-min 5 --hang-verify-from 1``: the
   old 5 s floor, every verification sample after the budget), so every attempt is one
   injected hang, detected by both agents (rank 1 is stuck in the all-reduce). Per class:
   detection p50/p99, **culprit accuracy** (the arbiter's restart decisions whose rank is
   rank 0, the injected one), the **flight-recorder dump** time (``seconds`` of the
   fault's ``flight_recorder`` evidence) and the **agent's CPU** per verification
   (``agent_cpu_seconds`` of its ``verify`` events, py-spy included).
   For each hang fault in the agents' ``--events-file``: latency = detection time −
   arrival time of the fault's ``last_step`` line at this script, where detection time is
   the fault's ``ts`` minus its ``stack_capture_seconds`` (the agent takes py-spy stacks
   between detecting and recording). The agent's own ``seconds_since_progress`` is shown
   next to it. The p99 step time is taken from the arrival times of consecutive step lines
   of one attempt (steps 2.. of every attempt, both ranks; not the agent's histogram).
   "Training again" = first step line of the next attempt on rank 0 − rank 0's fault.
2. **False positives.** Healthy 2-rank runs: checkpoint pauses every 20 steps for 10 x the
   step time (``CKPT_EVERY=20 CKPT_FACTOR=10``, 2 s: under the 5 s floor), and every 50
   steps for 40 x (8.2 s: over the floor, so only the checkpoint phase that the agent reads
   from the "saving checkpoint" lines keeps it from being a hang); *undeclared*
   evaluations (``EVAL_EVERY=30 EVAL_SECONDS=12``: CPU-busy forward passes printing
   nothing for 12 s, over the 5 s budget) on every rank, after a 15 s CPU-busy first step
   (``FIRST_STEP_SECONDS=15``); and the same evaluations on rank 0 only, under a real
   arbiter (rank 1 waits for it in the all-reduce and reports a hang; the arbiter's stacks
   show rank 0 alive). Default hang flags except ``--hang-action alert`` without an
   arbiter (an alert does not stop the run, so every false hang is counted). Count: hang
   faults in the events files (restarts under the arbiter).
   **Verification cost**: the agent's own CPU seconds (py-spy included) during each
   verification window, from the ``verify`` events. Error-level hang faults are counted
   too (under the arbiter the waiting rank's report is one today).
   **Quiet saves**: ``bench/hang_quiet.py`` (a 40 s silent checkpoint and a 150 s silent
   save doing I/O, under the arbiter), run as a subprocess when the file is there; its
   rows are printed as they come.
3. **SDK cost.** ``bench/hang_sdk.py`` as a subprocess: median µs per ``ftagent.step()``.
4. **Baseline.** torchrun (``python -m torch.distributed.run``, 2 workers) on the same job
   with one hang and ``TRAIN_PG_TIMEOUT=30``: it notices only when gloo's timeout makes
   rank 1 exit. Torchrun's default 600 s timeout is quoted from FIELD-NOTES, not run.

Every process is started in its own session with ``PR_SET_PDEATHSIG``; on exit (also on
Ctrl-C or SIGTERM) each is sent SIGTERM, then its whole tree SIGKILL.

    .venv/bin/python bench/hang.py [--hangs 10] [--kind-hangs 5] [--no-today] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")
STEP_SLEEP = 0.2
STEP = re.compile(r"\[rank(\d+)\] step=(\d+)/")
STARTED = re.compile(r"\[rank(\d+)\] started: world=\d+ attempt=(\d+)")
TORCHRUN_NOTICED = re.compile(r"closing signal|failed \(exitcode")
SDK_LINE = re.compile(r"^\s+(.+?)\s+median\s+(-?[\d.]+) µs\s+p99\s+(-?[\d.]+) µs")

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class Launched:
    """A process tree this script started, with its output lines and their arrival times."""

    name: str
    proc: subprocess.Popen[bytes]
    lines: list[tuple[float, str]] = field(default_factory=list)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append((time.time(), raw.decode("utf-8", "replace").rstrip("\n")))

    def steps(self) -> list[tuple[float, int, int]]:
        """(arrival, attempt, step) of every step line; the attempt from 'started' lines."""
        rank = self.name.removeprefix("rank")
        out: list[tuple[float, int, int]] = []
        attempt = -1
        for ts, text in list(self.lines):
            # counted, not read: torchrun's workers all say attempt=0
            attempt += sum(1 for m in STARTED.finditer(text) if m.group(1) == rank)
            out.extend((ts, attempt, int(m.group(2))) for m in STEP.finditer(text)
                       if m.group(1) == rank)
        return out


LAUNCHED: list[Launched] = []


def launch(name: str, cmd: list[str], env: dict[str, str]) -> Launched:
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_die_with_parent)
    lp = Launched(name, proc)
    LAUNCHED.append(lp)
    threading.Thread(target=lp.read, daemon=True).start()
    return lp


def stop(lp: Launched, grace: float = 15.0) -> None:
    """SIGTERM the process (agents and torchrun stop their trainers), then kill the tree."""
    try:
        tree = psutil.Process(lp.proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    if lp.proc.poll() is None:
        lp.proc.send_signal(signal.SIGTERM)
        try:
            lp.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            lp.proc.kill()
            lp.proc.wait()
    own = os.getpgrp()
    for p in tree:  # what survived its parent (the agent or torchrun), with its groups
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            pgid = os.getpgid(p.pid)
            if pgid != own:
                os.killpg(pgid, signal.SIGKILL)
            p.kill()


def stop_all() -> None:
    while LAUNCHED:
        stop(LAUNCHED.pop())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (the detector's definition)."""
    s = sorted(values)
    return s[min(max(math.ceil(p / 100 * len(s)), 1), len(s)) - 1]


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def hang_faults(path: Path) -> list[dict[str, Any]]:
    return [e for e in events(path) if e["event"] == "fault" and e["kind"] == "hang"]


def records(path: Path, event: str) -> list[dict[str, Any]]:
    return [e for e in events(path) if e["event"] == event]


# The hangs measured: (name, fault variable, line that marks an injection)
HANGS = [("collective", "FAULT_HANG_AT_STEP", "(fault) hanging"),
         ("data loading", "FAULT_DATA_STALL_AT_STEP", "waiting for data"),
         ("lock", "FAULT_DEADLOCK_AT_STEP", "(fault) taking the locks")]


def train_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TRAIN_STEP_SLEEP=str(STEP_SLEEP), PYTHONPATH=str(ROOT))
    for k in [k for k in env if k.startswith(("FAULT_", "CKPT_", "FTAGENT_"))]:
        del env[k]
    env.update(extra)
    return env


EXTRA_FLAGS: list[str] = []  # from the command line, for every agent


def agents(world: int, tmp: Path, tag: str, flags: list[str], **extra: str) -> list[Launched]:
    port = free_port()
    out = []
    for rank in range(world):
        # --nic lo: the job trains on loopback; links that other work on the machine
        # creates and deletes are no NIC fault of this job (a deleted one would hold
        # every decision of the arbiter until the link came back)
        cmd = [sys.executable, "-m", "ftagent", "run", "--metrics-port=-1", "--nic=lo",
               "--log-level=warning", f"--events-file={tmp / f'{tag}-{rank}.jsonl'}", *flags,
               *EXTRA_FLAGS,
               "--", sys.executable, TRAIN]
        out.append(launch(f"rank{rank}", cmd, train_env(rank, world, port, **extra)))
    return out


def wait_for(cond: Any, deadline: float, what: str) -> bool:
    while time.time() < deadline:
        if cond():
            return True
        if LAUNCHED and all(lp.proc.poll() is not None for lp in LAUNCHED):
            break
        time.sleep(0.2)
    print(f"  (gave up waiting for {what})", file=sys.stderr)
    return False


# ---------------------------------------------------------------------- the measurements


# "today": the behaviour before verification sampled while the budget ran down (floor 5 s,
# every sample after the budget), through flags, in the same run
MODES = {"now": [], "today": ["--hang-timeout-min=5", "--hang-verify-from=1"]}


def arbiter_status(address: str, job: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "ftagent", "status", "--arbiter", address, job,
                        "--json", "--timeline=0"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    return dict(json.loads(r.stdout)) if r.returncode == 0 else {"timeline": []}


def measure_hangs(hangs: int, world: int, hang_at: int, tmp: Path,
                  kind: tuple[str, str, str] = HANGS[0], mode: str = "now") -> dict[str, Any]:
    """``hangs`` injected hangs on rank 0, one per attempt, under a real arbiter (its
    verdict names the culprit), with the agents' flags of ``mode``."""
    from ftagent.arbiter.process import ArbiterProcess

    name, fault, marker = kind
    tag = f"hang-{mode}-" + name.replace(" ", "-")
    with ArbiterProcess(log_dir=str(tmp)) as arb:
        flags = ["--arbiter", arb.address, "--job", tag, f"--max-restarts={hangs + 5}",
                 "--restart-backoff=0", *MODES[mode]]
        ranks = agents(world, tmp, tag, flags, TRAIN_STEPS="100000", FAULT_RANK="0",
                       FAULT_EVERY_ATTEMPT="1", **{fault: str(hang_at)})
        resumed = lambda: any(a >= hangs for _, a, _ in ranks[0].steps())  # noqa: E731
        wait_for(resumed, time.time() + 40 + hangs * 30, f"attempt {hangs} to step")
        time.sleep(0.3)
        for lp in ranks:
            stop(lp)
            LAUNCHED.remove(lp)
        st = arbiter_status(arb.address, tag)
    # the arbiter's decisions on the hangs: the rank a restart names is its culprit
    decided = [e for e in st.get("timeline", []) if e.get("kind") == "decision"
               and e.get("action") in ("restart", "replace", "stop")]
    named = [e.get("rank") for e in decided]
    intervals: list[float] = []
    latency: list[float] = []
    agent_since: list[float] = []
    stacks: list[float] = []
    budgets: list[float] = []
    resume: list[float] = []
    again: list[float] = []
    for rank, lp in enumerate(ranks):
        steps = lp.steps()
        at = {(a, s): ts for ts, a, s in steps}
        intervals += [at[a, s] - at[a, s - 1] for (a, s) in at if s >= 2 and (a, s - 1) in at]
        for f in hang_faults(tmp / f"{tag}-{rank}.jsonl"):
            last = at.get((f["attempt"], f["last_step"]))
            if last is None:
                continue
            capture = f.get("stack_capture_seconds") or 0.0
            latency.append(f["ts"] - capture - last)
            agent_since.append(f["seconds_since_progress"])
            stacks.append(capture)
            budgets.append(f["budget_seconds"])
            if rank == 0:
                first = [ts for ts, a, _ in steps if a == f["attempt"] + 1]
                if first:
                    resume.append(min(first) - f["ts"])
                    again.append(min(first) - last)
    attempts: set[int] = set()
    attempt = -1
    for _, text in ranks[0].lines:  # attempts of rank 0 in which the fault showed
        attempt += 1 if STARTED.search(text) else 0
        if marker in text:
            attempts.add(attempt)
    all_faults = [f for r in range(world) for f in hang_faults(tmp / f"{tag}-{r}.jsonl")]
    verdicts = [f.get("verdict") for f in all_faults]
    dumps = [f["flight_recorder"]["seconds"] for f in all_faults
             if isinstance(f.get("flight_recorder"), dict)
             and isinstance(f["flight_recorder"].get("seconds"), (int, float))]
    verify = [v for r in range(world) for v in records(tmp / f"{tag}-{r}.jsonl", "verify")
              if v.get("window_seconds")]
    cost = [v["agent_cpu_seconds"] / v["window_seconds"] for v in verify]
    cpu = [v["agent_cpu_seconds"] for v in verify]
    return {"name": name, "mode": mode, "world": world, "intervals": intervals,
            "latency": latency, "agent_since": agent_since, "stacks": stacks,
            "budgets": budgets, "resume": resume, "again": again, "verdicts": verdicts,
            "cost": cost, "cpu": cpu, "dumps": dumps, "named": named,
            "injected": len(attempts),
            "detected": len(hang_faults(tmp / f"{tag}-0.jsonl"))}


def measure_false_positives(steps: int, every: int, factor: int, tmp: Path,
                            evals: str = "", first: float = 0.0) -> dict[str, Any]:
    """A healthy run: checkpoints every ``every`` steps for ``factor`` step times, or
    undeclared evaluations (``evals``: "all" ranks, or "one" under an arbiter) every
    ``every`` steps for ``factor`` seconds."""
    from ftagent.arbiter.process import ArbiterProcess

    tag = f"healthy-{evals or 'ckpt'}-{every}-{factor}"
    if evals:
        extra = {"EVAL_EVERY": str(every), "EVAL_SECONDS": str(factor)}
        if evals == "one":
            extra["EVAL_RANK"] = "0"
        pauses = (steps - 1) // every * factor + first
    else:
        extra = {"CKPT_EVERY": str(every), "CKPT_FACTOR": str(factor)}
        pauses = (steps - 1) // every * factor * (STEP_SLEEP + 0.005)
    if first:
        extra["FIRST_STEP_SECONDS"] = f"{first:g}"
    arb = ArbiterProcess() if evals == "one" else None
    flags = ["--hang-action=alert"]
    if arb is not None:
        arb.__enter__()
        flags = ["--arbiter", arb.address, "--job", tag]
    try:
        ranks = agents(2, tmp, tag, flags, TRAIN_STEPS=str(steps), TRAIN_PG_TIMEOUT="60",
                       **extra)
        deadline = time.time() + 60 + 2 * (steps * STEP_SLEEP + pauses)
        wait_for(lambda: all(lp.proc.poll() is not None for lp in ranks), deadline,
                 "healthy run")
        codes = [lp.proc.poll() for lp in ranks]
        for lp in ranks:
            stop(lp)
            LAUNCHED.remove(lp)
    finally:
        if arb is not None:
            arb.__exit__(None, None, None)
    paths = [tmp / f"{tag}-{r}.jsonl" for r in range(2)]
    restarts = [a for p in paths for a in records(p, "action") if a["kind"] == "restart"]
    # under the arbiter the waiting rank's report is expected; a restart is a false positive
    faults = restarts if arb is not None else [f for p in paths for f in hang_faults(p)]
    verify = [v for p in paths for v in records(p, "verify")]
    phases = [v for p in paths for v in records(p, "phase")]
    gaps = []
    for lp in ranks:
        ts = [t for t, _, _ in lp.steps()]
        gaps += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    done = [max((s for _, _, s in lp.steps()), default=0) for lp in ranks]
    return {"steps": steps, "every": every, "factor": factor, "faults": faults,
            "codes": codes, "gaps": gaps, "done": done, "evals": evals, "first": first,
            "verify": verify, "phases": phases,
            "reports": [f for p in paths for f in hang_faults(p)],
            "errors": [f for p in paths for f in hang_faults(p) if f.get("severity") == "error"]}


def measure_quiet(quick: bool) -> tuple[int | None, list[str]]:
    """``bench/hang_quiet.py`` (silent saves doing I/O, the hangbusy lane's), if present:
    (its exit status, its report lines)."""
    path = ROOT / "bench" / "hang_quiet.py"
    if not path.exists():
        return None, ["bench/hang_quiet.py not present: not run"]
    cmd = [sys.executable, str(path), *(["--quick"] if quick else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, ["bench/hang_quiet.py: did not finish in 1200 s"]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 and not lines:
        lines = out.stderr.splitlines()[-10:]
    return out.returncode, lines


def measure_sdk(calls: int) -> list[tuple[str, float]]:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "hang_sdk.py"), f"--calls={calls}"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    return [(m.group(1), float(m.group(2))) for ln in out.stdout.splitlines()
            if (m := SDK_LINE.match(ln))]


def measure_torchrun(hang_at: int, timeout: int) -> dict[str, float | None]:
    env = train_env(0, 2, 0, TRAIN_STEPS="100000", FAULT_RANK="0",
                    FAULT_HANG_AT_STEP=str(hang_at), TRAIN_PG_TIMEOUT=str(timeout),
                    TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", TRAIN]
    lp = launch("rank0", cmd, env)
    again = lambda: any(a >= 1 for _, a, _ in lp.steps())  # noqa: E731
    wait_for(again, time.time() + timeout + 90, "torchrun's second attempt to step")
    stop(lp)
    LAUNCHED.remove(lp)
    lines = list(lp.lines)
    hung = next((ts for ts, t in lines if "(fault) hanging" in t), None)
    last = max((ts for ts, a, _ in lp.steps() if a == 0 and hung and ts <= hung), default=None)
    noticed = next((ts for ts, t in lines if hung and ts > hung and TORCHRUN_NOTICED.search(t)),
                   None)
    first = min((ts for ts, a, _ in lp.steps() if a == 1), default=None)
    return {"detect": noticed - last if noticed and last else None,
            "again": first - last if first and last else None}


# ---------------------------------------------------------------------- the report


def timed(what: str, fn: Callable[..., T], *args: Any) -> T:
    """Run one measurement, saying on stderr how long it took."""
    t = time.time()
    out = fn(*args)
    print(f"  {what}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    return out


def fmt(v: float | None, unit: str = "s", digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f} {unit}".rstrip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hangs", type=int, default=10, help="injected hangs (default 10)")
    ap.add_argument("--ranks", type=int, choices=(1, 2), default=2,
                    help="ranks of the hang runs (default 2)")
    ap.add_argument("--hang-at", type=int, default=10, help="step that hangs (default 10)")
    ap.add_argument("--healthy-steps", type=int, default=200,
                    help="steps of the false-positive run (default 200)")
    ap.add_argument("--long-ckpt-steps", type=int, default=110,
                    help="steps of the run with 8 s checkpoints every 50 steps (default 110)")
    ap.add_argument("--kind-hangs", type=int, default=5,
                    help="injected data-loading and lock hangs each (default 5)")
    ap.add_argument("--eval-steps", type=int, default=100,
                    help="steps of the runs with undeclared evaluations (default 100)")
    ap.add_argument("--hang-timeout-min", type=float, default=None,
                    help="pass this floor to every agent (default: the agent's, 5 s)")
    ap.add_argument("--quick", action="store_true",
                    help="3 hangs, 100 + 110 healthy steps, no torchrun: a smoke run (~2 min)")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun baseline")
    ap.add_argument("--no-today", action="store_true",
                    help="skip the runs with today's flags (floor 5 s, verification after "
                    "the budget)")
    args = ap.parse_args()
    if args.quick:
        args.hangs, args.healthy_steps, args.no_torchrun = min(args.hangs, 3), 100, True
        args.long_ckpt_steps, args.kind_hangs, args.eval_steps = 110, 2, 70
    if args.hang_timeout_min is not None:
        EXTRA_FLAGS.append(f"--hang-timeout-min={args.hang_timeout_min:g}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="ftagent-bench-hang-") as d:
            tmp = Path(d)
            hs: list[dict[str, Any]] = []
            for mode in ("now",) if args.no_today else ("now", "today"):
                hs += [timed(f"hang runs, collective, {mode}", measure_hangs, args.hangs,
                             args.ranks, args.hang_at, tmp, HANGS[0], mode)]
                hs += [timed(f"hang runs, {k[0]}, {mode}", measure_hangs, args.kind_hangs,
                             args.ranks, args.hang_at, tmp, k, mode)
                       for k in HANGS[1:] if args.kind_hangs > 0]
            h = hs[0]
            fps = [timed("healthy run", measure_false_positives, args.healthy_steps, 20, 10,
                         tmp),
                   timed("healthy run, long checkpoints", measure_false_positives,
                         args.long_ckpt_steps, 50, 40, tmp),
                   timed("healthy run, undeclared evaluations", measure_false_positives,
                         args.eval_steps, 30, 12, tmp, "all", 15.0),
                   timed("healthy run, evaluation on one rank, arbiter",
                         measure_false_positives, args.eval_steps, 30, 12, tmp, "one")]
            quiet = timed("quiet saves (bench/hang_quiet.py)", measure_quiet, args.quick)
            sdk = timed("SDK bench", measure_sdk, 20_000 if args.quick else 100_000)
            tr = None if args.no_torchrun else timed("torchrun", measure_torchrun,
                                                     args.hang_at, 30)
    except KeyboardInterrupt:
        stop_all()
        print("interrupted: every process this run started is stopped", file=sys.stderr)
        return 130
    finally:
        stop_all()
    report(args, h, fps, sdk, tr, time.time() - t0, hs, quiet)
    ok = bool(h["latency"]) and not any(fp["faults"] for fp in fps) and (
        h["detected"] == h["injected"] >= args.hangs) and all(
        x["detected"] == x["injected"] > 0 for x in hs) and quiet[0] in (None, 0)
    return 0 if ok else 1


def report(args: argparse.Namespace, h: dict[str, Any], fps: list[dict[str, Any]],
           sdk: list[tuple[str, float]], tr: dict[str, float | None] | None,
           wall: float, hs: list[dict[str, Any]] | None = None,
           quiet: tuple[int | None, list[str]] = (None, [])) -> None:
    import torch

    argv = " ".join(sys.argv[1:])
    print(f"command: .venv/bin/python bench/hang.py {argv}".rstrip())
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
          f"torch {torch.__version__}, gloo on loopback; wall {wall:.0f} s")
    from ftagent.config import HangConfig

    floor = args.hang_timeout_min or HangConfig().hang_timeout_min
    step99 = pct(h["intervals"], 99) if h["intervals"] else math.nan
    lat = h["latency"]
    print(f"\n1. hang detection: {h['world']} rank(s), one ftagent run each, rank 0 hangs "
          f"before the all-reduce of step {args.hang_at} on every attempt; "
          f"{h['injected']} hangs injected, {h['detected']} detected by rank 0's agent, "
          f"{len(lat)} detections by all agents")
    rows: list[tuple[str, str]] = [
        (f"p99 / p50 step time (step-line arrival, n={len(h['intervals'])})",
         f"{step99:.3f} / {statistics.median(h['intervals']):.3f} s" if h["intervals"]
         else "n/a")]
    if lat:
        p50, p99, mx = statistics.median(lat), pct(lat, 99), max(lat)
        rows += [
            ("detection latency p50 / p99 / max",
             f"{p50:.2f} / {p99:.2f} / {mx:.2f} s"),
            ("  as a multiple of the p99 step time",
             f"{p50 / step99:.1f} / {p99 / step99:.1f} / {mx / step99:.1f} x"),
            ("  agent's own seconds_since_progress p50 / max",
             f"{statistics.median(h['agent_since']):.2f} / {max(h['agent_since']):.2f} s"),
            (f"  budget in force (learned; floor {floor:g} s)",
             f"{min(h['budgets']):.2f} .. {max(h['budgets']):.2f} s"),
            ("py-spy stacks before acting, median" + (
                " (the verification window's last sample, reused)"
                if not any(h["stacks"]) else ""), fmt(statistics.median(h["stacks"]), "s", 3)),
        ]
    if h["resume"]:
        rows.append((f"detection -> training again (rank 0, n={len(h['resume'])}) p50 / max",
                     f"{statistics.median(h['resume']):.2f} / {max(h['resume']):.2f} s"))
        rows.append(("last step -> training again, p50 / max",
                     f"{statistics.median(h['again']):.2f} / {max(h['again']):.2f} s"))
    table(rows)
    if hs:
        print("\n1b. by kind of hang, under a real arbiter: now (default flags) | today "
              "(--hang-timeout-min 5 --hang-verify-from 1: floor 5 s, every verification "
              "sample after the budget), same run. Detection: last step line -> hang "
              "declared; culprit: the arbiter's restart names rank 0, the injected one")
        table(by_kind(hs))
    print("\n2. false positives: healthy 2-rank runs, steps of 0.2 s, checkpoint pauses "
          "(logged Megatron-style) and undeclared evaluations, default hang flags but "
          "--hang-action alert (under the arbiter: its decisions)")
    rows = []
    for fp in fps:
        if fp["evals"]:
            who = "every rank" if fp["evals"] == "all" else "rank 0 only, under an arbiter"
            first = f", first step +{fp['first']:g} s CPU" if fp["first"] else ""
            what = "restarts" if fp["evals"] == "one" else "hang faults"
            rows.append((f"{fp['steps']} steps, undeclared {fp['factor']} s evaluation every "
                         f"{fp['every']} on {who}{first}: {what} (goal 0)",
                         str(len(fp["faults"]))))
            kinds = Counter(v["kind"] for v in fp["verify"])
            rows.append(("  verifications by verdict (all ranks)",
                         ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"))
            rows.append(("  undeclared phases recorded (all ranks) / of them recognised",
                         f"{len(fp['phases'])} / "
                         f"{sum(1 for p in fp['phases'] if p.get('recognised'))}"))
            if fp["evals"] == "one":
                rows.append(("  hang reports of the waiting rank (job busy, no restart)",
                             str(len(fp["reports"]))))
            cost = [v["agent_cpu_seconds"] / v["window_seconds"] for v in fp["verify"]
                    if v.get("window_seconds")]
            if cost:
                rows.append(("  agent CPU during a verification window, median / max",
                             f"{100 * statistics.median(cost):.1f} / {100 * max(cost):.1f} "
                             "% of a core"))
        else:
            pause = fp["factor"] * (STEP_SLEEP + 0.005)
            rows.append((f"{fp['steps']} steps, {pause:.1f} s checkpoint every {fp['every']}:"
                         " hang faults (goal 0)", str(len(fp["faults"]))))
        rows += [("  steps done per rank / exit status", f"{fp['done']} / {fp['codes']}"),
                 ("  longest gap between step lines", fmt(max(fp["gaps"], default=None)))]
        rows.append(("  error-level hang faults (all ranks; goal 0)", str(len(fp["errors"]))))
    table(rows)
    print(f"\n2b. quiet saves doing I/O under the arbiter (bench/hang_quiet.py, exit status "
          f"{quiet[0]})")
    for ln in quiet[1]:
        print(f"   {ln}")
    for f in [f for fp in fps for f in fp["faults"]]:
        print(f"   false positive: rank {f.get('rank')}: {f['message'][:300]}")
    print("\n3. SDK cost per ftagent.step() (bench/hang_sdk.py, median)")
    table([(name, f"{us:.2f} µs") for name, us in sdk] or [("bench/hang_sdk.py", "failed")])
    print("\n4. baseline")
    rows = []
    if tr is not None:
        rows += [("torchrun, TRAIN_PG_TIMEOUT=30, measured here: detect (gloo timeout)",
                  fmt(tr["detect"])),
                 ("  last step -> training again", fmt(tr["again"]))]
        if lat and tr["detect"]:
            rows.append(("  torchrun / ftagent detection (p50)",
                         f"{tr['detect'] / statistics.median(lat):.1f} x"))
    rows += [("torchrun, timeout 30 s (FIELD-NOTES, not measured here)",
              "detected 31.8 s, resumed 37.4 s"),
             ("torchrun, default 600 s timeout (FIELD-NOTES, not measured here)",
              "not detected in 120 s")]
    table(rows)


def by_kind(hs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Per kind of hang: each figure now | today."""
    def one(x: dict[str, Any] | None, fig: str) -> str:
        if x is None:
            return "not run"
        lat = x["latency"]
        if fig == "detect":
            return (f"{statistics.median(lat):.2f} / {pct(lat, 99):.2f} s (n={len(lat)})"
                    if lat else "no detections")
        if fig == "culprit":
            n = len(x["named"])
            right = sum(1 for r in x["named"] if r == 0)
            return f"{right}/{n} ({100 * right / n:.0f} %)" if n else "no decisions"
        if fig == "dump":
            return (f"{statistics.median(x['dumps']):.3f} / {max(x['dumps']):.3f} s"
                    if x["dumps"] else "no dump")
        if fig == "cpu":
            return (f"{statistics.median(x['cpu']):.3f} s, {100 * statistics.median(x['cost']):.1f}"
                    " % of a core" if x["cpu"] else "n/a")
        verdicts = Counter(str(v) for v in x["verdicts"])
        return ", ".join(f"{k} {n}" for k, n in sorted(verdicts.items())) or "none"

    rows = []
    for name in dict.fromkeys(x["name"] for x in hs):
        now = next((x for x in hs if x["name"] == name and x["mode"] == "now"), None)
        today = next((x for x in hs if x["name"] == name and x["mode"] == "today"), None)
        injected = now["injected"] if now else 0
        rows.append((f"{name} ({injected} injected): detection p50 / p99",
                     f"{one(now, 'detect')}  |  {one(today, 'detect')}"))
        rows += [(f"  {label}", f"{one(now, fig)}  |  {one(today, fig)}") for label, fig in (
            ("culprit accuracy (the arbiter's restarts naming rank 0)", "culprit"),
            ("flight-recorder dump time, median / max", "dump"),
            ("agent CPU per verification (py-spy incl.), median", "cpu"),
            ("verdicts of the hang faults (both ranks)", "verdicts"))]
    return rows


def table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"   {k:<{width}}  {v}")


if __name__ == "__main__":
    sys.exit(main())
