"""A job hang's probe at 16,384 ranks: the arbiter's cost per message, before and after.

    .venv/bin/python bench/probe_scale.py [--levels 1024,4096,16384]
        [--before /work/main] [--after .] [--timed] [--replicas] [--gc]

Each tree (``--before``, ``--after``: a checkout of this repository) runs in its own
child process with that tree first on ``sys.path``, so one run compares two versions of
the arbiter on the same machine at the same load (the ratios are what to read: the
machine may be shared). In each child, per level N, simulated ranks speak to a real
``Registry`` (the object the gRPC server hands every message to; no gRPC, as
``bench/verdict_scale.py`` drives it): N Hellos, N barrier arrivals (the release), one
progress summary per rank (every rank's last step 30 s ago), a rank's HANG suspicion
(DUMP_STACKS to every rank), then every rank's answer in a random order (py-spy text,
the agent's verdict of life, the flight recorder's summary: ``verdict_scale.answer``),
each handed to ``Registry.handle`` as serialized protobuf.

Per message kind: the total of the arbiter's time for all N and the worst single
message. For the answers, the last one (it decides the probe: every rank's stacks and
flight recorder compared, the RESTART fanned out to every rank) is shown apart from the
others: ``answers s`` and ``worst ms`` are the N-1 answers that only add a rank's stacks
(each should cost the same whatever N is), ``decide ms`` the last one. The verdict is
checked (RESTART naming the simulated culprit).

``--timed``: then one summary per rank with step timings, as an instrumented trainer's
(waits in collectives and for data: the straggler share the ledger takes from each).
``--replicas``: the agents hold snapshot replicas (``Hello.replica_port``), and after the
probe every pod comes back with a new address and its agent says Hello again
(``rehello``: each Hello moves one rank in the arbiter's ring of replica holders).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def child(tree: str, levels: list[int], seed: int, keep_gc: bool, timed_steps: bool,
          replicas: bool) -> None:
    """Run every level with ``tree``'s ftagent; print one JSON line per level."""
    sys.path.insert(0, os.path.abspath(tree))
    import ftagent

    where = os.path.dirname(os.path.dirname(os.path.abspath(ftagent.__file__)))
    for n in levels:
        out = level(n, seed, keep_gc, timed_steps, replicas)
        out["tree"] = where
        print(json.dumps(out), flush=True)
    others = sorted({os.path.dirname(os.path.dirname(os.path.abspath(m.__file__)))
                     for k, m in sys.modules.items() if k == "ftagent" and m.__file__})
    assert others == [where], f"ftagent imported from {others}, not {where}"


def timed(calls: list[Callable[[], object]], keep_gc: bool) -> tuple[float, float, float]:
    """(total, median, worst) seconds of ``calls``, each timed alone."""
    took = []
    gc.collect()
    if not keep_gc:  # a full collection's pause is the heap's, not the message's
        gc.disable()
    try:
        for fn in calls:
            t0 = time.perf_counter()
            fn()
            took.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return sum(took), statistics.median(took), max(took)


def level(n: int, seed: int, keep_gc: bool, timed_steps: bool,
          replicas: bool) -> dict[str, Any]:
    """One job of ``n`` ranks through its start and one hang probe (module docstring)."""
    from ftagent.arbiter.policy import PolicyConfig
    from ftagent.arbiter.registry import Connection, Registry
    from ftagent.arbiter.timeline import Timeline
    from ftagent.v1 import ftagent_pb2 as pb

    saved = list(sys.path)
    sys.path.insert(1, HERE)
    from verdict_scale import STEP, answer  # it imports ftagent: the tree's, loaded first
    sys.path[:] = saved  # it puts this checkout first: the tree's modules stay first

    reg = Registry(PolicyConfig(max_restarts=100, stacks_timeout=600.0), Timeline(),
                   None, "bench")
    # a stream's peer as grpc names it: with --replicas, the agents' replica holders are
    # at its host
    conns = [Connection(f"ipv4:10.0.{r // 256}.{r % 256}:5000") for r in range(n)]

    def drain() -> list[pb.Command]:
        got = []
        for c in conns:
            while not c.outbox.empty():
                item = c.outbox.get_nowait()
                if isinstance(item, tuple):
                    m = pb.ArbiterMessage.FromString(item[0])
                    if m.WhichOneof("body") == "command":
                        got.append(m.command)
        return got

    def send(c: Connection, m: pb.AgentMessage) -> Callable[[], object]:
        return lambda: reg.handle(c, m, 0.0)

    def say(c: Connection, data: bytes) -> Callable[[], object]:  # parsed as on the wire
        return lambda: reg.handle(c, pb.AgentMessage.FromString(data), 0.0)

    out: dict[str, Any] = {"ranks": n}
    out["hello"] = timed([functools.partial(reg.hello, c, pb.Hello(
        job="scale", namespace="bench", rank=r, world_size=n, agent_instance=f"a{r}",
        pod=f"scale-worker-{r}", node=f"node-{r // 8}", replica_port=7000 if replicas else 0))
        for r, c in enumerate(conns)],
        keep_gc)
    arrive = pb.AgentMessage(arrival=pb.BarrierArrival(generation=0))
    out["arrival"] = timed([send(c, arrive) for c in conns], keep_gc)
    drain()
    prog = pb.AgentMessage(progress=pb.ProgressSummary(step=STEP, ts=time.time(),
                                                       seconds_since_progress=30.0))
    out["progress"] = timed([send(c, prog) for c in conns], keep_gc)
    if timed_steps:  # summaries with step timings (instrument(): waits in collectives)
        steps = pb.AgentMessage(progress=pb.ProgressSummary(
            step=STEP, ts=time.time(), seconds_since_progress=30.0, step_seconds=1.0,
            collective_seconds=0.4, data_seconds=0.05, timed_steps=8))
        out["timed"] = timed([send(c, steps) for c in conns], keep_gc)
    culprit = random.Random(seed).randrange(8, n)
    fault = pb.Fault(id="hang-0", kind=pb.FAULT_KIND_HANG, severity=pb.SEVERITY_WARNING,
                     message="waiting in all_reduce for 30s",
                     evidence_json=json.dumps({"waiting_in_collective": True}), generation=0)
    out["fault"] = timed([send(conns[0], pb.AgentMessage(fault=fault))], keep_gc)
    dumps = [c for c in drain() if c.kind == pb.COMMAND_KIND_DUMP_STACKS]
    assert len(dumps) == n, f"{len(dumps)} DUMP_STACKS for {n} ranks"
    order = list(range(n))
    random.Random(seed).shuffle(order)
    wire = {r: pb.AgentMessage(stacks=pb.Stacks(
        command_id=dumps[0].id, json=answer(r, n, 8, {culprit}))).SerializeToString()
        for r in order}
    out["answers"] = timed([say(conns[r], wire[r]) for r in order[:-1]], keep_gc)
    out["decide"] = timed([say(conns[order[-1]], wire[order[-1]])], keep_gc)
    restarts = [c for c in drain() if c.kind == pb.COMMAND_KIND_RESTART]
    entries = [e for e in reg.timeline.entries("scale", "bench")
               if e.kind == "decision" and e.fault_id == "hang-0"
               and e.action != "dump_stacks"]
    named = [c.rank for c in entries[-1].culprits] if entries else []
    out["verdict"] = entries[-1].action if entries else "none"
    out["ok"] = out["verdict"] == "restart" and named == [culprit] and len(restarts) == n
    out["reason"] = entries[-1].message[:300] if entries else ""
    if replicas:  # every pod recreated (a new address each), its agent says Hello again
        again = [Connection(f"ipv4:10.1.{r // 256}.{r % 256}:5000") for r in range(n)]
        for c in conns:
            reg.disconnect(c)
        out["rehello"] = timed([functools.partial(reg.hello, c, pb.Hello(
            job="scale", namespace="bench", rank=r, world_size=n, generation=1,
            agent_instance=f"b{r}", pod=f"scale-worker-{r}-new", node=f"node-{r // 8}-new",
            replica_port=7000)) for r, c in enumerate(again)], keep_gc)
    return out


def run_tree(tree: str, levels: str, seed: int, keep_gc: bool,
             timed_steps: bool, replicas: bool) -> list[dict[str, Any]]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, "--levels", levels,
           "--seed", str(seed)] + (["--gc"] if keep_gc else []) + \
        (["--timed"] if timed_steps else []) + (["--replicas"] if replicas else [])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tree decides
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if got.returncode != 0:
        raise SystemExit(f"{tree}: exit {got.returncode}\n{got.stderr[-3000:]}")
    return [json.loads(line) for line in got.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1024,4096,16384")
    ap.add_argument("--before", default="/work/main", help="a checkout to compare with "
                    "('': --after alone)")
    ap.add_argument("--after", default=os.path.dirname(HERE), help="this checkout "
                    "('': --before alone)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gc", action="store_true", help="leave Python's garbage collector "
                    "on while timing (its full collections then land on some message)")
    ap.add_argument("--timed", action="store_true", help="also one round of summaries "
                    "with step timings (an instrumented job's: the straggler comparison)")
    ap.add_argument("--replicas", action="store_true", help="the agents hold snapshot "
                    "replicas (Hello.replica_port), and after the probe every pod comes "
                    "back with a new address and says Hello again (rehello)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.child:
        child(args.child, levels, args.seed, args.gc, args.timed, args.replicas)
        return 0
    print("$ " + " ".join([os.path.relpath(sys.executable), "bench/probe_scale.py"]
                          + sys.argv[1:]))
    trees = [(name, tree) for name, tree in (("before", args.before), ("after", args.after))
             if tree]
    rows = {name: run_tree(tree, args.levels, args.seed, args.gc, args.timed,
                           args.replicas)
            for name, tree in trees}
    for name, tree in trees:
        print(f"{name}: {rows[name][0]['tree'] if rows[name] else tree}")
    kinds = ("hello", "arrival", "progress", "answers") + (("timed",) if args.timed else ()) \
        + (("rehello",) if args.replicas else ())
    print(f"{'':>13}" + "".join(f" {k:>25}" for k in kinds) + f" {'decide':>10}")
    print(f"{'tree':>6} {'ranks':>6}" + f" {'all s':>8} {'p50 us':>7} {'max ms':>8}" * len(kinds)
          + f" {'ms':>10}  verdict")
    failed = 0
    for i, n in enumerate(levels):
        for name, _ in trees:
            r = rows[name][i]
            cells = "".join(f" {r[k][0]:>8.3f} {r[k][1] * 1e6:>7.0f} {r[k][2] * 1000:>8.2f}"
                            for k in kinds)
            ok = "ok" if r["ok"] else f"WRONG: {r['verdict']}: {r['reason']}"
            failed += not r["ok"]
            print(f"{name:>6} {n:>6}{cells} {r['decide'][0] * 1000:>10.1f}  {ok}")
        if len(trees) == 2:
            b, a = rows["before"][i], rows["after"][i]
            ratio = "".join(f" {a[k][0] / b[k][0]:>7.2f}x {a[k][1] / b[k][1]:>6.2f}x "
                            f"{a[k][2] / b[k][2]:>7.2f}x" for k in kinds)
            print(f"{'after/before':>13}{ratio} {a['decide'][0] / b['decide'][0]:>9.2f}x")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
