"""How long after a link goes down does ``ftagent node`` raise its NIC fault (beyond the grace)?

Builds the node agent as ``ftagent node`` does (``cmd/node.py``: ``--nic-netns A --nic eth0
--nic-grace G --gpu-backend none``), runs it on this process's event loop, and sets
``eth0`` down and up ``--outages`` times with ``ip`` (as root), each after a random
0..0.3 s pause so the outages fall at every phase of the agent's timers. Measured per
outage, from just before the ``ip link set down`` command is started (an upper bound: it
includes spawning ``ip``) to the node agent's ``on_fault``, minus the grace.

Compare trees with ``PYTHONPATH``: ``git archive OLD | tar -x -C DIR`` and run this file
with ``PYTHONPATH=DIR`` from DIR (the node agent of that tree is measured).

    sudo .venv/bin/python bench/node_nic.py --outages 40 --grace 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import time

from ftagent.cmd.node import build, parse
from ftagent.model import Fault

NS_A, NS_B = "ftbench_node_a", "ftbench_node_b"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def setup() -> None:
    teardown()
    for ns in (NS_A, NS_B):
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", "eth0", "netns", NS_A, "type", "veth", "peer", "name", "peer0",
       "netns", NS_B)
    sh("ip", "-n", NS_A, "link", "set", "eth0", "up")
    sh("ip", "-n", NS_B, "link", "set", "peer0", "up")


def teardown() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL, check=False)


async def ip_link(state: str) -> None:
    proc = await asyncio.create_subprocess_exec("ip", "-n", NS_A, "link", "set", "eth0", state)
    await proc.wait()


async def measure(outages: int, grace: float) -> list[float]:
    s = parse(["--node", "bench", "--nic-netns", NS_A, "--nic", "eth0", "--nic-grace",
               str(grace), "--gpu-backend", "none", "--metrics-port", "-1"], {})
    agent, _ = build(s, {})
    faults: asyncio.Queue[float] = asyncio.Queue()
    sink = agent.on_fault

    def on_fault(f: Fault) -> None:
        faults.put_nowait(time.monotonic())
        sink(f)

    agent.on_fault = on_fault  # type: ignore[method-assign]
    watch = getattr(agent, "watch", None)  # this tree's watch loop took the bound method
    if watch is not None:
        watch.on_fault = on_fault
    task = asyncio.create_task(agent.run())
    nic = agent.nic
    assert nic is not None
    await asyncio.wait_for(nic.source.ready.wait(), 10)
    out: list[float] = []
    try:
        for _ in range(outages):
            await asyncio.sleep(random.uniform(0, 0.3))  # a random phase of the timers
            t0 = time.monotonic()
            await ip_link("down")
            out.append((await asyncio.wait_for(faults.get(), 10) - t0 - grace) * 1000)
            await ip_link("up")
            await asyncio.wait_for(faults.get(), 10)  # the recovery
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outages", type=int, default=40)
    ap.add_argument("--grace", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    random.seed(args.seed)
    setup()
    try:
        ms = sorted(asyncio.run(measure(args.outages, args.grace)))
    finally:
        teardown()
    print(f"ftagent node: NIC fault beyond the {args.grace:g} s grace over {len(ms)} outages: "
          f"p50 {statistics.median(ms):.1f} ms, p90 {ms[int(len(ms) * 0.9) - 1]:.1f} ms, "
          f"max {ms[-1]:.1f} ms")


if __name__ == "__main__":
    main()
