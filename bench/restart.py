"""Crash -> every rank training again: torchrun against ftagent cold and ftagent warm.

The real job: examples/train.py, 2 ranks, gloo on CPU. Each repetition starts the job under
each launcher in turn (alternating, so load drift hits all three alike), waits until both
ranks train steadily, crashes rank 0 at its next step (FAULT_CRASH_ON_FILE), and measures
from the crash to the first step of the next attempt on *every* rank, on the trainers' own
clocks (their ``timing:`` lines); when those lines were read from the launcher's output
(ftagent's pump batches lines, ``--output-interval``) is printed apart.

  (a) torchrun --standalone --nproc-per-node 2 --max-restarts 3, with
      TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (its only working configuration on torch 2.13);
      its default (the store shared across attempts) is run too, for its failure rate
  (b) ftagent cold: one `ftagent run --no-warm-restart` per rank under an arbiter
      (tests/e2e/jobs.py's shape), which restarts both ranks at the next generation
  (c) ftagent warm: the same with the default --warm-restart: each rank's restart is its
      standby interpreter, which had imported torch (learned from train.py's imports)
  (d) ftagent launcher: ``ftagent run --standalone --nproc-per-node 2`` with its defaults
      (warm restarts on), the same shape as (a): one launcher for both workers

Every run also measures the job's *first* start: from the launcher's start to the first
training step on both ranks, on the trainers' own clocks (their ``timing: first_step``
lines against the bench's ``time.time()`` at launch). Standbys start only once the
attempt reached its first step (issue 26), so ftagent's first start should be
torchrun's; the report prints each launcher's first start against torchrun's.

Also the standby's memory (PSS) per worker, next to the trainer's, while (c) trains, and
the breakdown of each launcher's restart: every mark's offset from the crash, from the
trainers' own ``timing:`` lines (examples/train.py TRAIN_TIMING=1, time.time()), both
agents' events files and the arbiter's timeline (its log), medians over the runs.

    .venv/bin/python bench/restart.py [--reps 5] [--default-reps 4] [--kinds K,K...]
    .venv/bin/python bench/restart.py --overhead [--reps 3] [--window 30]

--overhead: the launcher's own steady-state CPU and PSS on the same job, one launcher for
both workers (``torchrun --nproc-per-node 2`` against ``ftagent run --nproc-per-node 2``
with its defaults): psutil CPU times of the launcher process only (not the trainers),
PSS from /proc/PID/smaps_rollup; ftagent's watchdog and standbys are printed apart.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")
STEP_SLEEP = 0.1
STEP = re.compile(r"\[rank(\d+)\] step=(\d+)/")
STARTED = re.compile(r"\[rank(\d+)\] started: world=\d+")
CRASH = re.compile(r"\[rank0\] step \d+: \(fault\) crashing")
TIMING = re.compile(r"\[rank(\d+)\] timing: (\w+) t=([\d.]+)")
ARBITER_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ "
                          r"ftagent\.arbiter\.timeline: (\S+) g(\d+) (.*)$", re.M)
# the restart's path, in order: (mark, what it is). Offsets are from the crash (the
# crashing trainer's own time.time()), the later of the two ranks where both have one.
STAGES = [
    ("exit_seen", "rank 0's agent reaped the crashed trainer (events file)"),
    ("fault_at_arbiter", "the crash fault in the arbiter's timeline"),
    ("decision", "the arbiter's RESTART decision (timeline)"),
    ("peer_stopped", "rank 1's trainer exited (stopped by its agent, or failed in gloo)"),
    ("arrived", "both agents at the barrier of the next generation (events files)"),
    ("released", "the barrier released, both agents told (events files)"),
    ("go", "the next trainer handed over (standby go, or cold spawn)"),
    ("script", "the script's first line runs"),
    ("imported", "torch imported (top of main())"),
    ("process_group", "init_process_group returned (rendezvous of both ranks)"),
    ("ddp", "DDP constructed"),
    ("first_step", "the first training step done"),
]
STEADY_STEPS = 20  # both ranks past this step before the crash
KINDS = ("torchrun", "ftagent-cold", "ftagent-warm", "ftagent-launcher", "ftagent-baseline")
BASELINE_ROOT = [""]  # --baseline-root: a checkout whose ftagent/ the baseline kind runs
AGAIN_TIMEOUT = 60.0  # crash -> training again, else counted as a failed restart


@dataclass
class Launched:
    """A process this bench started, with its output lines and their arrival times."""

    proc: subprocess.Popen[bytes]
    lines: list[tuple[float, str]] = field(default_factory=list)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append((time.monotonic(), raw.decode("utf-8", "replace").rstrip("\n")))


def launch(cmd: list[str], env: dict[str, str]) -> Launched:
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    lp = Launched(proc)
    threading.Thread(target=lp.read, daemon=True).start()
    return lp


def stop(lps: list[Launched], grace: float = 15.0) -> None:
    trees = []
    for lp in lps:
        with contextlib.suppress(psutil.Error):
            trees += psutil.Process(lp.proc.pid).children(recursive=True)
        if lp.proc.poll() is None:
            lp.proc.send_signal(signal.SIGTERM)
    for lp in lps:
        try:
            lp.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            lp.proc.kill()
            lp.proc.wait()
    for p in trees:
        with contextlib.suppress(psutil.Error):
            p.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(crash_file: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FAULT_", "FTAGENT_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TRAIN_STEPS="100000",
               TRAIN_STEP_SLEEP=str(STEP_SLEEP), TRAIN_PG_TIMEOUT="30", FAULT_RANK="0",
               TRAIN_TIMING="1",
               FAULT_CRASH_ON_FILE=str(crash_file), **extra)
    return env


def steps_of(lines: list[tuple[float, str]], rank: int) -> list[tuple[float, int]]:
    return [(ts, int(m.group(2))) for ts, t in lines for m in STEP.finditer(t)
            if int(m.group(1)) == rank]


def recovery(lines: list[tuple[float, str]], crash_ts: float) -> float | None:
    """Crash line -> the first step of a new attempt (a 'started' line after the crash),
    the later of the two ranks."""
    worst = 0.0
    for rank in (0, 1):
        started = next((ts for ts, t in lines if ts > crash_ts
                        and any(int(m.group(1)) == rank for m in STARTED.finditer(t))), None)
        if started is None:
            return None
        first = next((ts for ts, _ in steps_of(lines, rank) if ts > started), None)
        if first is None:
            return None
        worst = max(worst, first - crash_ts)
    return worst


def all_lines(lps: list[Launched]) -> list[tuple[float, str]]:
    return sorted(line for lp in lps for line in lp.lines)


def wait(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def standby_memory(agents: list[Launched]) -> list[tuple[int, int]]:
    """(standby PSS, trainer PSS) in bytes per rank, while attempt 0 trains."""
    out = []
    for lp in agents:
        try:
            kids = psutil.Process(lp.proc.pid).children()
        except psutil.Error:
            continue
        sb = [p for p in kids if any("ftagent_standby" in a for a in _cmdline(p))]
        tr = [p for p in kids if TRAIN in _cmdline(p)]
        for s, t in zip(sb, tr, strict=False):  # the launcher: one pair per worker
            with contextlib.suppress(psutil.Error):
                out.append((s.memory_full_info().pss, t.memory_full_info().pss))
    return out


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def standby_ready(agents: list[Launched], want: int | None = None) -> bool:
    """Every rank has a standby that has loaded torch's library (it imports, then waits):
    ``want`` of them (default: one per agent)."""
    n = 0
    for lp in agents:
        try:
            kids = psutil.Process(lp.proc.pid).children()
        except psutil.Error:
            return False
        for p in kids:
            if any("ftagent_standby" in a for a in _cmdline(p)):
                try:
                    maps = Path(f"/proc/{p.pid}/maps").read_text()
                except OSError:
                    continue
                if "libtorch" in maps and waits_for_go(p.pid):
                    n += 1
    return n == (len(agents) if want is None else want)


def waits_for_go(pid: int) -> bool:
    """The standby's imports are done: it is blocked reading its go pipe (``sleeping``
    alone is also true of a standby waiting for a page or a lock mid-import)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text().endswith("pipe_read")
    except OSError:
        return False


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) of these processes and every live descendant."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(pid)
            for p in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += own_cpu(p)
    return total


def first_start(lines: list[tuple[float, str]], launched_wall: float) -> float | None:
    """Launch -> the first training step of attempt 0 on both ranks (the later one), on
    the trainers' own clocks: their first ``timing: first_step`` line."""
    firsts: dict[int, float] = {}
    for _, t in lines:
        for m in TIMING.finditer(t):
            if m.group(2) == "first_step":
                firsts.setdefault(int(m.group(1)), float(m.group(3)))
    if len(firsts) < 2:
        return None
    return max(firsts.values()) - launched_wall


def _what_happened(tmp: Path, job: str, lines: list[tuple[float, str]]) -> str:
    """Why a run went wrong, for its report line: the agents' faults and actions, else the
    last output lines."""
    what = []
    for p in sorted(tmp.glob(f"{job}-*.jsonl")) if job else []:
        for ln in p.read_text().splitlines():
            with contextlib.suppress(ValueError):
                e = json.loads(ln)
                if e.get("event") in ("fault", "action"):
                    what.append(f"rank {e.get('rank')} {e['event']} {e['kind']}: "
                                f"{str(e.get('message'))[:100]}")
    if not what:
        what = [t[:120] for _, t in lines[-3:]]
    return ": " + "; ".join(what[:4])


def trainer_marks(lines: list[tuple[float, str]], crash_wall: float) -> dict[str, float]:
    """The trainers' own timing lines of the attempt after the crash: the later rank's."""
    per: dict[str, dict[int, float]] = {}
    for _, t in lines:
        for m in TIMING.finditer(t):
            ts = float(m.group(3))
            if m.group(2) != "crash" and ts > crash_wall:
                per.setdefault(m.group(2), {}).setdefault(int(m.group(1)), ts)
    return {k: max(v.values()) - crash_wall for k, v in per.items() if len(v) == 2}


def agent_marks(events: dict[int, list[dict[str, Any]]], timeline: list[tuple[float, str]],
                crash_wall: float) -> dict[str, float]:
    """The agents' events files and the arbiter's timeline, between crash and restart."""
    out: dict[str, float] = {}

    def first(rank: int, pred: Any) -> float | None:
        return next((e["ts"] for e in events.get(rank, []) if e["ts"] >= crash_wall - 0.5
                     and pred(e)), None)

    def both(pred: Any) -> float | None:
        ts = [first(r, pred) for r in (0, 1)]
        return None if None in ts else max(ts)  # type: ignore[type-var]

    marks = {
        "exit_seen": first(0, lambda e: e["event"] == "state" and e["kind"] == "exited"),
        "peer_stopped": first(1, lambda e: e["event"] == "state" and e["kind"] == "exited"),
        "arrived": both(lambda e: e["event"] == "state" and e["kind"] == "barrier"),
        "released": both(lambda e: e["event"] == "state" and e["kind"] == "released"),
        "go": both(lambda e: e["event"] == "state" and e["kind"] == "running"),
        "fault_at_arbiter": next((ts for ts, msg in timeline if ts >= crash_wall - 0.5
                                  and "crash (" in msg), None),
        "decision": next((ts for ts, msg in timeline if ts >= crash_wall - 0.5
                          and "every rank restarts at generation" in msg), None),
    }
    for k, v in marks.items():
        if v is not None:
            out[k] = v - crash_wall
    return out


def arbiter_timeline(log_text: str, job: str) -> list[tuple[float, str]]:
    """(wall time, message) of ``job``'s timeline entries in the arbiter's log (its
    asctime is local time, milliseconds)."""
    out = []
    for m in ARBITER_LINE.finditer(log_text):
        if m.group(2) == job:
            ts = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((ts, m.group(4)))
    return out


def one_run(kind: str, tmp: Path, arbiter: str,
            arbiter_log: Any = lambda: "") -> dict[str, Any]:
    """Start the job under ``kind``, crash rank 0 mid-run, measure, stop."""
    crash = tmp / f"crash-{kind}-{time.monotonic_ns()}"
    port = free_port()
    result: dict[str, Any] = {"kind": kind}
    job = ""
    launched_wall = time.time()
    if kind.startswith("torchrun"):
        extra = {} if kind == "torchrun-default" else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env = base_env(crash, **extra)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--max-restarts=3", TRAIN]
        procs = [launch(cmd, env)]
    elif kind in ("ftagent-launcher", "ftagent-baseline"):
        job = f"bench-{kind}-{time.monotonic_ns()}"
        env = base_env(crash, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        if kind == "ftagent-baseline":  # the same, from another checkout's ftagent/
            env["PYTHONPATH"] = BASELINE_ROOT[0]
        # --restart-backoff 0: the restart path, not the backoff policy, is measured (as
        # torchrun restarts at once); alert-only faults (a link of another test deleted
        # on this host) count towards the local policy's quick-repeat backoff, which
        # turned 2 of 10 restarts into 30 s waits on a shared machine
        cmd = [sys.executable, "-m", "ftagent", "run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=3", "--restart-backoff=0", "--metrics-port=-1",
               "--log-level=warning",
               f"--events-file={tmp / f'{job}-0.jsonl'}", "--", sys.executable, TRAIN]
        procs = [launch(cmd, env)]
    else:
        flags = ["--no-warm-restart"] if kind == "ftagent-cold" else []
        procs = []
        job = f"bench-{kind}-{time.monotonic_ns()}"
        for rank in (0, 1):
            env = base_env(crash, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
            cmd = [sys.executable, "-m", "ftagent", "run", "--metrics-port=-1",
                   "--log-level=warning", "--arbiter", arbiter, "--job", job,
                   "--rank", str(rank), "--world-size", "2", "--max-restarts", "3",
                   f"--events-file={tmp / f'{job}-{rank}.jsonl'}", *flags,
                   "--", sys.executable, TRAIN]
            procs.append(launch(cmd, env))
    try:
        # the CPU the launch took up to its first step (launcher, trainers, standbys,
        # helpers): unlike the wall time, barely moved by what else loads the machine
        if wait(lambda: first_start(all_lines(procs), launched_wall) is not None, 90):
            result["first_cpu"] = tree_cpu([lp.proc.pid for lp in procs])
        steady = wait(lambda: all(any(s >= STEADY_STEPS for _, s in
                                      steps_of(all_lines(procs), r)) for r in (0, 1)), 90)
        result["first"] = first_start(all_lines(procs), launched_wall)
        if kind in ("ftagent-warm", "ftagent-launcher", "ftagent-baseline") and steady:
            steady = wait(lambda: standby_ready(procs, 2), 60)
            result["memory"] = standby_memory(procs)
        if not steady:
            result["error"] = "never trained steadily"
            return result
        crash.touch()
        wait(lambda: any(CRASH.search(t) for _, t in all_lines(procs)), 30)
        crash.unlink()  # torchrun's attempts all say attempt 0: only the first crashes
        crash_ts = next((ts for ts, t in all_lines(procs) if CRASH.search(t)), None)
        if crash_ts is None:
            result["error"] = "no crash seen" + _what_happened(tmp, job if kind.startswith(
                "ftagent") else "", all_lines(procs))
            return result
        result["again"] = None
        wait(lambda: recovery(all_lines(procs), crash_ts) is not None, AGAIN_TIMEOUT)
        result["again"] = recovery(all_lines(procs), crash_ts)
        lines = all_lines(procs)
        started = [next((ts for ts, t in lines if ts > crash_ts and any(
            int(m.group(1)) == r for m in STARTED.finditer(t))), None) for r in (0, 1)]
        if None not in started:  # crash -> model and process group ready on both ranks
            result["started"] = max(started) - crash_ts  # type: ignore[type-var,operator]
        crash_wall = next((float(m.group(3)) for _, t in lines for m in TIMING.finditer(t)
                           if m.group(2) == "crash"), None)
        if crash_wall is not None:
            result["marks"] = trainer_marks(lines, crash_wall)
            # Training again is the trainers' own clock (both ranks' first step after the
            # crash); when the bench *reads* that line depends on the launcher's output
            # path (ftagent's --output-interval batches it), reported apart as "in the log".
            result["again_log"] = result["again"]
            if "first_step" in result["marks"]:
                result["again"] = result["marks"]["first_step"]
        if kind.startswith("ftagent"):
            evs = []
            per_rank: dict[int, list[dict[str, Any]]] = {}
            for rank in (0, 1):
                p = tmp / f"{job}-{rank}.jsonl"
                if not p.exists():  # the launcher: one events file, local_rank per line
                    continue
                rank_evs = [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
                per_rank[rank] = rank_evs
                evs += rank_evs
            if kind in ("ftagent-launcher", "ftagent-baseline"):
                per_rank = {r: [e for e in evs if e.get("local_rank") == r] for r in (0, 1)}
            result["starts"] = sorted(e["kind"] for e in evs if e["event"] == "standby")
            result["cold_reasons"] = sorted({str(e.get("reason"))[:120] for e in evs
                                             if e["event"] == "standby" and e["kind"] == "cold"})
            if crash_wall is not None:
                result["marks"].update(agent_marks(
                    per_rank, arbiter_timeline(arbiter_log(), job), crash_wall))
        if result["again"] is None:  # why, on the report line: the agents' faults and the
            # arbiter's last word (a restart deferred, say: a link another process deleted)
            timeline = arbiter_timeline(arbiter_log(), job) if job else []
            result["error"] = (f"not training {AGAIN_TIMEOUT:.0f} s after the crash"
                               + _what_happened(tmp, job, lines)
                               + (f"; arbiter: {timeline[-1][1][:200]}" if timeline else ""))
        return result
    finally:
        stop(procs)


def pss(pid: int) -> int:
    """Proportional set size in bytes, from /proc/PID/smaps_rollup (0 if gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    m = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


def own_cpu(p: psutil.Process) -> float:
    """CPU seconds of the process itself (user + system), not of its children."""
    t = p.cpu_times()
    return float(t.user + t.system)


def overhead_run(kind: str, tmp: Path, window: float) -> dict[str, Any]:
    """One launcher for both workers on this node: ``torchrun --nproc-per-node 2`` or
    ``ftagent run --nproc-per-node 2`` (defaults: warm standbys, /metrics served). Once
    both ranks train steadily (and ftagent's standbys are ready), the launcher process's
    own CPU over ``window`` seconds and its PSS; ftagent's helpers (the containment
    watchdog) and standbys apart."""
    env = base_env(tmp / "never", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--max-restarts=3", TRAIN]
    else:
        cmd = [sys.executable, "-m", "ftagent", "run", "--nproc-per-node=2",
               "--max-restarts=3", "--metrics-port=0", "--log-level=warning",
               "--master-port", str(free_port()), "--", sys.executable, TRAIN]
    lp = launch(cmd, env)
    result: dict[str, Any] = {"kind": kind}
    try:
        steady = wait(lambda: all(any(s >= STEADY_STEPS for _, s in
                                      steps_of(lp.lines, r)) for r in (0, 1)), 120)
        if steady and kind == "ftagent":
            steady = wait(lambda: _ready_standbys(lp.proc.pid) >= 2, 90)
        if not steady:
            result["error"] = "never trained steadily"
            return result
        me = psutil.Process(lp.proc.pid)
        kids = me.children()
        helpers = [k for k in kids if TRAIN not in _cmdline(k)
                   and not any("ftagent_standby" in a for a in _cmdline(k))]
        standbys = [k for k in kids if any("ftagent_standby" in a for a in _cmdline(k))]
        c0, h0, w0 = own_cpu(me), sum(own_cpu(h) for h in helpers), time.monotonic()
        steps0 = len(steps_of(lp.lines, 0))
        time.sleep(window)  # the measurement window itself, not a synchronisation
        wall = time.monotonic() - w0
        result.update(
            cpu=100 * (own_cpu(me) - c0) / wall, pss=pss(me.pid),
            helper_cpu=100 * (sum(own_cpu(h) for h in helpers) - h0) / wall,
            helper_pss=sum(pss(h.pid) for h in helpers),
            standby_pss=sum(pss(p.pid) for p in standbys), standbys=len(standbys),
            steps_per_s=(len(steps_of(lp.lines, 0)) - steps0) / wall)
        return result
    finally:
        stop([lp])


def _ready_standbys(pid: int) -> int:
    n = 0
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(pid).children():
            if any("ftagent_standby" in a for a in _cmdline(p)):
                with contextlib.suppress(OSError, psutil.Error):
                    if "libtorch" in Path(f"/proc/{p.pid}/maps").read_text() \
                            and waits_for_go(p.pid):
                        n += 1
    return n


def overhead(reps: int, window: float) -> None:
    """--overhead: the launcher's own steady-state CPU and PSS, torchrun against ftagent."""
    runs: dict[str, list[dict[str, Any]]] = {"torchrun": [], "ftagent": []}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as d:
        for rep in range(reps):
            for kind in (["torchrun", "ftagent"] if rep % 2 == 0 else ["ftagent", "torchrun"]):
                r = overhead_run(kind, Path(d), window)
                runs[kind].append(r)
                if "error" in r:
                    print(f"  rep {rep + 1} {kind:9s} {r['error']}", flush=True)
                    continue
                print(f"  rep {rep + 1} {kind:9s} launcher CPU {r['cpu']:5.2f} %  PSS "
                      f"{r['pss'] / 2**20:5.0f} MiB  (helpers {r['helper_cpu']:.2f} % "
                      f"{r['helper_pss'] / 2**20:.0f} MiB; {r['standbys']} standbys "
                      f"{r['standby_pss'] / 2**20:.0f} MiB; {r['steps_per_s']:.1f} steps/s)",
                      flush=True)
    print(f"\nlauncher's own steady state, one launcher for 2 workers ({window:.0f} s "
          f"windows, median of {reps}):")
    med: dict[str, dict[str, float]] = {}
    for kind, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"  {kind:9s} no run worked")
            continue
        med[kind] = {k: statistics.median(r[k] for r in ok)
                     for k in ("cpu", "pss", "helper_cpu", "helper_pss", "standby_pss")}
        m = med[kind]
        print(f"  {kind:9s} CPU {m['cpu']:5.2f} %  PSS {m['pss'] / 2**20:4.0f} MiB" + (
            f"   + watchdog {m['helper_cpu']:.2f} % / {m['helper_pss'] / 2**20:.0f} MiB, "
            f"standbys {m['standby_pss'] / 2**20:.0f} MiB (--no-warm-restart: none)"
            if kind == "ftagent" else ""))
    if len(med) == 2:
        t, f = med["torchrun"], med["ftagent"]
        print(f"  ftagent / torchrun: CPU {f['cpu'] / max(t['cpu'], 1e-9):.2f}, PSS "
              f"{f['pss'] / max(t['pss'], 1):.2f} (launcher process alone); with the "
              f"watchdog: CPU {(f['cpu'] + f['helper_cpu']) / max(t['cpu'], 1e-9):.2f}, "
              f"PSS {(f['pss'] + f['helper_pss']) / max(t['pss'], 1):.2f}")


def machine() -> str:
    import torch

    return (f"{platform.node()}: {platform.platform()}, {os.cpu_count()} CPUs, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, Python "
            f"{platform.python_version()}, torch {torch.__version__}, load "
            f"{os.getloadavg()[0]:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions per launcher (>= 5)")
    ap.add_argument("--default-reps", type=int, default=4,
                    help="runs of torchrun's default configuration (failure rate)")
    ap.add_argument("--overhead", action="store_true",
                    help="measure instead the launcher's own steady-state CPU and PSS "
                    "(torchrun vs ftagent --nproc-per-node 2), REPS runs each")
    ap.add_argument("--window", type=float, default=30.0,
                    help="SECONDS of each --overhead measurement")
    ap.add_argument("--kinds", default=",".join(KINDS[:4]),
                    help=f"launchers to run, comma-separated, of {','.join(KINDS)}")
    ap.add_argument("--baseline-root", default="",
                    help="DIR of another checkout (e.g. before a change): kind "
                    "ftagent-baseline runs ftagent-launcher with its ftagent/ package")
    args = ap.parse_args()
    BASELINE_ROOT[0] = os.path.abspath(args.baseline_root) if args.baseline_root else ""
    if "ftagent-baseline" in args.kinds.split(",") and not args.baseline_root:
        ap.error("--kinds ftagent-baseline needs --baseline-root DIR")
    from ftagent.arbiter.process import ArbiterProcess

    if args.overhead:
        print(f"machine: {machine()}")
        print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
        print(f"job: examples/train.py, 2 ranks, gloo (CPU), {STEP_SLEEP} s steps, "
              "a progress line per step", flush=True)
        overhead(args.reps, args.window)
        return 0

    print(f"machine: {machine()}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"job: examples/train.py, 2 ranks, gloo (CPU), {STEP_SLEEP} s steps, crash of "
          f"rank 0 after step {STEADY_STEPS}", flush=True)
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in [*kinds, "torchrun-default"]}
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as d, ArbiterProcess() as arb:
        tmp = Path(d)
        for rep in range(max(args.reps, args.default_reps)):
            order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]  # who goes first
            if rep < args.default_reps:
                order.append("torchrun-default")
            for kind in order:
                if kind != "torchrun-default" and rep >= args.reps:
                    continue
                r = one_run(kind, tmp, arb.address, arb.log_text)
                runs[kind].append(r)
                print(f"  rep {rep + 1} {kind:17s} first start {_fmt(r.get('first'))} "
                      f"({r.get('first_cpu', 0):.1f} CPU s), "
                      f"crash -> training {_fmt(r.get('again'))} "
                      f"(started {_fmt(r.get('started'))}) "
                      f"{r.get('error', '')} "
                      f"{' '.join(r.get('starts', []))} "
                      f"{'; '.join(r.get('cold_reasons', []))}", flush=True)
    report(runs)
    return 0


def _fmt(v: float | None) -> str:
    return "failed" if v is None else f"{v:6.2f} s"


def report(runs: dict[str, list[dict[str, Any]]]) -> None:
    med: dict[str, float] = {}
    print("\ncrash -> every rank training again, the trainers' own clocks (median, min-max "
          "over the runs that worked):")
    for kind, rs in runs.items():
        ok = [r["again"] for r in rs if r.get("again") is not None]
        failed = len(rs) - len(ok)
        if ok:
            med[kind] = statistics.median(ok)
            print(f"  {kind:17s} {med[kind]:5.2f} s  ({min(ok):.2f}-{max(ok):.2f}, "
                  f"{len(ok)} runs, {failed} failed)")
        else:
            print(f"  {kind:17s} no run worked ({failed} failed)")
    for kind, rs in runs.items():
        seen = [r["again_log"] for r in rs if r.get("again_log") is not None]
        if seen:
            print(f"  {kind:17s} the first step's line read from the launcher's output: "
                  f"{statistics.median(seen):.2f} s")
    for kind, rs in runs.items():
        st = [r["started"] for r in rs if r.get("started") is not None]
        if st:
            print(f"  {kind:17s} of which to 'started' (respawn, imports, model, DDP): "
                  f"{statistics.median(st):.2f} s")
    if "torchrun" in med:
        for kind in KINDS[1:]:
            if kind in med:
                print(f"  {kind} / torchrun: {med[kind] / med['torchrun']:.2f}")
    first: dict[str, float] = {}
    print("\nfirst start -> first step on both ranks, the trainers' own clocks (median, "
          "min-max):")
    for kind, rs in runs.items():
        ok = [r["first"] for r in rs if r.get("first") is not None]
        if ok:
            first[kind] = statistics.median(ok)
            print(f"  {kind:17s} {first[kind]:5.2f} s  ({min(ok):.2f}-{max(ok):.2f}, "
                  f"{len(ok)} runs)")
    if "torchrun" in first:
        for kind in KINDS[1:]:
            if kind in first:
                print(f"  {kind} / torchrun: {first[kind] / first['torchrun']:.2f}")
    print("  CPU seconds of the launch up to its first step (launcher, trainers, standbys, "
          "helpers; median):")
    for kind, rs in runs.items():
        cpu = [r["first_cpu"] for r in rs if r.get("first_cpu") is not None]
        if cpu:
            print(f"  {kind:17s} {statistics.median(cpu):5.2f} s  ({min(cpu):.2f}-"
                  f"{max(cpu):.2f})")
    breakdown(runs)
    for kind in ("ftagent-warm", "ftagent-launcher", "ftagent-baseline"):
        warm = [s for r in runs.get(kind, []) for s in r.get("starts", [])]
        if runs.get(kind):
            print(f"  {kind} restarts: {warm.count('warm')} warm, {warm.count('cold')} "
                  "cold (each rank's start, from the events files)")
    mem = [m for k in ("ftagent-warm", "ftagent-launcher") for r in runs.get(k, [])
           for m in r.get("memory", [])]
    if mem:
        sb = statistics.median(m[0] for m in mem) / 2**20
        tr = statistics.median(m[1] for m in mem) / 2**20
        print(f"standby memory per worker: PSS {sb:.0f} MiB (median of {len(mem)}), the "
              f"training process beside it {tr:.0f} MiB; --no-warm-restart saves it")


def breakdown(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Where the restart's time goes: each mark's median offset from the crash, per
    launcher (torchrun's trainers print the same timing lines; its agent keeps no events)."""
    kinds = [k for k in KINDS if runs.get(k)]
    print("\nbreakdown: seconds after the crash (median over the runs; the later rank):")
    print(f"  {'mark':17s}" + "".join(f"{k:>14s}" for k in kinds) + "  what")
    for mark, what in STAGES:
        cells = []
        for k in kinds:
            vals = [r["marks"][mark] for r in runs[k] if mark in r.get("marks", {})]
            cells.append(f"{statistics.median(vals):14.2f}" if vals else f"{'-':>14s}")
        print(f"  {mark:17s}" + "".join(cells) + f"  {what}")


if __name__ == "__main__":
    sys.exit(main())
