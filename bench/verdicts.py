"""A corpus of hangs and healthy look-alikes, and the verdicts' score (issue 35, item 6).

    .venv/bin/python bench/verdicts.py [--quick] [--only NAME,...] [--category WORD]
        [--list] [--json FILE] [--keep DIR]

Every scenario is a real job: one ``ftagent run`` per rank (default flags but
``--max-restarts 1 --restart-backoff 0 --nic lo``) under one real ``ftagent arbiter`` on
loopback, each rank training ``examples/train.py`` (its fault knobs) or
``bench/verdict_trainer.py`` (the faults train.py lacks: a dead mount in a first or later
save, a stuck evaluation, a stuck DataLoader worker, collective mismatches, an inner
process group, slow remote reads, GC pauses), with 0.2 s steps. The scenarios are data:
``SCENARIOS`` below, one row each (what runs, on which rank, what the verdict must be).

A **hang** row passes when the arbiter decides a restart (or stop) within its deadline and
names exactly its culprit ranks (the decision's ``culprits`` field; issue 35 item 7).
Detection latency: from the culprit's last step line (as this script read it; before the
first step, its trainer's "started" line) to the decision (the arbiter's timeline time;
one clock). A **healthy** row passes when the job
trains to its end with no restart; hang faults its agents recorded (any severity) are
counted too ("faults"), since a healthy job should raise none.

Per category, and overall: precision (hang decisions that were hangs), recall (hangs
decided in time), culprit accuracy (decided hangs whose culprits are exactly right),
detection p50/p99, false restarts on the healthy rows.

Rows marked ``stall`` depended on lane ``stall``'s agent work (issue 35 items 3-5: slow
reads, dead-still phases, frozen ranks); they pass since it was merged (the runs in
docs/hangs.md).
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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRAIN = str(ROOT / "examples" / "train.py")
FAULTS = str(ROOT / "bench" / "verdict_trainer.py")
STEP_SLEEP = 0.2
STEP = re.compile(r"\[rank(\d+)\] step=(\d+)/")
STARTED = re.compile(r"\[rank(\d+)\] started: ")
_prctl = ctypes.CDLL(None, use_errno=True).prctl


@dataclass(frozen=True)
class Scenario:
    name: str
    category: str  # what the summary groups by
    hang: bool  # a real hang: the arbiter must restart, naming ``culprits``
    culprits: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # the trainer's knobs
    script: str = TRAIN
    world: int = 2
    flags: tuple[str, ...] = ()  # extra agent flags
    action: str = ""  # the harness's part: sigstop (the culprit's trainer), freeze (the
    # culprit's agent and trainer), slow_server (a loopback store answering after 8 s)
    at_step: int = 10  # when the harness acts (the culprit's step line)
    deadline: float = 90.0  # hangs: seconds after the last step to decide in; healthy: run
    needs: str = ""  # "stall": expected to fail until lane stall's work is merged
    quick: bool = False  # in --quick's smaller set


def _t(**kw: str) -> dict[str, str]:
    return dict(kw)


HANG = _t(TRAIN_STEPS="100000")
SCENARIOS: list[Scenario] = [
    # ------------------------------------------------------------------ hangs
    Scenario("collective-r0", "hang: before a collective", True, (0,),
             _t(**HANG, FAULT_HANG_AT_STEP="10"), quick=True),
    Scenario("collective-r1", "hang: before a collective", True, (1,),
             _t(**HANG, FAULT_RANK="1", FAULT_HANG_AT_STEP="10"), quick=True),
    Scenario("collective-late", "hang: before a collective", True, (1,),
             _t(**HANG, FAULT_RANK="1", FAULT_HANG_AT_STEP="40")),
    Scenario("collective-4ranks", "hang: before a collective", True, (2,),
             _t(**HANG, FAULT_RANK="2", FAULT_HANG_AT_STEP="12"), world=4),
    Scenario("first-step", "hang: before the first step", True, (0,),
             _t(**HANG, FAULT_HANG_AT_STEP="1"), deadline=150.0, needs="stall"),
    Scenario("data-stall", "hang: data loading", True, (0,),
             _t(**HANG, FAULT_DATA_STALL_AT_STEP="10"), quick=True),
    Scenario("loader-worker", "hang: data loading", True, (0,),
             _t(**HANG, SCENARIO="loader_hang"), script=FAULTS),
    Scenario("deadlock", "hang: deadlock", True, (0,),
             _t(**HANG, FAULT_DEADLOCK_AT_STEP="10"), quick=True),
    Scenario("spin", "hang: spinning", True, (0,), _t(**HANG, FAULT_SPIN_AT_STEP="10")),
    Scenario("eval-stuck", "hang: evaluation", True, (0,),
             _t(**HANG, SCENARIO="eval_hang"), script=FAULTS),
    Scenario("save-first", "hang: first save", True, (0,),
             _t(**HANG, SCENARIO="save_hang_first"), script=FAULTS, needs="stall"),
    Scenario("save-later", "hang: later save", True, (0,),
             _t(**HANG, SCENARIO="save_hang_later", AT="20"), script=FAULTS, needs="stall"),
    Scenario("mismatch", "hang: collective mismatch", True, (0, 1),
             _t(**HANG, SCENARIO="mismatch"), script=FAULTS, quick=True),
    Scenario("inner-group", "hang: inner process group", True, (3,),
             _t(**HANG, SCENARIO="inner", FAULT_RANK="3"), script=FAULTS, world=4),
    Scenario("sigstop-trainer", "hang: frozen", True, (1,), HANG, action="sigstop",
             quick=True),
    Scenario("frozen-rank", "hang: frozen", True, (1,), HANG, action="freeze"),
    # the same hangs on another rank, at another step, in a larger job
    Scenario("collective-r0-4ranks", "hang: before a collective", True, (0,),
             _t(**HANG, FAULT_HANG_AT_STEP="25"), world=4),
    Scenario("data-stall-r1", "hang: data loading", True, (1,),
             _t(**HANG, FAULT_RANK="1", FAULT_DATA_STALL_AT_STEP="15")),
    Scenario("loader-worker-r1", "hang: data loading", True, (1,),
             _t(**HANG, SCENARIO="loader_hang", FAULT_RANK="1", AT="15"), script=FAULTS),
    Scenario("deadlock-r1", "hang: deadlock", True, (1,),
             _t(**HANG, FAULT_RANK="1", FAULT_DEADLOCK_AT_STEP="15")),
    Scenario("deadlock-4ranks", "hang: deadlock", True, (3,),
             _t(**HANG, FAULT_RANK="3", FAULT_DEADLOCK_AT_STEP="12"), world=4),
    Scenario("spin-r1", "hang: spinning", True, (1,),
             _t(**HANG, FAULT_RANK="1", FAULT_SPIN_AT_STEP="15")),
    Scenario("eval-stuck-r1", "hang: evaluation", True, (1,),
             _t(**HANG, SCENARIO="eval_hang", FAULT_RANK="1", AT="15"), script=FAULTS),
    Scenario("save-first-r1", "hang: first save", True, (1,),
             _t(**HANG, SCENARIO="save_hang_first", FAULT_RANK="1"), script=FAULTS,
             needs="stall"),
    Scenario("mismatch-late", "hang: collective mismatch", True, (0, 1),
             _t(**HANG, SCENARIO="mismatch", AT="30"), script=FAULTS),
    Scenario("inner-group-r0", "hang: inner process group", True, (0,),
             _t(**HANG, SCENARIO="inner", FAULT_RANK="0", AT="15"), script=FAULTS, world=4),
    Scenario("sigstop-trainer-r0", "hang: frozen", True, (0,), HANG, action="sigstop",
             at_step=15),
    Scenario("sigstop-trainer-4ranks", "hang: frozen", True, (2,), HANG, action="sigstop",
             world=4),
    Scenario("first-step-r1", "hang: before the first step", True, (1,),
             _t(**HANG, FAULT_RANK="1", FAULT_HANG_AT_STEP="1"), deadline=150.0,
             needs="stall"),
    Scenario("first-step-dead-mount", "hang: before the first step", True, (0,),
             _t(**HANG, SCENARIO="first_step_hang"), script=FAULTS, deadline=150.0,
             needs="stall"),
    # ------------------------------------------------------------------ healthy look-alikes
    Scenario("declared-saves", "healthy: long saves", False,
             env=_t(TRAIN_STEPS="70", CKPT_EVERY="20", CKPT_FACTOR="40"), quick=True),
    Scenario("silent-save", "healthy: long saves", False,
             env=_t(TRAIN_STEPS="45", SILENT_SAVES="30:20")),
    Scenario("eval-one-rank", "healthy: evaluations", False,
             env=_t(TRAIN_STEPS="70", EVAL_EVERY="30", EVAL_SECONDS="12", EVAL_RANK="0"),
             quick=True),
    Scenario("eval-all-ranks", "healthy: evaluations", False,
             env=_t(TRAIN_STEPS="70", EVAL_EVERY="30", EVAL_SECONDS="12")),
    Scenario("first-step-long", "healthy: slow start", False,
             env=_t(TRAIN_STEPS="30", FIRST_STEP_SECONDS="15")),
    Scenario("slow-rank", "healthy: slow ranks", False,
             env=_t(TRAIN_STEPS="40", FAULT_SLOW_FACTOR="5", FAULT_EVERY_ATTEMPT="1")),
    Scenario("gc-pause", "healthy: GC pauses", False,
             env=_t(TRAIN_STEPS="40", SCENARIO="gc_pause", AT="15"), script=FAULTS),
    Scenario("io-heavy-save", "healthy: I/O-heavy phases", False,
             env=_t(TRAIN_STEPS="45", SILENT_SAVES="20:15", SILENT_SAVE_MIBPS="64")),
    Scenario("declared-saves-4ranks", "healthy: long saves", False,
             env=_t(TRAIN_STEPS="50", CKPT_EVERY="20", CKPT_FACTOR="30"), world=4),
    Scenario("silent-save-40s", "healthy: long saves", False,
             env=_t(TRAIN_STEPS="40", SILENT_SAVES="30:40")),
    Scenario("silent-save-r1", "healthy: long saves", False,
             env=_t(TRAIN_STEPS="40", SILENT_SAVES="20:15", SILENT_SAVE_RANK="1")),
    Scenario("eval-one-rank-4ranks", "healthy: evaluations", False,
             env=_t(TRAIN_STEPS="50", EVAL_EVERY="30", EVAL_SECONDS="10", EVAL_RANK="3"),
             world=4),
    Scenario("slow-rank-r1", "healthy: slow ranks", False,
             env=_t(TRAIN_STEPS="40", FAULT_RANK="1", FAULT_SLOW_FACTOR="3",
                    FAULT_EVERY_ATTEMPT="1")),
    Scenario("gc-pause-r1", "healthy: GC pauses", False,
             env=_t(TRAIN_STEPS="40", SCENARIO="gc_pause", AT="15", FAULT_RANK="1",
                    GC_SECONDS="12"), script=FAULTS),
    Scenario("slow-read", "healthy: slow remote reads", False,
             env=_t(TRAIN_STEPS="45", SCENARIO="slow_read", READ_EVERY="15"), script=FAULTS,
             action="slow_server", needs="stall", quick=True),
    Scenario("slow-read-loader", "healthy: slow remote reads", False,
             env=_t(TRAIN_STEPS="45", SCENARIO="slow_read_loader", READ_EVERY="15"),
             script=FAULTS, action="slow_server", needs="stall"),
]


# --------------------------------------------------------------------------- processes


def _die_with_parent() -> None:  # between fork and exec
    _prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


@dataclass
class Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    events_file: Path
    steps: list[tuple[float, int]] = field(default_factory=list)  # (arrival, step)
    started: float | None = None  # arrival of the trainer's first "started:" line
    lines: list[str] = field(default_factory=list)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            text = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(text)
            m = STARTED.search(text)
            if m is not None and int(m.group(1)) == self.rank and self.started is None:
                self.started = time.time()
            for m in STEP.finditer(text):
                if int(m.group(1)) == self.rank:
                    self.steps.append((time.time(), int(m.group(2))))

    def events(self) -> list[dict[str, Any]]:
        with contextlib.suppress(OSError):
            return [json.loads(ln) for ln in self.events_file.read_text().splitlines()
                    if ln.strip()]
        return []

    def trainer_pid(self) -> int:
        running = [e for e in self.events() if e.get("event") == "state"
                   and e.get("kind") == "running"]
        return int(running[-1]["pid"]) if running else 0


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    for p in tree:  # a stopped process does not act on SIGTERM
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGCONT)
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlowStore:
    """A remote store on loopback that answers each request after ``delay`` seconds (an
    object store or NFS server stalling): not a peer of the job."""

    def __init__(self, delay: float = 8.0) -> None:
        self.delay = delay
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(64)
            time.sleep(self.delay)
            conn.sendall(b"x" * 65536)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


# --------------------------------------------------------------------------- one scenario


@dataclass
class Outcome:
    s: Scenario
    decided: str = ""  # restart | stop | replace | "" (none)
    named: tuple[int, ...] = ()
    latency: float | None = None
    faults: int = 0  # hang faults the agents recorded, any severity
    message: str = ""
    error: str = ""

    @property
    def detected(self) -> bool:
        return bool(self.decided)

    @property
    def culprit_ok(self) -> bool:
        return self.detected and self.named == tuple(sorted(self.s.culprits))

    @property
    def passed(self) -> bool:
        return self.culprit_ok if self.s.hang else not self.detected


def status(address: str, job: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "ftagent", "status", "--arbiter", address, job,
                        "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    return dict(json.loads(r.stdout)) if r.returncode == 0 else {"timeline": []}


def decisions(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in st.get("timeline", []) if e.get("kind") == "decision"
            and e.get("action") in ("restart", "stop", "replace")]


def poll(cond: Callable[[], Any], deadline: float, every: float = 0.5) -> Any:
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    return None


def keep_run(keep: Path, s: Scenario, ranks: list[Rank], address: str) -> None:
    """``--keep``: each rank's events file, its output lines with their arrival times and
    the arbiter's view of the job (its timeline), to read where a verdict's time went."""
    keep.mkdir(parents=True, exist_ok=True)
    for rk in ranks:
        with contextlib.suppress(OSError):
            (keep / f"{s.name}-{rk.rank}.events.jsonl").write_bytes(rk.events_file.read_bytes())
        (keep / f"{s.name}-{rk.rank}.steps.json").write_text(json.dumps(
            {"started": rk.started, "steps": rk.steps}))
        (keep / f"{s.name}-{rk.rank}.out").write_text("\n".join(rk.lines) + "\n")
    with contextlib.suppress(Exception):
        (keep / f"{s.name}.status.json").write_text(json.dumps(status(address, s.name),
                                                               indent=1))


def run_scenario(s: Scenario, address: str, tmp: Path, keep: Path | None = None) -> Outcome:
    job = s.name
    port = free_port()
    store = SlowStore() if s.action == "slow_server" else None
    ranks: list[Rank] = []
    out = Outcome(s)
    try:
        for r in range(s.world):
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("FAULT_", "CKPT_", "FTAGENT_", "EVAL_", "SILENT_"))}
            env.update(RANK=str(r), WORLD_SIZE=str(s.world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), TRAIN_STEP_SLEEP=str(STEP_SLEEP),
                       TRAIN_PG_TIMEOUT="300", PYTHONPATH=str(ROOT),
                       GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
            env.update(s.env)
            if store is not None:
                env["SLOW_SERVER"] = store.address
            ev = tmp / f"{job}-{r}.jsonl"
            cmd = [sys.executable, "-m", "ftagent", "run", "--arbiter", address, "--job", job,
                   "--rank", str(r), "--world-size", str(s.world), "--metrics-port=-1",
                   "--nic=lo", "--log-level=warning", f"--events-file={ev}",
                   "--max-restarts=1", "--restart-backoff=0", *s.flags,
                   "--", sys.executable, s.script]
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
            rk = Rank(r, proc, ev)
            ranks.append(rk)
            threading.Thread(target=rk.read, daemon=True).start()
        culprit = ranks[s.culprits[0]] if s.culprits else ranks[0]
        if s.action in ("sigstop", "freeze") and poll(
                lambda: any(st >= s.at_step for _, st in culprit.steps), time.time() + 180, 0.1):
            pids = [culprit.trainer_pid()] + ([culprit.proc.pid] if s.action == "freeze"
                                              else [])
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
        if s.hang:
            # the deadline counts from the culprit's last step line, once steps stop
            def decided() -> list[dict[str, Any]]:
                return decisions(status(address, job))

            start = time.time()
            got = None
            while time.time() < start + 240 + s.deadline:
                got = decided()
                last = max((t for rk in ranks for t, _ in rk.steps), default=start)
                if got or time.time() > last + s.deadline:
                    break
                time.sleep(0.5)
            if got:
                d = got[0]
                out.decided = str(d.get("action"))
                out.named = tuple(sorted(c["rank"] for c in d.get("culprits") or []))
                out.message = str(d.get("message", ""))
                before = [t for rk in ([culprit] if s.culprits and len(s.culprits) == 1
                                       else ranks) for t, _ in rk.steps if t < float(d["ts"])]
                if not before and culprit.started is not None:  # before the first step
                    before = [culprit.started]
                if before:
                    out.latency = float(d["ts"]) - max(before)
        else:
            deadline = time.time() + 240 + s.deadline
            poll(lambda: all(p.proc.poll() is not None for p in ranks)
                 or decisions(status(address, job)), deadline, 1.0)
            got = decisions(status(address, job))
            if got:
                out.decided = str(got[0].get("action"))
                out.named = tuple(sorted(c["rank"] for c in got[0].get("culprits") or []))
                out.message = str(got[0].get("message", ""))
            if not got and any(p.proc.poll() != 0 for p in ranks):
                out.error = "did not finish: " + "; ".join(
                    f"rank {p.rank} exit {p.proc.poll()}" for p in ranks)
    except Exception as e:  # one scenario's trouble is its row, not the run's end
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if keep is not None:
            with contextlib.suppress(Exception):
                keep_run(keep, s, ranks, address)
        for rk in ranks:
            stop(rk.proc)
        if store is not None:
            store.close()
    out.faults = sum(1 for rk in ranks for e in rk.events()
                     if e.get("event") == "fault" and e.get("kind") == "hang")
    return out


# --------------------------------------------------------------------------- the score


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(max(math.ceil(p / 100 * len(s)), 1), len(s)) - 1]


def score(rows: list[Outcome]) -> dict[str, Any]:
    hangs = [o for o in rows if o.s.hang]
    healthy = [o for o in rows if not o.s.hang]
    tp = [o for o in hangs if o.detected]
    fp = [o for o in healthy if o.detected]
    lat = [o.latency for o in tp if o.latency is not None]
    return {"scenarios": len(rows),
            "precision": len(tp) / (len(tp) + len(fp)) if tp or fp else None,
            "recall": len(tp) / len(hangs) if hangs else None,
            "culprit": sum(o.culprit_ok for o in tp) / len(tp) if tp else None,
            "p50": pct(lat, 50), "p99": pct(lat, 99),
            "false_restarts": len(fp), "healthy": len(healthy),
            "faults_on_healthy": sum(o.faults for o in healthy)}


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[Outcome]) -> str:
    out = ["| scenario | category | expected | decided | named | latency s | hang faults "
           "| result |", "|---|---|---|---|---|---|---|---|"]
    for o in rows:
        exp = f"restart, culprit {','.join(map(str, o.s.culprits))}" if o.s.hang else \
            "no restart"
        res = "pass" if o.passed else "FAIL" + (" (needs lane stall)" if o.s.needs else "")
        if o.error:
            res += f" ({o.error[:60]})"
        out.append(f"| {o.s.name} | {o.s.category} | {exp} | {o.decided or 'none'} | "
                   f"{','.join(map(str, o.named)) or '-'} | {_f(o.latency, '{:.1f}')} | "
                   f"{o.faults} | {res} |")
    out += ["", "| category | scenarios | precision | recall | culprit accuracy | "
            "detection p50 s | p99 s | false restarts |", "|---|---|---|---|---|---|---|---|"]
    cats = sorted({o.s.category for o in rows}) + ["all"]
    for c in cats:
        sc = score([o for o in rows if c == "all" or o.s.category == c])
        out.append(f"| {c} | {sc['scenarios']} | {_f(sc['precision'])} | {_f(sc['recall'])} | "
                   f"{_f(sc['culprit'])} | {_f(sc['p50'], '{:.1f}')} | "
                   f"{_f(sc['p99'], '{:.1f}')} | "
                   f"{sc['false_restarts']}/{sc['healthy']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the smaller set (a few minutes)")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--category", default="", help="scenarios whose category has this word")
    ap.add_argument("--list", action="store_true", help="print the table of scenarios")
    ap.add_argument("--json", default="", help="write the outcomes here too")
    ap.add_argument("--keep", default="", help="a directory: keep each rank's events file, "
                    "its output lines (with arrival times) and the arbiter's timeline there")
    args = ap.parse_args()
    chosen = [s for s in SCENARIOS if (not args.quick or s.quick)
              and (not args.only or s.name in args.only.split(","))
              and (not args.category or args.category in s.category)]
    if args.list:
        for s in chosen:
            print(f"{s.name:<20} {s.category:<30} {'hang' if s.hang else 'healthy':<8} "
                  f"{s.needs}")
        return 0
    from ftagent.arbiter.process import ArbiterProcess

    rows: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="verdicts-") as d:
        tmp = Path(d)
        with ArbiterProcess("--stacks-timeout", "10", log_dir=str(tmp)) as arb:
            for s in chosen:
                t0 = time.time()
                o = run_scenario(s, arb.address, tmp,
                                 Path(args.keep) if args.keep else None)
                rows.append(o)
                err = f" {o.error}" if o.error else ""
                print(f"{s.name:<20} {'pass' if o.passed else 'FAIL'}  decided={o.decided or '-'}"
                      f" named={list(o.named)} latency={_f(o.latency, '{:.1f}')}s "
                      f"faults={o.faults} ({time.time() - t0:.0f}s){err}", flush=True)
                if not o.passed and o.message:
                    print(f"    {o.message[:300]}", flush=True)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([{
            "name": o.s.name, "category": o.s.category, "hang": o.s.hang,
            "culprits": list(o.s.culprits), "decided": o.decided, "named": list(o.named),
            "latency": o.latency, "faults": o.faults, "passed": o.passed, "needs": o.s.needs,
            "error": o.error, "message": o.message} for o in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
