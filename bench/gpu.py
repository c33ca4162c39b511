"""GPU path figures with the simulated NVML (``--gpu-backend simulated:FILE``).

Three measurements, each printed with what it ran:

1. ``latency``: a real ``ftagent arbiter`` and a real ``ftagent run --arbiter ...
   --gpu-backend simulated:FILE -- sleep`` agent; the timeline injects ``--xids``
   restart-class Xids (distinct (GPU, Xid) pairs, so each is a fault) ``--spacing`` apart.
   Per fault: from the moment the source got the event from ``nvmlEventSetWait_v2`` (the
   fault's ``first_seen_wall``) to the arbiter's receipt (the ``ts`` of its timeline entry,
   matched by fault id). One machine, one wall clock.
2. ``poll``: the GPU source on 8 simulated GPUs in this process, polling every
   ``--poll-interval`` (5 s, the default) for ``--poll-seconds``: the process' CPU time over
   that span (event thread waits, polls, the loop) against the same span idle, as a share
   of one core; plus one poll's and one scrape's CPU time. The simulated calls are Python,
   real NVML calls are C behind ctypes, so on a GPU the calls themselves cost less.
3. ``flood``: a real agent reading ``--flood`` identical ``NVRM: Xid ... 95`` lines from a
   FIFO (``--kmsg``; ``--gpu-xid-action 95=restart`` so that the agent, deciding alone,
   does not exit on the first): the faults raised, ``ftagent_gpu_xid_errors_total`` at the end, the
   agent's RSS growth (VmHWM, the peak, after - before) and CPU time.

``.venv/bin/python bench/gpu.py`` runs all three; ``--only latency|poll|flood`` one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftagent.arbiter.process import ArbiterProcess  # noqa: E402

PY = sys.executable
RESTART_XIDS = (13, 31, 43, 45, 68, 94, 8, 32, 69)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


def agent_cmd(tmp: Path, *flags: str) -> list[str]:
    return [PY, "-m", "ftagent", "run", "--events-file", str(tmp / "events.jsonl"),
            "--progress", "none", "--log-level", "warning", *flags, "--", "sleep", "600"]


def events(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


# --------------------------------------------------------------------------- 1. latency


def latency(n: int, spacing: float) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ftagent-bench-gpu-"))
    pairs = [(g, x) for x in RESTART_XIDS for g in range(8)][:n]
    timeline = tmp / "gpus.txt"
    timeline.write_text("gpus 8\n" + "".join(
        f"t={2 + i * spacing:.3f}s gpu={g} xid={x} via=nvml\n" for i, (g, x) in enumerate(pairs)))
    with ArbiterProcess(log_dir=str(tmp)) as arb:
        proc = spawn(agent_cmd(tmp, "--arbiter", arb.address, "--job", "bench-gpu",
                               "--max-restarts", "100000", "--restart-backoff", "0",
                               "--metrics-port", "-1", "--gpu-backend", f"simulated:{timeline}"),
                     tmp / "agent.log")
        try:
            def faults() -> list[dict[str, Any]]:
                return [e for e in events(tmp) if e["event"] == "fault" and e["kind"] == "gpu"]

            wait(lambda: len(faults()) >= n, 30 + n * spacing, f"{n} GPU faults at the agent")
            st: dict[str, Any] = {}

            def received() -> bool:
                nonlocal st
                r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", arb.address,
                                    "bench-gpu", "--json", "--timeline", "0"],
                                   capture_output=True, text=True, timeout=30)
                st = json.loads(r.stdout) if r.returncode == 0 else {}
                return len([e for e in st.get("timeline", []) if e["kind"] == "fault"]) >= n

            wait(received, 30, "every fault at the arbiter")
        finally:
            stop(proc)
    at_arbiter = {e.get("faultId", e.get("fault_id")): e["ts"]
                  for e in st["timeline"] if e["kind"] == "fault"}
    lat = []
    for f in faults():
        ts = at_arbiter.get(f["fault_id"])
        if ts is not None:
            lat.append((ts - f["first_seen_wall"]) * 1000)
    raised = [(f["ts"] - f["first_seen_wall"]) * 1000 for f in faults()]
    print(f"latency: {len(lat)} Xids (8 simulated GPUs, one every {spacing}s), event -> "
          f"GPU fault at the arbiter: p50 {statistics.median(lat):.1f} ms, p99 "
          f"{pct(lat, 99):.1f} ms, max {max(lat):.1f} ms (goal p99 <= 50 ms); event -> fault "
          f"in the agent's events file: p50 {statistics.median(raised):.1f} ms, p99 "
          f"{pct(raised, 99):.1f} ms")


# --------------------------------------------------------------------------- 2. poll cost


def poll_cost(seconds: float, interval: float) -> None:
    from ftagent.config import GpuConfig
    from ftagent.sources.gpu import GpuSource, open_backend

    tmp = Path(tempfile.mkdtemp(prefix="ftagent-bench-gpu-"))
    (tmp / "gpus.txt").write_text("gpus 8\n")
    cfg = GpuConfig(gpu_backend=f"simulated:{tmp / 'gpus.txt'}", gpu_poll_interval=interval,
                    kmsg="none")
    factory, feed = open_backend(cfg)
    source = GpuSource(cfg, {}, factory, feed)

    async def idle() -> float:
        c0 = time.process_time()
        await asyncio.sleep(seconds)
        return time.process_time() - c0

    per_poll = [0.0]

    async def watched() -> tuple[float, float, float]:
        task = asyncio.create_task(source.run(lambda obs: None))
        while not source.ready.is_set():
            await asyncio.sleep(0.01)
        c0 = time.process_time()
        await asyncio.sleep(seconds)
        used = time.process_time() - c0
        sim: Any = factory() if factory else None
        calls0 = sim.calls
        p0 = time.process_time()
        for _ in range(20):
            source.poll()
        one_poll = (time.process_time() - p0) / 20
        per_poll[0] = (sim.calls - calls0) / 20
        s0 = time.process_time()
        for _ in range(20):
            source.readings()
        one_scrape = (time.process_time() - s0) / 20
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return used, one_poll, one_scrape

    base = asyncio.run(idle())
    used, one_poll, one_scrape = asyncio.run(watched())
    share = max(0.0, used - base) / seconds * 100
    print(f"poll: 8 simulated GPUs, poll every {interval:g}s for {seconds:g}s: "
          f"{share:.3f} % of a core (goal <= 0.5 %); one poll {one_poll * 1000:.2f} ms CPU, "
          f"one scrape of all GPU readings {one_scrape * 1000:.2f} ms CPU; "
          f"{per_poll[0]:.0f} NVML calls per poll")


# --------------------------------------------------------------------------- 3. flood


def _status(pid: int, key: str) -> int:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith(key + ":"):
            return int(ln.split()[1]) * 1024
    return 0


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _xid_total(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("ftagent_gpu_xid_errors_total{") and 'xid="95"' in ln)


def flood(lines: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ftagent-bench-gpu-"))
    (tmp / "gpus.txt").write_text("gpus 1\n")
    fifo = tmp / "kmsg"
    os.mkfifo(fifo)
    proc = spawn(agent_cmd(tmp, "--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                           "--gpu-backend", f"simulated:{tmp / 'gpus.txt'}", "--kmsg", str(fifo),
                           "--gpu-xid-action", "95=restart"),  # alone, REPLACE would exit
                 tmp / "agent.log")
    try:
        port = wait(lambda: next((e["metrics_port"] for e in events(tmp)
                                  if e.get("metrics_port")), None), 30, "the metrics port")
        _xid_total(port)  # warm the scrape path up before the baseline
        time.sleep(2)
        rss0, hwm0, cpu0 = _status(proc.pid, "VmRSS"), _status(proc.pid, "VmHWM"), _cpu(proc.pid)
        line = (b"[ 5000.123456] NVRM: Xid (PCI:0000:18:00): 95, pid=2130, name=python3, "
                b"Uncontained: FBHUB. RST: Yes, D-RST: No\n")
        t0 = time.monotonic()

        def write() -> None:
            fd = os.open(fifo, os.O_WRONLY)
            chunk = line * 10_000
            for _ in range(lines // 10_000):
                os.write(fd, chunk)
            os.write(fd, line * (lines % 10_000))
            os.close(fd)

        writer = threading.Thread(target=write)
        writer.start()
        wait(lambda: _xid_total(port) >= lines, 600, f"{lines} Xids counted")
        took = time.monotonic() - t0
        writer.join()
        total = _xid_total(port)
        rss1, hwm1, cpu1 = _status(proc.pid, "VmRSS"), _status(proc.pid, "VmHWM"), _cpu(proc.pid)
        faults = [e for e in events(tmp) if e["event"] == "fault" and e["kind"] == "gpu"]
    finally:
        stop(proc)
    mib = 1 << 20
    print(f"flood: {lines:,} identical kernel-log Xid 95 lines through a FIFO: {len(faults)} "
          f"fault(s), ftagent_gpu_xid_errors_total {total:,.0f} (exact: "
          f"{total == lines}); agent RSS {rss0 / mib:.1f} -> {rss1 / mib:.1f} MiB, peak "
          f"(VmHWM) growth {(hwm1 - hwm0) / mib:.2f} MiB (goal <= 5 MB); agent CPU "
          f"{cpu1 - cpu0:.2f} s for the flood ({(cpu1 - cpu0) / lines * 1e6:.2f} us/line), "
          f"all counted {took:.1f} s after the first line")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("latency", "poll", "flood"))
    ap.add_argument("--xids", type=int, default=50)
    ap.add_argument("--spacing", type=float, default=0.25)
    ap.add_argument("--poll-seconds", type=float, default=60.0)
    ap.add_argument("--poll-interval", type=float, default=5.0)
    ap.add_argument("--flood", type=int, default=1_000_000)
    args = ap.parse_args()
    print("command:", " ".join([".venv/bin/python", "bench/gpu.py", *sys.argv[1:]]))
    if args.only in (None, "latency"):
        latency(args.xids, args.spacing)
    if args.only in (None, "poll"):
        poll_cost(args.poll_seconds, args.poll_interval)
    if args.only in (None, "flood"):
        flood(args.flood)


if __name__ == "__main__":
    main()
