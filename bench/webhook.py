"""Webhook latency per AdmissionReview at 200 concurrent requests, and the bundle's size
and start-up time against a virtualenv's.

    .venv/bin/python bench/webhook.py [--connections 200] [--rounds 10] [--workers 1,2]

The webhook runs as its own process (``ftagent webhook --self-signed``); the client is
one asyncio process holding ``--connections`` keep-alive TLS connections (as the API
server reuses its connections) and sending real AdmissionReviews of the examples' pods,
every connection one request at a time, all at once: each round is a burst of
``--connections`` concurrent requests. Both share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "packaging"))

from tests.webhook_pods import admission_review, example_pods  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
              request: bytes) -> float:
    t0 = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    body = await reader.readexactly(length)
    took = time.perf_counter() - t0
    assert b'"allowed":true' in body, body[:200]
    return took


async def burst(port: int, ctx: ssl.SSLContext, connections: int, rounds: int
                ) -> list[float]:
    pods = [p.pod for p in example_pods()]
    bodies = [json.dumps(admission_review(pods[i % len(pods)])).encode()
              for i in range(connections)]
    requests = [b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b) for b in bodies]
    conns = [await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                           server_hostname="localhost")
             for _ in range(connections)]
    for (r, w), req in zip(conns, requests, strict=True):  # warm: one request each
        await one(r, w, req)
    lat: list[float] = []
    for _ in range(rounds):
        lat += await asyncio.gather(*(one(r, w, req) for (r, w), req in
                                      zip(conns, requests, strict=True)))
    for _, w in conns:
        w.close()
    return lat


def cpu_seconds(pid: int) -> float:
    """CPU of the webhook and its worker processes (utime + stime)."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children()]
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def webhook_bench(connections: int, rounds: int, workers: int = 1) -> None:
    tmp = Path(tempfile.mkdtemp())
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftagent", "webhook", "--self-signed", "--ca-bundle-out",
         str(tmp / "ca.pem"), "--listen", "127.0.0.1:0", "--arbiter", "arbiter:9400",
         "--log-level", "warning", "--workers", str(workers)], stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ))
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        port = int(line.split()[2].rsplit(":", 1)[1])
        ctx = ssl.create_default_context(cafile=str(tmp / "ca.pem"))
        time.sleep(0.5) if workers > 1 else None  # workers up
        cpu0 = cpu_seconds(proc.pid)
        t0 = time.perf_counter()
        lat = asyncio.run(burst(port, ctx, connections, rounds))
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(proc.pid) - cpu0
        n = len(lat) + connections
        print(f"webhook --workers {workers}: {connections} concurrent keep-alive TLS "
              f"connections, {rounds} bursts "
              f"of {connections} AdmissionReviews ({len(lat)} timed)")
        print(f"  latency p50 {pct(lat, 50) * 1e3:.1f} ms  p99 {pct(lat, 99) * 1e3:.1f} ms  "
              f"max {max(lat) * 1e3:.1f} ms (goal: p99 <= 20 ms)")
        print(f"  throughput {n / wall:.0f} reviews/s; webhook CPU {cpu / n * 1e6:.0f} us "
              "per review")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def start_time(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([*argv, "run", "--metrics-port", "-1", "--", "true"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/tmp")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def entry_time(dist: Path, runs: int) -> float:
    """``sh ftagent-entry -- true`` as the injected container runs it (the same agent
    flags as ``start_time``'s, through their variables)."""
    env = {**os.environ, "FTAGENT_METRICS_PORT": "-1"}
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(["/bin/sh", str(dist / "ftagent-entry"), "--", "true"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/tmp",
                       env=env)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bundle_bench(runs: int) -> None:
    import build_bundle

    dist = build_bundle.build()
    size = sum(f.stat().st_size for f in dist.rglob("*") if f.is_file())
    spy = (dist / "py-spy").stat().st_size if (dist / "py-spy").exists() else 0
    print(f"bundle: {size / 2**20:.0f} MiB on disk ({(size - spy) / 2**20:.0f} MiB without "
          f"py-spy), {sum(1 for _ in dist.rglob('*'))} files")
    venv = ROOT / ".venv" / "bin" / "ftagent"
    b = start_time([str(dist / "ftagent")], runs)
    v = start_time([str(venv)], runs)
    print(f"  `ftagent run -- true`, median of {runs}: bundle {b * 1e3:.0f} ms, "
          f"virtualenv {v * 1e3:.0f} ms ({b / v:.2f}x)")
    # the injected entry: the shim probes `ftagent --version` before `ftagent run`
    s = entry_time(dist, runs)
    print(f"  through the entry shim (sh ftagent-entry -- ...): {s * 1e3:.0f} ms "
          f"({s / b:.2f}x the bundle alone: the probe costs {(s - b) * 1e3:.0f} ms)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--workers", default="1,2", help="webhook --workers values, alternated")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each --workers value")
    ap.add_argument("--runs", type=int, default=10, help="start-up runs of each agent")
    args = ap.parse_args()
    for _ in range(args.repeat):
        for workers in (int(w) for w in args.workers.split(",")):
            webhook_bench(args.connections, args.rounds, workers)
    bundle_bench(args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
