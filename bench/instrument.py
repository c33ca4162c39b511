"""Cost of ftagent.torch.instrument(): step time of real 2-rank gloo DDP jobs with it on
vs off, and the busbw it reports vs the value computed by hand from the same timings.

    .venv/bin/python bench/instrument.py [--block 5] [--pairs 20] [--rounds 10] [--model both]

Two jobs: ``small`` (the issue's MLP 256-512-256, batch 32: a few ms a step) and
``large`` (MLP 1024-1024-1024, batch 64: tens of ms). On the *same* DDP model, blocks of
``--block`` steps with instrument() (model + optimizer hooks, collectives patched, DDP's
buckets timed; ``Instrumentation.close`` removes it all) and without alternate in ABBA
order, so a change in the machine's load (other jobs on a shared machine) hits both
alike; ``--pairs`` pairs make a round. Per round: the median step time on / off;
overall: the median of all on steps / all off steps (and of the training thread's CPU
time per step, less exposed to the load). A third figure is instrument()'s own CPU cost
per step, measured where load can only add to it: one process (world size 1), the least
CPU time per step over alternating blocks on and off, divided by the 2-rank step. The
SDK socket is a real unix datagram socket read by the bench (what the agent would
receive): the DDP bucket counts reported are checked against the steps run, and busbw
is computed by the agent's formula from what was reported and by hand from the
trainer's own timings of the same all-reduces (perf_counter around each call).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

RANK = textwrap.dedent("""
    import json, os, statistics, sys, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ftagent.torch as ft
    block_steps, settle, pairs, rounds, width, hidden, batch = (int(a) for a in sys.argv[1:8])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, width)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, width)
    def block(n, wall, cpu):
        for _ in range(n):
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    block(20, [], [])  # warm-up (DDP rebuilds its buckets after the first step)
    # per round: on and off steps; blocks of a few steps alternate in ABBA order, so a
    # change in the machine's load hits both alike
    on, off, cpu_on, cpu_off = [], [], [], []
    for r in range(rounds):
        on.append([]), off.append([])
        for p in range(pairs):
            for timed in ((False, True) if p % 2 == 0 else (True, False)):
                dist.barrier()
                if timed:  # the first steps after a switch settle, untimed, in both
                    inst = ft.instrument(model=model, optimizer=opt)
                    block(settle, [], [])
                    block(block_steps, on[-1], cpu_on)
                    inst.close()
                else:
                    block(settle, [], [])
                    block(block_steps, off[-1], cpu_off)
    buckets = [int(b) for b in (model._get_ddp_logging_data().get("rebuilt_bucket_sizes")
                                or model._get_ddp_logging_data()["bucket_sizes"]).split(",")]
    # busbw: 200 all-reduces of 4 MiB, instrumented, timed by hand around each call too
    inst = ft.instrument()
    y, hand = torch.ones(1 << 20), 0.0
    for _ in range(200):
        t0 = time.perf_counter()
        dist.all_reduce(y)
        hand += time.perf_counter() - t0
    inst.close()
    print(json.dumps({"on": on, "off": off, "buckets": buckets,
                      "cpu_on": statistics.median(cpu_on), "cpu_off": statistics.median(cpu_off),
                      "hand_seconds": hand, "hand_bytes": 200 * (4 << 20)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")

MICRO = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ftagent.torch as ft
    width, hidden, batch, rounds = (int(a) for a in sys.argv[1:5])
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, width)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, width)
    def block(n):
        c0 = time.thread_time()
        for _ in range(n):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.thread_time() - c0) / n
    block(20)
    best = {"off": 1.0, "on": 1.0}
    for r in range(rounds):
        for timed in ((False, True) if r % 2 == 0 else (True, False)):
            if timed:
                inst = ft.instrument(model=model, optimizer=opt)
                block(2)
                best["on"] = min(best["on"], block(20))
                inst.close()
            else:
                block(2)
                best["off"] = min(best["off"], block(20))
    print(json.dumps(best), flush=True)
    dist.destroy_process_group()
""")


def micro(model: str, rounds: int) -> dict[str, float]:
    """instrument()'s own CPU cost per step, robust to the machine's load: one process,
    world size 1 (no peer to wait for), the least training-thread CPU time per step over
    ``rounds`` alternating blocks of 20 steps on and off (load only ever adds time)."""
    from tests.conftest import free_port

    path = os.path.join(tempfile.mkdtemp(prefix="bench-instrument-"), "sdk.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)  # unread: the SDK drops what does not fit, as with a busy agent
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "FTAGENT_SDK_SOCKET": path, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", MICRO, *map(str, MODELS[model]), str(rounds)],
                         env=env, capture_output=True, check=True, timeout=600)
    s.close()
    result: dict[str, float] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


# name -> (width, hidden, batch): the tiny job (~4 ms a step here) and a larger one
MODELS = {"small": (256, 512, 32), "large": (1024, 1024, 64)}


def run(model: str, block: int, settle: int, pairs: int, rounds: int) -> dict[str, Any]:
    """One 2-rank gloo job: rank 0's step times and what its SDK socket received."""
    from ftagent.sources.sdk_socket import check_datagram
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
        procs.append(subprocess.Popen(
            [sys.executable, "-c", RANK, str(block), str(settle), str(pairs), str(rounds),
             *map(str, MODELS[model])],
            env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
    received: list[object] = []
    out = b""
    stdout = procs[0].stdout
    assert stdout is not None
    rfd = stdout.fileno()
    while any(p.poll() is None for p in procs):  # drain while the ranks run
        ready, _, _ = select.select([*(s.fileno() for s in socks), rfd], [], [], 0.2)
        if rfd in ready:
            out += os.read(rfd, 1 << 20)
        for i, s in enumerate(socks):
            while s.fileno() in ready:
                try:
                    data = s.recv(1024)
                except BlockingIOError:
                    break
                if i == 0:
                    received.append(check_datagram(data, 0.0))
    out += stdout.read()
    for s in socks[:1]:
        while True:
            try:
                received.append(check_datagram(s.recv(1024), 0.0))
            except BlockingIOError:
                break
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    result["received"] = received
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block", type=int, default=5,
                    help="steps per block: blocks on and off alternate (STEPS)")
    ap.add_argument("--settle", type=int, default=2,
                    help="untimed steps after each switch, on and off alike (STEPS)")
    ap.add_argument("--pairs", type=int, default=20, help="on/off block pairs a round (N)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds, a ratio each (N)")
    ap.add_argument("--large-pairs", type=int, default=10,
                    help="on/off block pairs a round for the large model (N)")
    ap.add_argument("--micro-rounds", type=int, default=30,
                    help="alternating blocks of the world-size-1 CPU-cost measurement (N)")
    ap.add_argument("--model", choices=[*MODELS, "both"], default="both",
                    help="which job: small, large or both")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ftagent.metrics import busbw

    world = 2
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, python {platform.python_version()}")
    print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}")
    for name in (MODELS if args.model == "both" else [args.model]):
        pairs = args.pairs if name == "small" else args.large_pairs
        r = run(name, args.block, args.settle, pairs, args.rounds)
        width, hidden, batch = MODELS[name]
        steps = args.block * pairs
        print(f"{name}: 2-rank gloo DDP (MLP {width}-{hidden}-{width}, batch {batch}, "
              f"buckets {r['buckets']} bytes); {args.rounds} rounds of {steps} steps on and "
              f"{steps} off, in blocks of {args.block} (after {args.settle} untimed) in ABBA order")
        per = []
        for i, (on, off) in enumerate(zip(r["on"], r["off"], strict=True)):
            ratio = statistics.median(on) / statistics.median(off)
            per.append(ratio)
            print(f"  round {i + 1:2d}: median off {statistics.median(off) * 1e3:7.3f} ms, "
                  f"on {statistics.median(on) * 1e3:7.3f} ms, ratio {ratio:.3f}")
        on_all = [t for b in r["on"] for t in b]
        off_all = [t for b in r["off"] for t in b]
        overall = statistics.median(on_all) / statistics.median(off_all)
        mean_ratio = statistics.fmean(on_all) / statistics.fmean(off_all)
        verdict = "meets" if overall <= 1.02 else "misses"
        print(f"  overall ({len(on_all)} steps each): median off "
              f"{statistics.median(off_all) * 1e3:.3f} ms, on {statistics.median(on_all) * 1e3:.3f}"
              f" ms: ratio {overall:.3f} ({verdict} the goal <= 1.02); median of the round "
              f"ratios {statistics.median(per):.3f}; means {mean_ratio:.3f}")
        print(f"  training thread's CPU time per step (thread_time, medians: what instrument() "
              f"adds, less exposed to the machine's load): off {r['cpu_off'] * 1e6:.0f} us, on "
              f"{r['cpu_on'] * 1e6:.0f} us: +{(r['cpu_on'] - r['cpu_off']) * 1e6:.0f} us, "
              f"{(r['cpu_on'] - r['cpu_off']) / statistics.median(off_all) * 100:.2f} % of "
              "the median step")
        m = micro(name, args.micro_rounds)
        added = m["on"] - m["off"]
        print(f"  instrument()'s own CPU per step (1 process, world size 1, least of "
              f"{args.micro_rounds} blocks): off {m['off'] * 1e6:.0f} us, on "
              f"{m['on'] * 1e6:.0f} us: +{added * 1e6:.1f} us = "
              f"{added / statistics.median(off_all) * 100:.2f} % of the 2-rank median step: "
              f"ratio {1 + added / statistics.median(off_all):.3f} from the cost alone")
        rec = r["received"]
        ddp = [o for o in rec if getattr(o, "op", "") == "all_reduce_ddp"]
        n_ddp = sum(getattr(o, "count", 0) for o in ddp)
        ran_on = (args.block + args.settle) * pairs * args.rounds  # settling steps included
        print(f"  rank 0's socket: {len(rec)} datagrams; DDP bucket all-reduces reported "
              f"{n_ddp} of {ran_on * len(r['buckets'])} run instrumented (counts exact, "
              f"timing sampled 1 in 10 steps by DDP)")
        ar = [o for o in rec if getattr(o, "op", "") == "all_reduce"]
        nbytes = sum(o.nbytes for o in ar)
        seconds = sum(o.seconds for o in ar)
        _, reported = busbw("all_reduce", nbytes, seconds, world)
        by_hand = r["hand_bytes"] / r["hand_seconds"] * 2 * (world - 1) / world
        print(f"  all_reduce 4 MiB x 200: busbw reported {reported / 1e9:.3f} GB/s, by hand "
              f"{by_hand / 1e9:.3f} GB/s: {reported / by_hand:.3f} (goal within 20 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
