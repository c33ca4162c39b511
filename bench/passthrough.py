"""Pass-through cost: a trainer printing ~200 MB of log lines, directly vs under ftagent.

Prints the wall-time ratio (goal <= 1.25), the agent's CPU seconds per 100 MB and its
peak RSS (goal <= 60 MB). Both variants write into a pipe that this script drains, the
way a container runtime drains a pod's stdout. Runs are interleaved and the median kept.

    .venv/bin/python bench/passthrough.py [--mb 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import psutil

WRITER = r"""
import sys
total = int(sys.argv[1]) * 1024 * 1024
out = sys.stdout
line = "[2026-11-30 12:00:00,123] INFO dataloader: shard 00017 prefetched 4096 samples in 12.3 ms\n"
n = 0
step = 0
while n < total:
    for _ in range(49):
        out.write(line)
    step += 1
    p = f"step={step} loss={1.0 / step:.4f} samples_per_second=1234.5\n"
    out.write(p)
    n += 49 * len(line) + len(p)
out.flush()
"""


def drain(proc: subprocess.Popen[bytes]) -> int:
    assert proc.stdout is not None
    n = 0
    while True:
        chunk = proc.stdout.read1(1 << 16)  # type: ignore[attr-defined]
        if not chunk:
            return n
        n += len(chunk)


def direct(mb: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(mb)], stdout=subprocess.PIPE)
    n = drain(proc)
    proc.wait()
    return time.perf_counter() - t0, n


def wrapped(mb: int) -> tuple[float, int, float, int]:
    """Wall seconds, bytes, agent CPU seconds, agent peak RSS bytes."""
    cmd = [sys.executable, "-m", "ftagent", "run", "--metrics-port=-1", "--log-level=warning",
           "--", sys.executable, "-c", WRITER, str(mb)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    agent = psutil.Process(proc.pid)
    peak = 0
    import threading

    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for ln in f:
                        if ln.startswith("VmHWM:"):
                            peak = max(peak, int(ln.split()[1]) * 1024)
            except OSError:
                return
            stop.wait(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    n = drain(proc)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    wall = time.perf_counter() - t0
    cpu = agent.cpu_times()
    stop.set()
    t.join()
    proc.wait()
    return wall, n, cpu.user + cpu.system, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    d_walls, w_walls, cpus, peaks = [], [], [], []
    for _ in range(args.runs):
        dw, dn = direct(args.mb)
        ww, wn, cpu, peak = wrapped(args.mb)
        assert dn == wn, f"byte counts differ: {dn} vs {wn}"
        d_walls.append(dw)
        w_walls.append(ww)
        cpus.append(cpu / (wn / (100 * 1024 * 1024)))
        peaks.append(peak)
    d, w = statistics.median(d_walls), statistics.median(w_walls)
    print(f"command: {sys.executable} bench/passthrough.py --mb {args.mb} --runs {args.runs}")
    print(f"log volume per run:           {dn / 1e6:.0f} MB ({args.runs} runs, medians)")
    print(f"wall, direct into a pipe:     {d:.2f} s")
    print(f"wall, under ftagent run:      {w:.2f} s")
    print(f"wall-time ratio:              {w / d:.2f}  (goal <= 1.25)")
    print(f"agent CPU per 100 MB:         {statistics.median(cpus):.2f} s")
    print(f"agent peak RSS:               {max(peaks) / 1e6:.1f} MB  (goal <= 60 MB)")


if __name__ == "__main__":
    main()
