"""What one ``ftagent.step()`` costs the trainer: median and p99 µs per call.

Three cases: no agent (``FTAGENT_SDK_SOCKET`` unset: the call is a no-op), an agent
listening (a separate process runs the real ``SdkSocketSource`` and counts what arrives),
and an agent that went away (the variable is set, the socket is gone). Each call is timed
on its own with ``perf_counter_ns``; the timer's own cost (measured the same way around
nothing) is subtracted. The target is a median of at most 5 µs.

    python bench/hang_sdk.py [--calls N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftagent import sdk  # noqa: E402

RECEIVER = """
import asyncio, signal, sys
from ftagent.sources.sdk_socket import SdkSocketSource
count = 0
def emit(obs):
    global count
    count += 1
async def main():
    src = SdkSocketSource(sys.argv[1])
    src.bind()
    print("ready", flush=True)
    task = asyncio.create_task(src.run(emit))
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, sys.stdin.readline):  # a line: say the count
        print(count, flush=True)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
asyncio.run(main())
"""


def per_call_ns(fn: Callable[[], None], calls: int) -> list[int]:
    clock = time.perf_counter_ns
    out = [0] * calls
    for i in range(calls):
        t0 = clock()
        fn()
        out[i] = clock() - t0
    return out


def count(rx: subprocess.Popen[str]) -> int:
    """The receiver's count once it has drained its queue."""
    assert rx.stdin is not None and rx.stdout is not None
    last = -1
    while True:
        time.sleep(0.2)
        rx.stdin.write("\n")
        rx.stdin.flush()
        now = int(rx.stdout.readline())
        if now == last:
            return now
        last = now


def report(name: str, samples: list[int], overhead: float) -> float:
    s = sorted(samples)
    med = (statistics.median(s) - overhead) / 1000
    p99 = (s[int(0.99 * (len(s) - 1))] - overhead) / 1000
    print(f"  {name:34s} median {med:6.2f} µs   p99 {p99:6.2f} µs")
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    n = args.calls
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"python {sys.version.split()[0]}, {n} calls per case, per-call timing")
    overhead = statistics.median(per_call_ns(lambda: None, n))
    print(f"  timer + call overhead subtracted: {overhead:.0f} ns")
    state = {"i": 0}

    def call() -> None:
        state["i"] += 1
        sdk.step(state["i"], loss=0.4213, samples=32)

    os.environ.pop(sdk.ENV, None)
    sdk.reconnect()
    report("no agent (variable unset)", per_call_ns(call, n), overhead)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sdk.sock")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        rx = subprocess.Popen([sys.executable, "-c", textwrap.dedent(RECEIVER), path], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        os.environ[sdk.ENV] = path
        sdk.reconnect()
        state["i"] = 0
        med = report("agent listening (SdkSocketSource)", per_call_ns(call, n), overhead)
        flood = count(rx)
        paced = 5000  # at 5,000 steps/s: faster than any real trainer steps
        t = time.perf_counter()
        for _ in range(paced):
            t += 1 / 5000
            while time.perf_counter() < t:
                pass
            call()
        delivered = count(rx) - flood
        rx.communicate("", timeout=60)
        print(f"    delivered: {flood}/{n} of the back-to-back calls (a full queue drops, "
              f"never blocks); {delivered}/{paced} at 5,000 calls/s")
        os.unlink(path) if os.path.exists(path) else None
        sdk.reconnect()
        report("agent gone (socket missing)", per_call_ns(call, n), overhead)
    print(f"target: median <= 5 µs with an agent listening: {'ok' if med <= 5 else 'MISSED'}")
    return 0 if med <= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
