"""Hang false positives from quiet, busy ranks: silent saves doing I/O under the arbiter.

Real 2-rank PyTorch DDP jobs (``examples/train.py``, gloo on CPU, 0.2 s steps), one
``ftagent run`` per rank with **default hang flags** under a real arbiter
(``ftagent arbiter`` on loopback). In each job rank 0 saves a checkpoint that prints
nothing (``SILENT_SAVES``: ``torch.save`` of 4 MiB tensors, fsynced, at ~8 MiB/s of real
storage writes) while rank 1 waits for it in the next all-reduce:

* a **40 s silent checkpoint** (after step 30);
* a **150 s silent save** (after step 30), longer than the 120 s default spin budget.

Neither is a hang. Counted from the agents' events files and the arbiter's timeline:
**false restarts** (restart actions) and **error-level hang faults** (``fault`` lines of
kind hang, severity error); both must be 0. Printed too: how each rank's agent judged the
stall (its ``verify`` verdicts in order: rank 0 alive by its I/O; rank 1 a WARNING
suspicion, then "waiting" on rank 0 once the arbiter answered BUSY), the ``peer`` lines
("waiting on rank 0 (busy in ...)") and the arbiter's decisions.

    .venv/bin/python bench/hang_quiet.py [--quick]

``--quick`` scales the saves down to 12 s and 30 s (with --hang-spin-timeout 10, so the
longer save still outlasts the spin budget). ``bench/hang.py`` runs ``run()`` as well.
Gloo runs over loopback (``GLOO_SOCKET_IFNAME=lo``), so the agents watch only ``lo``: on a
shared host, links other work creates and deletes are NIC faults (a restart once "back")
that are not this benchmark's subject. Every process runs in its own session with
PR_SET_PDEATHSIG; all are stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")
STEP_SLEEP = 0.2
SAVE_AFTER = 30
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:  # between fork and exec
    _prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def run_job(name: str, save_seconds: float, tmp: Path, flags: list[str]) -> dict[str, Any]:
    """One 2-rank job with a silent save of ``save_seconds`` on rank 0; what was recorded."""
    from ftagent.arbiter.process import ArbiterProcess

    steps = SAVE_AFTER + 20
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    started = time.time()
    with ArbiterProcess(log_dir=str(tmp)) as arb:
        try:
            for rank in range(2):
                env = {k: v for k, v in os.environ.items()
                       if not k.startswith(("FAULT_", "CKPT_", "EVAL_", "FTAGENT_"))}
                env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), TRAIN_STEP_SLEEP=str(STEP_SLEEP),
                           TRAIN_STEPS=str(steps), TRAIN_PG_TIMEOUT="600",
                           SILENT_SAVES=f"{SAVE_AFTER}:{save_seconds:g}",
                           SILENT_SAVE_DIR=str(tmp), PYTHONPATH=str(ROOT),
                           # gloo over loopback, and the agents watch only that link: other
                           # work on a shared host creates and deletes links (netns tests),
                           # NIC faults that are not this benchmark's subject
                           GLOO_SOCKET_IFNAME="lo")
                cmd = [sys.executable, "-m", "ftagent", "run", "--metrics-port=-1",
                       "--log-level=warning", "--arbiter", arb.address, "--job", name,
                       f"--events-file={tmp / f'{name}-{rank}.jsonl'}", *flags,
                       "--", sys.executable, TRAIN]
                out = open(tmp / f"{name}-{rank}.out", "wb")  # noqa: SIM115
                procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out,
                                              stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL,
                                              start_new_session=True,
                                              preexec_fn=_die_with_parent))
            deadline = time.time() + 120 + 3 * (steps * STEP_SLEEP + save_seconds)
            while time.time() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.5)
            codes = [p.poll() for p in procs]
        finally:
            for p in procs:
                _stop(p)
        timeline = _timeline(arb.address, name)
    ev = {r: _events(tmp / f"{name}-{r}.jsonl") for r in range(2)}
    return {"name": name, "save_seconds": save_seconds, "codes": codes,
            "seconds": time.time() - started, "events": ev, "timeline": timeline}


def _timeline(address: str, job: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "ftagent", "status", job, "--json",
                          "--arbiter", address], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    try:
        return list(json.loads(out.stdout).get("timeline") or [])
    except ValueError:
        return []


def judged(events: list[dict[str, Any]]) -> list[str]:
    """How an agent judged its stalls: verify verdicts (+ why, short) and peer lines."""
    out = []
    for e in events:
        if e["event"] == "verify":
            why = e.get("message", "")
            short = "by I/O" if "storage I/O advancing" in why else ""
            out.append(f"{e['kind']}{' ' + short if short else ''} at "
                       f"{e.get('stall_seconds', 0):.0f}s")
        elif e["event"] == "peer":
            out.append(f"peer {e['kind']}: {e['message'][:90]}")
        elif e["event"] == "fault" and e["kind"] == "hang":
            out.append(f"HANG FAULT ({e.get('severity')}): {e['message'][:90]}")
    return out


def tally(res: dict[str, Any]) -> dict[str, int]:
    ev = res["events"]
    restarts = sum(1 for r in ev for e in ev[r] if e["event"] == "action"
                   and e["kind"] == "restart")
    errors = sum(1 for r in ev for e in ev[r] if e["event"] == "fault" and e["kind"] == "hang"
                 and e.get("severity") in ("error", "fatal"))
    suspicions = sum(1 for r in ev for e in ev[r] if e["event"] == "fault"
                     and e["kind"] == "hang" and e.get("severity") == "warning")
    busy = sum(1 for e in res["timeline"] if e.get("action") == "busy")
    return {"false_restarts": restarts, "error_hang_faults": errors,
            "suspicions": suspicions, "busy_verdicts": busy}


def run(tmp: Path, quick: bool = False) -> list[dict[str, Any]]:
    """Both jobs; each result with its tally (``bench/hang.py`` prints ``report``)."""
    saves = [("checkpoint-40s", 12.0 if quick else 40.0),
             ("save-150s", 30.0 if quick else 150.0)]
    flags = ["--hang-spin-timeout=10"] if quick else []
    out = []
    for name, seconds in saves:
        res = run_job(name, seconds, tmp, flags)
        res["tally"] = tally(res)
        out.append(res)
    return out


def report(results: list[dict[str, Any]]) -> str:
    lines = ["hang false positives: silent saves doing I/O on rank 0, rank 1 waiting "
             "(2-rank gloo DDP, 0.2 s steps, default flags, arbiter)"]
    total = {"false_restarts": 0, "error_hang_faults": 0}
    for res in results:
        t = res["tally"]
        for k in total:
            total[k] += t[k]
        lines.append(f"  {res['name']}: save {res['save_seconds']:.0f}s, exit codes "
                     f"{res['codes']}, {res['seconds']:.0f}s wall: false restarts "
                     f"{t['false_restarts']}, error-level hang faults "
                     f"{t['error_hang_faults']}, suspicions (warning) {t['suspicions']}, "
                     f"arbiter busy verdicts {t['busy_verdicts']}")
        for r in (0, 1):
            lines.append(f"    rank {r}: " + ("; ".join(judged(res["events"][r]))
                                             or "no stall verified"))
        decisions = [e.get("message", "")[:120] for e in res["timeline"]
                     if e.get("kind") == "decision"]
        for d in decisions:
            lines.append(f"    arbiter: {d}")
    lines.append(f"  total: false restarts {total['false_restarts']}, error-level hang "
                 f"faults {total['error_hang_faults']} (must be 0 and 0)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="12 s and 30 s saves")
    ap.add_argument("--keep", action="store_true", help="keep the events files")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ftagent-hang-quiet-"))
    results = run(tmp, args.quick)
    print(report(results))
    if args.keep:
        print(f"  (events files in {tmp})")
    bad = sum(r["tally"]["false_restarts"] + r["tally"]["error_hang_faults"] for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
