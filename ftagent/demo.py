"""``ftagent demo``: an arbiter and N agents on loopback around a real PyTorch job.

Each agent wraps one rank of ``examples/train.py`` (DDP, gloo, CPU). One rank crashes
in the first run and hangs in a collective in the second; the demo prints the timeline
as it happens — detection, decision, barrier, recovery — and ends with how long each
took. It finishes on its own and leaves no process behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ftagent.arbiter.process import ArbiterProcess
from ftagent.arbiter.status_view import entry_kind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc

STEP_LINE = re.compile(rb"step=(\d+)/")
JOB = "demo"


@dataclass
class Clock:
    t0: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, who: str, what: str, ts: float | None = None) -> None:
        t = (ts if ts is not None else time.time()) - self.t0
        with self.lock:
            print(f"[+{t:6.2f}s] {who:<10} {what}", flush=True)


@dataclass
class Marks:
    """Wall-clock times of what happened, for the summary."""

    faults: list[tuple[float, str]] = field(default_factory=list)
    decisions: list[tuple[float, str, int]] = field(default_factory=list)  # ts, action, gen
    barriers: list[float] = field(default_factory=list)
    # generation -> rank -> time of that rank's first step in it
    resumed: dict[int, dict[int, float]] = field(default_factory=dict)


def find_script() -> Path:
    return Path(__file__).resolve().parent.parent / "examples" / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def watch_arbiter(address: str, clock: Clock, marks: Marks, stop: threading.Event) -> None:
    """Print the arbiter's timeline as it happens (WatchEvents)."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ArbiterStub(ch)
        while not stop.is_set():
            try:
                for e in stub.WatchEvents(pb.WatchEventsRequest(job=JOB, replay=True)):
                    kind = entry_kind(e)
                    who = f"rank {e.rank}" if e.HasField("rank") else "job"
                    clock.say("arbiter", f"g{e.generation} {who:<7} {kind:<12} {e.message}", e.ts)
                    if e.kind == "fault":
                        marks.faults.append((e.ts, e.message))
                    elif e.kind == "decision" and e.action in ("restart", "stop", "replace"):
                        marks.decisions.append((e.ts, e.action, e.generation))
                    elif e.kind == "barrier":
                        marks.barriers.append(e.ts)
            except grpc.RpcError:
                stop.wait(0.2)


def watch_rank(rank: int, log: Path, events: Path, clock: Clock, marks: Marks,
               stop: threading.Event) -> None:
    """Print a rank's first step after each start, and its detections."""
    seen_events = 0
    generation = -1
    log_pos = 0
    announced: set[int] = set()
    while not stop.is_set():
        if events.exists():
            lines = events.read_text(errors="replace").splitlines()
            for line in lines[seen_events:]:
                e = json.loads(line)
                if e["event"] == "state" and e["kind"] == "running":
                    generation = int(e["generation"])
                    log_pos = log.stat().st_size if log.exists() else 0  # new output only
                    clock.say(f"rank {rank}", f"trainer started (generation {generation}, "
                              f"pid {e.get('pid')})", e["ts"])
                elif e["event"] == "fault":
                    extra = ""
                    n = sum(1 for p in e.get("processes", []) if p.get("stack"))
                    if n:
                        extra = f" [stacks of {n} process(es) captured before acting]"
                    clock.say(f"rank {rank}", f"detected {e['kind']}: {e['message']}{extra}",
                              e["ts"])
            seen_events = len(lines)
        if log.exists() and generation >= 0 and generation not in announced:
            with log.open("rb") as f:
                f.seek(log_pos)
                data = f.read()
            if STEP_LINE.search(data):
                announced.add(generation)
                marks.resumed.setdefault(generation, {})[rank] = time.time()
                clock.say(f"rank {rank}", f"training: first step of generation {generation}")
            log_pos += len(data)
        stop.wait(0.05)


def summary(marks: Marks) -> None:
    """For each decision: from the fault it answered to the decision, the barrier, and the
    first step of every rank in the new generation."""
    print("\nsummary (seconds after the fault was received):", flush=True)
    print(f"  {'fault':<56} {'decision':<12} {'decided':>7} {'barrier':>7} {'training':>8}")
    for ts, action, gen in marks.decisions:
        fault = [f for f in marks.faults if f[0] <= ts]
        if not fault:
            continue
        fts, msg = fault[-1]
        bar = next((b for b in marks.barriers if b >= ts), None)
        ranks = marks.resumed.get(gen, {})
        res = max(ranks.values()) if ranks else None
        cells = [f"{ts - fts:7.2f}", f"{bar - fts:7.2f}" if bar else f"{'-':>7}",
                 f"{res - fts:8.2f}" if res else f"{'-':>8}"]
        print(f"  {msg[:56]:<56} {action:<12} " + " ".join(cells))
    print("  decided: the arbiter's command; barrier: every rank released to start;\n"
          "  training: every rank's first step again (includes PyTorch's ~4 s start-up)")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ftagent demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="ranks (agents) in the job")
    ap.add_argument("--steps", type=int, default=60, help="training steps per run")
    ap.add_argument("--step-time", type=float, default=0.1, help="seconds per step")
    ap.add_argument("--timeout", type=float, default=110.0, help="give up after this long")
    ap.add_argument("--script", default=str(find_script()), help="the training script")
    args = ap.parse_args(argv)
    if not Path(args.script).exists():
        sys.stderr.write(f"ftagent demo: error: {args.script} not found: run from a source "
                         "checkout or pass --script\n")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="ftagent-demo-"))
    clock, marks, stop = Clock(), Marks(), threading.Event()
    faulty = args.ranks - 1
    print(f"ftagent demo: {args.ranks} ranks of {args.script} (gloo, CPU), one agent each, "
          f"one arbiter.\nRank {faulty} crashes at step 15 of the first run and hangs before "
          f"an all-reduce at step 15 of the second.\nLogs: {workdir}\n", flush=True)
    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    codes: list[int | None] = []
    with ArbiterProcess("--max-restarts", "3", log_dir=str(workdir)) as arb:
        clock.say("arbiter", f"listening on {arb.address}")
        threads.append(threading.Thread(target=watch_arbiter, daemon=True,
                                        args=(arb.address, clock, marks, stop)))
        port = free_port()
        for r in range(args.ranks):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       TRAIN_STEPS=str(args.steps), TRAIN_STEP_SLEEP=str(args.step_time),
                       TRAIN_PG_TIMEOUT="300", FAULT_RANK=str(faulty),
                       FAULT_CRASH_AT_STEP="15", FAULT_CRASH_ATTEMPT="0",
                       FAULT_HANG_AT_STEP="15", FAULT_HANG_ATTEMPT="1")
            log, events = workdir / f"rank{r}.log", workdir / f"rank{r}.jsonl"
            cmd = [sys.executable, "-m", "ftagent", "run", "--arbiter", arb.address,
                   "--job", JOB, "--rank", str(r), "--world-size", str(args.ranks),
                   "--metrics-port", "-1", "--hang-timeout-min", "3", "--log-level", "warning",
                   "--events-file", str(events), "--", sys.executable, args.script]
            with log.open("wb") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            threads.append(threading.Thread(target=watch_rank, daemon=True,
                                            args=(r, log, events, clock, marks, stop)))
        for t in threads:
            t.start()
        deadline = time.monotonic() + args.timeout
        try:
            codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            clock.say("demo", f"did not finish within {args.timeout:.0f}s: stopping")
        except KeyboardInterrupt:
            clock.say("demo", "interrupted: stopping")
        finally:
            for p in procs:
                _stop(p)
            time.sleep(0.3)  # the last timeline entries
            stop.set()
    ok = len(codes) == len(procs) and all(c == 0 for c in codes)
    summary(marks)
    print(f"\nresult: {'job succeeded' if ok else f'job failed (exit codes {codes})'}; "
          f"logs and events in {workdir}", flush=True)
    return 0 if ok else 1


def _stop(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=35)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
