"""Pass-through cost: a trainer printing ~200 MB of log lines, directly vs under ftagent.

Prints the wall-time ratio (goal <= 1.25), the agent's CPU seconds per 100 MB and its
peak RSS (goal <= 60 MB). Both variants write into a pipe that this script drains, the
way a container runtime drains a pod's stdout. Runs are interleaved and the median kept.

Two logs, each timed against its own direct run in the same invocation: ``ordinary``
(NCCL-like chatter, one ``step=`` line in 50) and ``hostile`` (every line step-like for
some parser: Megatron ``iteration N/M |`` rows, HF dicts, tqdm ``\r`` bars, DeepSpeed,
torchtitan, Keras, MXNet, fleet, 8 KB lines of digits around every needle, with varied
numbers), which the agent must sample rather than let it slow the trainer.

    .venv/bin/python bench/passthrough.py [--mb 200] [--runs 3] [--logs ordinary,hostile]
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


# Every line is something some parser tries hard on, formatted as it is printed (a trainer
# formats its lines too), with numbers that vary from line to line.
HOSTILE = r"""
import random, sys
total = int(sys.argv[1]) * 1024 * 1024
rng = random.Random(7)
digits = ["".join(str(rng.randrange(10)) for _ in range(200)) for _ in range(16)]
longs = [("step " + d + " %| " + d + " iteration " + d + " loss " + d + " Epoch " + d) * 8
         + "\n" for d in digits]  # 8 KB: runs of digits around every needle
out = sys.stdout
n = s = 0
while n < total:
    s += 1
    a, b, c = s % 997, s % 89, s % 10
    chunk = (
        f"iteration {s:8d}/{s + 99999} | consumed samples: {s * 32} | elapsed time per "
        f"iteration (ms): {a}.{c} | learning rate: 1.0E-04 | global batch size: 32 | "
        f"lm loss: {c}.{a:06d}E+00 | loss scale: 1.0 |\n"
        f"{{'loss': {c}.{a}, 'grad_norm': {b}.{c}, 'learning_rate': 1e-05, 'epoch': "
        f"{b}.{a}, 'step': {s}}}\n"
        f" {a // 10 % 100:2d}%|{'#' * c:10s}| {a}/997 [00:{b % 60:02d}<00:{c:02d}, "
        f"{b}.{a}it/s, loss={c}.{a}]\r"
        f"step={s}, skipped={c}, lr=[0.0001], mom=[(0.9, 0.999)] global_step={s}, "
        f"RunningAvgSamplesPerSec={a}.{b}, CurrSamplesPerSec={a}.{c}\n"
        f"step: {s}  loss: {c}.{a}  memory: {b}.{c}GiB  tps: {s * 7:,}  step_time: {c}.{b}\n"
        f"{a % 500}/500 [=====>........] - ETA: {b}s - loss: {c}.{a} - accuracy: 0.{a} - "
        f"{a}ms/step\n"
        f"Epoch[{c}] Batch [{a}-{s}]\tSpeed: {s}.{b} samples/sec\taccuracy=0.{a} "
        f"cross-entropy={c}.{b}\n"
        f"epoch: {c}, batch_id: {a}, loss: {c}.{b}, speed: {b}.{c} steps/s Step {s} iter {s} "
        f"Epoch {c}/10\n"
        f"Step {s}/{s * 3} | loss: {c}.{a} | samples_per_second={a}.{b} tokens/s: {s * 5} "
        f"train_loss={c}.{b}\n"
        + (longs[s % 16] if s % 20 == 0 else "")
    )
    out.write(chunk)
    n += len(chunk)
out.flush()
"""
LOGS = {"ordinary": WRITER, "hostile": HOSTILE}


def drain(proc: subprocess.Popen[bytes]) -> int:
    assert proc.stdout is not None
    n = 0
    while True:
        chunk = proc.stdout.read1(1 << 16)  # type: ignore[attr-defined]
        if not chunk:
            return n
        n += len(chunk)


def direct(mb: int, writer: str = WRITER) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", writer, str(mb)], stdout=subprocess.PIPE)
    n = drain(proc)
    proc.wait()
    return time.perf_counter() - t0, n


def wrapped(mb: int, writer: str = WRITER) -> tuple[float, int, float, int]:
    """Wall seconds, bytes, agent CPU seconds, agent peak RSS bytes."""
    cmd = [sys.executable, "-m", "ftagent", "run", "--metrics-port=-1", "--log-level=error",
           "--", sys.executable, "-c", writer, str(mb)]
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


def bench(name: str, mb: int, runs: int) -> None:
    writer = LOGS[name]
    d_walls, w_walls, cpus, peaks = [], [], [], []
    for _ in range(runs):
        dw, dn = direct(mb, writer)
        ww, wn, cpu, peak = wrapped(mb, writer)
        assert dn == wn, f"byte counts differ: {dn} vs {wn}"
        d_walls.append(dw)
        w_walls.append(ww)
        cpus.append(cpu / (wn / (100 * 1024 * 1024)))
        peaks.append(peak)
    d, w = statistics.median(d_walls), statistics.median(w_walls)
    ratios = sorted(b / a for a, b in zip(d_walls, w_walls, strict=True))
    print(f"[{name}] log volume per run:  {dn / 1e6:.0f} MB ({runs} runs, medians)")
    print(f"[{name}] wall, direct:        {d:.2f} s")
    print(f"[{name}] wall, ftagent run:   {w:.2f} s")
    print(f"[{name}] wall-time ratio:     {w / d:.2f}  (goal <= 1.25; per run "
          f"{', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"[{name}] agent CPU / 100 MB:  {statistics.median(cpus):.2f} s")
    print(f"[{name}] agent peak RSS:      {max(peaks) / 1e6:.1f} MB  (goal <= 60 MB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--logs", default="ordinary,hostile",
                    help="comma-separated: " + ", ".join(LOGS))
    args = ap.parse_args()
    names = [n for n in args.logs.split(",") if n]
    for n in names:
        if n not in LOGS:
            ap.error(f"unknown log {n!r}; one of {', '.join(LOGS)}")
    print(f"command: {sys.executable} bench/passthrough.py --mb {args.mb} --runs {args.runs} "
          f"--logs {','.join(names)}")
    for n in names:
        bench(n, args.mb, args.runs)


if __name__ == "__main__":
    main()
