"""A hostile SDK: 1,000,000 datagrams into a real agent's SDK socket, against a quiet run.

Starts the real ``python -m ftagent run --metrics-port 0 --progress sdk ... -- TRAINER``
twice in the same run: once with a quiet trainer (a few hundred valid steps), once with a
trainer that floods the socket the agent hands it (``FTAGENT_SDK_SOCKET``). The flood
mixes what an attacker or a buggy trainer sends: unique phase and op names (what
``ftagent.phase(f"ckpt-{step}")`` sends, some of it through the SDK itself), huge and
negative numbers, NaN and inf, unknown versions, malformed fields, names that are not
UTF-8 or too long, oversize datagrams. Raw datagrams use a blocking socket and the SDK's
socket is made blocking, so every datagram arrives (none is dropped by the kernel) and
the agent's counters can be waited on exactly.

Prints, for both runs and as flood/quiet ratios: the agent's peak RSS (VmHWM), the size
and series count of /metrics, the median scrape time, and the flood's drops by reason
and folded label values. Goals: agent RSS <= 60 MB, /metrics <= 1 MB.

    .venv/bin/python bench/sdk_flood.py [--datagrams 1000000] [--seed 1]

``--trainer N`` is the flooding trainer itself (run by the agent; the tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 1024 * 1024

# --------------------------------------------------------------------------- the trainer side


def hostile(rng: random.Random, pid: int) -> Iterator[bytes]:
    """An endless mix of datagrams a receiver must survive (a few are valid)."""
    big = [b"9" * 19, b"9" * 25, b"9" * 400, b"%d" % (2**53), b"%d" % (2**63), b"-1", b"+5",
           b"1_000", b"0x10", b"\xd9\xa3"]  # last: an Arabic-Indic digit, not ASCII
    floats = [b"nan", b"inf", b"-inf", b"1e308", b"1e999", b"-0.0", b"0.5", b"1" * 40, b"x"]
    pre = b"v1 %d " % pid
    i = 0
    while True:
        i += 1
        r = rng.random()
        if r < 0.25:  # a unique phase per "step", as ftagent.phase(f"ckpt-{step}") sends
            yield pre + b"p ckpt-%d %d" % (i, i & 1)
        elif r < 0.45:  # a unique collective op
            yield pre + b"c op-%x %d %r %d" % (rng.getrandbits(48), rng.getrandbits(30),
                                               rng.random(), rng.randint(1, 1024))
        elif r < 0.55:  # steps: valid, huge, negative, NaN losses
            yield pre + b"s %s %s %s %s" % (rng.choice(big + [b"%d" % i]), rng.choice(floats),
                                            rng.choice(big + [b"-"]), rng.choice(big + [b"-"]))
        elif r < 0.62:  # collectives with out-of-range numbers
            yield pre + b"c all_reduce %s %s %s" % (rng.choice(big), rng.choice(floats),
                                                    rng.choice(big + [b"0", b"2"]))
        elif r < 0.70:  # bad names: too long, not UTF-8, control characters, empty
            name = rng.choice([b"n" * rng.randint(65, 300), bytes(rng.getrandbits(8)
                               for _ in range(rng.randint(1, 40))), b"a\x01b", b"\x7f", b""])
            yield pre + b"p %s 1" % name
        elif r < 0.78:  # unknown versions and random bytes
            yield rng.choice([b"v2 %d s 1 - - -" % pid, b"", b"\x00" * 8,
                              rng.randbytes(rng.randint(1, 200))])
        elif r < 0.88:  # the wrong shape
            yield rng.choice([pre + b"s 1", pre + b"s 1 - - - -", pre + b"p x 2",
                              pre + b"q 1 2 3", b"v1 x s 1 - - -", b"v1 0 s 1 - - -",
                              pre + b"c op 1 2", pre + b"s  1 - -"])
        elif r < 0.90:  # oversize, up to 64 KiB
            yield pre + b"p " + b"x" * rng.randint(600, 65000) + b" 1"
        else:  # random phase/op names with a random pid
            yield b"v1 %d p %s %d" % (rng.randint(1, 2**22), rng.randbytes(8).hex().encode(),
                                      rng.getrandbits(1))


def flood(n: int, seed: int) -> None:
    """The flooding trainer: ``n`` raw datagrams plus SDK calls, then it waits. Writes
    ``{"raw": n, "sdk": k}`` to $FLOOD_DONE when all were sent."""
    import ftagent
    from ftagent import sdk

    path = os.environ[sdk.ENV]
    rng = random.Random(seed)
    sdk_calls = 0
    assert sdk._client.ready() and sdk._client.sock is not None
    sdk._client.sock.setblocking(True)  # the bench wants every datagram delivered
    for i in range(min(n // 40, 25_000)):  # the attacker's 25,000 phases, via the SDK
        with ftagent.phase(f"ckpt-{i}"):
            pass
        ftagent.collective(f"sdk-op-{i}", 1 << 20, 0.001, 8)
        ftagent.step(i, loss=float("nan") if i % 7 == 0 else 1.0 / (i + 1), samples=8)
        sdk_calls += 4
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.connect(path)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # room for 64 KiB ones
    sent = 0
    for data in hostile(rng, os.getpid()):
        if sent >= n:
            break
        raw.send(data)
        sent += 1
    tmp = os.environ["FLOOD_DONE"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"raw": sent, "sdk": sdk_calls}, f)
    os.replace(tmp, os.environ["FLOOD_DONE"])
    while True:
        time.sleep(60)


QUIET = r"""
import json, os, time, ftagent
for i in range(300):
    ftagent.step(i, loss=1.0 / (i + 1), samples=8, tokens=1024)
    if i % 100 == 99:
        with ftagent.phase("checkpoint"):
            pass
    ftagent.collective("all_reduce", 8 << 20, 0.01, 8)
    time.sleep(0.001)
with open(os.environ["FLOOD_DONE"], "w") as f:
    json.dump({"raw": 0, "sdk": 0}, f)
while True:
    time.sleep(60)
"""

# --------------------------------------------------------------------------- the agent side


def scrape(port: int) -> tuple[bytes, float]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as r:
        body = r.read()
    return body, time.perf_counter() - t0


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one series family's samples."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            out[head[len(name):]] = float(value)
    return out


def label(key: str, name: str) -> str:
    return key.split(f'{name}="', 1)[1].split('"', 1)[0] if f'{name}="' in key else ""


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for ln in f:
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1]) * 1024
    return 0


T = TypeVar("T")


def wait(pred: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Result:
    sent: int  # datagrams the trainer sent (0: not counted, the quiet run)
    received: float  # read by the agent (its ftagent_sdk_datagrams_received_total)
    seconds: float  # agent start → every datagram read
    rss: int  # the agent's peak RSS (VmHWM), bytes
    metrics_bytes: int
    series: int  # sample lines in /metrics
    scrape_s: float  # median of 5 scrapes
    dropped: dict[str, float] = field(default_factory=dict)
    folded: dict[str, float] = field(default_factory=dict)
    phases: int = 0  # distinct phase label values exported
    ops: int = 0


def run_agent(trainer: list[str], workdir: Path, timeout: float = 1800) -> Result:
    """Run one agent with ``trainer``; measure once every datagram has been read."""
    events, done = workdir / "events.jsonl", workdir / "done.json"
    cmd = [sys.executable, "-m", "ftagent", "run", "--metrics-port", "0",
           "--metrics-addr", "127.0.0.1", "--progress", "sdk", "--hang-action", "alert",
           "--hang-timeout-min", "3600", "--log-level", "error", "--events-file", str(events),
           "--", *trainer]
    env = dict(os.environ, FLOOD_DONE=str(done), PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    agent = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        def port() -> int | None:
            for line in events.read_text().splitlines() if events.exists() else []:
                e = json.loads(line)
                if e.get("kind") == "metrics":
                    return int(e["metrics_port"])
            return None

        p = wait(port, 60, "the metrics port")
        sent: dict[str, int] = wait(lambda: json.loads(done.read_text()) if done.exists()
                                    else None, timeout, "the trainer to send everything")
        expected = sent["raw"] + sent["sdk"]

        def received() -> float:
            return sum(samples(scrape(p)[0].decode(), "ftagent_sdk_datagrams_received_total")
                       .values())

        # the quiet trainer's SDK calls are non-blocking: it may drop a few, so no target
        if expected:
            wait(lambda: received() >= expected, timeout, f"the agent to read {expected:,}")
        elapsed = time.perf_counter() - t0
        times, body = [], b""
        for _ in range(5):
            body, t = scrape(p)
            times.append(t)
        text = body.decode()
        lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
        return Result(
            sent=expected, received=received(), seconds=elapsed, rss=vm_hwm(agent.pid),
            metrics_bytes=len(body), series=len(lines), scrape_s=statistics.median(times),
            dropped={label(k, "reason"): v for k, v in
                     samples(text, "ftagent_sdk_datagrams_dropped_total").items()},
            folded={label(k, "label"): v for k, v in
                    samples(text, "ftagent_label_values_folded_total").items()},
            phases=len({label(k, "phase") for k in
                        samples(text, "ftagent_phase_duration_seconds_count")}),
            ops=len({label(k, "op") for k in
                     samples(text, "ftagent_collective_duration_seconds_count")}))
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datagrams", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trainer", type=int, metavar="N", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer is not None:
        flood(args.trainer, args.seed)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "q").mkdir()
        (Path(tmp) / "f").mkdir()
        quiet = run_agent([sys.executable, "-c", QUIET], Path(tmp) / "q")
        hostile_ = run_agent([sys.executable, str(Path(__file__).resolve()), "--trainer",
                              str(args.datagrams), "--seed", str(args.seed)], Path(tmp) / "f")
    print(f"{'':28} {'quiet':>12} {'flood':>12} {'ratio':>8}")
    for name, q, f in (("agent peak RSS (MB)", quiet.rss / MB, hostile_.rss / MB),
                       ("/metrics (KB)", quiet.metrics_bytes / 1024,
                        hostile_.metrics_bytes / 1024),
                       ("/metrics samples", quiet.series, hostile_.series),
                       ("scrape, median of 5 (ms)", quiet.scrape_s * 1e3, hostile_.scrape_s * 1e3)):
        print(f"{name:28} {q:12.1f} {f:12.1f} {f / q if q else float('nan'):8.2f}")
    print(f"flood: {hostile_.sent:,} datagrams sent, {hostile_.received:,.0f} read by "
          f"the agent in {hostile_.seconds:.1f} s")
    print("dropped by reason:", {k: int(v) for k, v in hostile_.dropped.items()})
    print("label values folded:", {k: int(v) for k, v in hostile_.folded.items()},
          f"phase values exported {hostile_.phases}, op values {hostile_.ops}")
    ok = hostile_.rss <= 60 * MB and hostile_.metrics_bytes <= MB
    print("goals (agent RSS <= 60 MB, /metrics <= 1 MB):", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
