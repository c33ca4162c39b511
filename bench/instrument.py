"""Cost of ftagent.torch.instrument(): step time of a real 2-rank gloo DDP job with it on
vs off, and the busbw it reports vs the value computed by hand from the same timings.

    .venv/bin/python bench/instrument.py [--steps 500] [--rounds 4]

Each rank runs alternating blocks of ``--steps`` steps, instrumented and not (hooks
installed and removed: ``Instrumentation.close``; DDP's comm hook cannot be removed, so
the "off" blocks run a separate DDP model without one), ``--rounds`` times each, so load
on the machine hits both alike. The ratio is the median step time on / off. The SDK
socket is a real unix datagram socket read by the bench (what the agent would receive);
busbw is then computed by the agent's formula from what was reported, and by hand from
the trainer's own timings of the same all-reduces (perf_counter around each call).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK = textwrap.dedent("""
    import json, os, statistics, sys, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ftagent.torch as ft
    steps, rounds = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    def make():
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                   torch.nn.Linear(512, 256))
    plain, timed = DDP(make()), DDP(make())
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, timed)}
    x = torch.randn(32, 256)
    def block(model, n):
        opt, out = opts[id(model)], []
        for _ in range(n):
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(time.perf_counter() - t0)
        return out
    block(plain, 50)
    on, off = [], []
    for r in range(rounds):
        dist.barrier()
        off += block(plain, steps)
        dist.barrier()
        inst = ft.instrument(model=timed, optimizer=opts[id(timed)])
        on += block(timed, steps)
        inst.close()
    # busbw: 200 all-reduces of 4 MiB, instrumented, timed by hand around each call too
    inst = ft.instrument()
    y, hand = torch.ones(1 << 20), 0.0
    for _ in range(200):
        t0 = time.perf_counter()
        dist.all_reduce(y)
        hand += time.perf_counter() - t0
    inst.close()
    print(json.dumps({"on": statistics.median(on), "off": statistics.median(off),
                      "on_mean": statistics.fmean(on), "off_mean": statistics.fmean(off),
                      "hand_seconds": hand, "hand_bytes": 200 * (4 << 20)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500, help="steps per block (STEPS)")
    ap.add_argument("--rounds", type=int, default=4, help="on/off blocks each (N)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ftagent.sources.sdk_socket import busbw, check_datagram
    from tests.conftest import free_port

    tmp = tempfile.mkdtemp(prefix="bench-instrument-")
    port, world = free_port(), 2
    socks, procs = [], []
    for rank in range(world):
        path = os.path.join(tmp, f"sdk{rank}.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind(path)
        s.setblocking(False)
        socks.append(s)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "FTAGENT_SDK_SOCKET": path, "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, str(args.steps),
                                       str(args.rounds)], env=env, stdout=subprocess.PIPE))
    received: list[list[object]] = [[] for _ in range(world)]
    import select

    while any(p.poll() is None for p in procs):  # drain while the ranks run
        ready, _, _ = select.select(socks, [], [], 0.2)
        for s in ready:
            while True:
                try:
                    data = s.recv(1024)
                except BlockingIOError:
                    break
                received[socks.index(s)].append(check_datagram(data, 0.0))
    for i, s in enumerate(socks):
        while True:
            try:
                received[i].append(check_datagram(s.recv(1024), 0.0))
            except BlockingIOError:
                break
    results = [json.loads(p.stdout.read().decode().strip().splitlines()[-1])  # type: ignore[union-attr]
               for p in procs]
    r0 = results[0]
    ratio = r0["on"] / r0["off"]
    mean_ratio = r0["on_mean"] / r0["off_mean"]
    ar = [o for o in received[0] if getattr(o, "op", "") == "all_reduce"]
    nbytes = sum(o.nbytes for o in ar)  # type: ignore[attr-defined]
    seconds = sum(o.seconds for o in ar)  # type: ignore[attr-defined]
    _, reported = busbw("all_reduce", nbytes, seconds, world)
    by_hand = r0["hand_bytes"] / r0["hand_seconds"] * 2 * (world - 1) / world
    ddp = [o for o in received[0] if getattr(o, "op", "") == "all_reduce_ddp"]
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}")
    print(f"2-rank gloo DDP (MLP 256-512-256, batch 32), {args.rounds} x {args.steps} steps "
          "on and off, alternating")
    print(f"  step time off {r0['off'] * 1e3:.3f} ms, on {r0['on'] * 1e3:.3f} ms (medians): "
          f"ratio {ratio:.3f} (goal <= 1.02); means: {mean_ratio:.3f}")
    print(f"  datagrams received by rank 0's socket: {len(received[0])} "
          f"({sum(getattr(o, 'count', 1) for o in ddp)} DDP buckets reported)")
    print(f"  all_reduce 4 MiB x 200: busbw reported {reported / 1e9:.3f} GB/s, by hand "
          f"{by_hand / 1e9:.3f} GB/s: {reported / by_hand:.3f} (goal within 20 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
