"""What preflight adds to a (re)start: the checks of agent/preflight.py on 8 simulated GPUs
(NVML's calls through ``--gpu-backend simulated:FILE``'s backend), no link watch, and a
storage probe in a temporary directory, with the warm-restart (fast) budgets.

    .venv/bin/python bench/preflight_cost.py [--runs 50] [--gpus 8]

Prints the median and the slowest of ``--runs`` preflights, and, as the peer measured in
the same run, the same checks' work done inline on the loop with no thread or budget
(what a preflight costs beyond the calls themselves). Noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def main() -> None:
    from ftagent.agent.preflight import Preflight, accelerator_probe, storage_probe
    from ftagent.config import GpuConfig
    from ftagent.sources import gpu_script
    from ftagent.sources.gpu import GpuSource
    from ftagent.sources.gpu_sim import SimulatedNvml

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="ftagent-preflight-")
    script = os.path.join(d, "gpus.txt")
    with open(script, "w") as f:
        f.write(f"gpus {args.gpus}\n")
    sim = SimulatedNvml(gpu_script.load(script))
    source = GpuSource(GpuConfig(gpu_backend=f"simulated:{script}"), {}, lambda: sim)

    class Part:
        name = "gpu"

        def __init__(self, src: GpuSource) -> None:
            self.source = src

    class Watch:
        parts = [Part(source)]

    async def run() -> tuple[list[float], list[float]]:
        await asyncio.get_running_loop().run_in_executor(None, source._start)
        source.ready.set()
        pre = Preflight(Watch(), d)
        with_pre, inline = [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            v = await pre.run(warm=True)
            with_pre.append(time.perf_counter() - t)
            assert v.ok, v.reason
            t = time.perf_counter()
            probe = accelerator_probe(source)
            assert probe is not None and probe() == ""
            assert storage_probe(d)() == ""
            inline.append(time.perf_counter() - t)
        return with_pre, inline

    try:
        with_pre, inline = asyncio.run(run())
    finally:
        source.stop()
    m, b = statistics.median(with_pre), statistics.median(inline)
    print(f"preflight, {args.gpus} simulated GPUs + storage, fast budgets, {args.runs} runs: "
          f"median {m * 1000:.2f} ms, slowest {max(with_pre) * 1000:.2f} ms")
    print(f"the same calls inline (peer): median {b * 1000:.2f} ms; ratio {m / b:.1f}x")


if __name__ == "__main__":
    main()
