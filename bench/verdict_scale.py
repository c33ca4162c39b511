"""The arbiter's hang verdict at scale: 64 to 1,024 ranks, one to three culprits.

    .venv/bin/python bench/verdict_scale.py [--levels 64,256,1024] [--culprits 1,2,3]
        [--rounds 3] [--group 8]

Simulated ranks speak to the real arbiter's registry (``ftagent/arbiter/registry.py``, the
object the gRPC server hands every message to: Hello, barrier arrival, progress, a hang
fault, then each rank's DUMP_STACKS answer as serialized protobuf, parsed, checked and
decided exactly as on the wire; no gRPC, in this process: what is timed is the arbiter's
own work, not the loopback). The job: ``--group``-rank inner process groups (tensor
parallel) inside the world group; at step N each culprit stops before its inner group's
all-reduce #N (its agent saw it dead-still: ``live=hung``, its stack in
``hang_before_collective``), its group's other ranks wait inside that all-reduce, every
other rank waits inside the world group's all-reduce #N. Every rank's answer carries its
stacks (py-spy text, as ``agent/verify.py`` sends them) and its flight-recorder summary
(the last 8 collectives of each of its groups, as ``agent/fr_summary.py`` writes them).

Per level and culprit count (``--rounds`` runs each, the median shown):

* ``decide ms``: from the last rank's answer handed to the registry to the RESTART queued
  on every rank's stream (the verdict: every rank's stacks and flight recorder compared);
* ``intake ms``: the arbiter's time for all the answers (each parsed and checked once);
* ``peak MiB``: the Python heap's peak over the probe (tracemalloc, a separate run: it
  slows what it measures), and the process's RSS after it;
* ``culprits``: the ranks the decision names (Decision.culprits), ``ok`` when exactly the
  simulated ones.

Goal (issue 35): the decision within 1 s of the last report at 1,024 ranks, culprits named.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ftagent.arbiter.policy import PolicyConfig  # noqa: E402
from ftagent.arbiter.registry import Connection, Registry  # noqa: E402
from ftagent.arbiter.timeline import Timeline  # noqa: E402
from ftagent.v1 import ftagent_pb2 as pb  # noqa: E402

STEP = 400  # the collective number every rank is at (each group's #N)
WAIT_TEXT = """Thread {tid} (idle): "MainThread"
    wait (torch/distributed/distributed_c10d.py:4000)
    all_reduce (torch/distributed/distributed_c10d.py:2800)
    train_step (train.py:{line})
    main (train.py:300)
Thread {tid2} (idle): "pt_autograd_0"
    wait (threading.py:331)
    _worker (torch/utils/data/_utils/pin_memory.py:54)
"""
CULPRIT_TEXT = """Thread {tid} (idle): "MainThread"
    hang_before_collective (train.py:120)
    train_step (train.py:{line})
    main (train.py:300)
"""


@dataclass
class Result:
    ranks: int
    culprits: tuple[int, ...]
    named: tuple[int, ...]
    decide_s: float
    intake_s: float
    verdict: str
    reason: str

    @property
    def ok(self) -> bool:
        return self.named == self.culprits


def _entries(enqueued: int, completed: int) -> list[dict[str, Any]]:
    return [{"seq": s, "op": "all_reduce", "in_sizes": [[1024, 1024]], "dtypes": ["Float"],
             "frames": [f"train.py:{100 + s % 7} train_step"]}
            for s in range(max(1, enqueued - 7), enqueued + 1)]


def answer(rank: int, world: int, group: int, culprits: set[int]) -> str:
    """Rank ``rank``'s DUMP_STACKS answer: its stacks, its verdict of life, its flight
    recorder's summary over its inner group and the world group."""
    mine = rank // group
    hit = any(c // group == mine for c in culprits)  # a culprit in my inner group
    if rank in culprits:  # stopped before the inner all-reduce #N: behind in both groups
        inner, outer = (STEP - 1, STEP - 1), (STEP - 1, STEP - 1)
        text, state, where = CULPRIT_TEXT, "hung", "hang_before_collective (train.py:120)"
    elif hit:  # inside the inner all-reduce #N, waiting for the culprit
        inner, outer = (STEP, STEP - 1), (STEP - 1, STEP - 1)
        text, state, where = WAIT_TEXT, "waiting", "all_reduce (distributed_c10d.py:2800)"
    else:  # through the inner one, inside the world's all-reduce #N
        inner, outer = (STEP, STEP), (STEP, STEP - 1)
        text, state, where = WAIT_TEXT, "waiting", "all_reduce (distributed_c10d.py:2800)"
    groups = [{"name": f"tp{mine}", "enqueued": inner[0], "completed": inner[1],
               "entries": _entries(*inner)},
              {"name": "0", "enqueued": outer[0], "completed": outer[1],
               "entries": _entries(*outer)}]
    out = {"processes": [{"pid": 1000 + rank, "stack": text.format(
               tid=rank, tid2=rank + world, line=140)}], "seconds": 2.0,
           "liveness": {"state": state, "where": where, "declared": state == "hung"},
           "flight_recorder": {"summaries": [{"rank": rank, "groups": groups}]}}
    return json.dumps(out)


class Rig:
    """A registry with one job of ``world`` ranks, every rank connected and trained to
    step ``STEP``; its clock is real time (the verdict's own time is what is measured)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.reg = Registry(PolicyConfig(max_restarts=100, stacks_timeout=60.0), Timeline(),
                            None, "bench")
        self.conns = [Connection(f"peer-{r}") for r in range(world)]
        for r, c in enumerate(self.conns):
            self.reg.hello(c, pb.Hello(job="scale", namespace="bench", rank=r,
                                       world_size=world, agent_instance=f"a{r}",
                                       pod=f"scale-worker-{r}", node=f"node-{r // 8}"))
        for c in self.conns:
            self.reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
        self.drain()

    def drain(self) -> list[pb.Command]:
        out = []
        for c in self.conns:
            while not c.outbox.empty():
                item = c.outbox.get_nowait()
                if isinstance(item, tuple):
                    m = pb.ArbiterMessage.FromString(item[0])
                    if m.WhichOneof("body") == "command":
                        out.append(m.command)
        return out

    def hang(self, culprits: set[int], group: int, seed: int = 0) -> Result:
        """One job hang: a waiting rank suspects it, every rank answers (in a random
        order, the culprits among them), the verdict."""
        job = self.reg.jobs[("bench", "scale")]
        now = time.time()
        for c in self.conns:  # every rank's last step 30 s ago
            self.reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
                step=STEP, ts=now, seconds_since_progress=30.0)), 0.0)
        reporter = next(r for r in range(self.world) if r not in culprits)
        fault = pb.Fault(id=f"hang-{seed}", kind=pb.FAULT_KIND_HANG,
                         severity=pb.SEVERITY_WARNING, message="waiting in all_reduce for 30s",
                         evidence_json=json.dumps({"waiting_in_collective": True}),
                         generation=job.generation)
        self.reg.handle(self.conns[reporter], pb.AgentMessage(fault=fault), 0.0)
        dumps = [c for c in self.drain() if c.kind == pb.COMMAND_KIND_DUMP_STACKS]
        assert len(dumps) == self.world, f"{len(dumps)} DUMP_STACKS for {self.world} ranks"
        order = list(range(self.world))
        random.Random(seed).shuffle(order)
        wire = {r: pb.AgentMessage(stacks=pb.Stacks(
            command_id=dumps[0].id, json=answer(r, self.world, group, culprits)))
            .SerializeToString() for r in order}
        t0 = time.perf_counter()
        for r in order[:-1]:
            self.reg.handle(self.conns[r], pb.AgentMessage.FromString(wire[r]), 0.0)
        t1 = time.perf_counter()
        self.reg.handle(self.conns[order[-1]], pb.AgentMessage.FromString(wire[order[-1]]), 0.0)
        t2 = time.perf_counter()
        restarts = [c for c in self.drain() if c.kind == pb.COMMAND_KIND_RESTART]
        entries = [e for e in self.reg.timeline.entries("scale", "bench")
                   if e.kind == "decision" and e.fault_id == f"hang-{seed}"
                   and e.action != "dump_stacks"]
        verdict = entries[-1].action if entries else "none"
        named = tuple(c.rank for c in entries[-1].culprits) if entries else ()
        if verdict == "restart":
            assert len(restarts) == self.world, f"RESTART reached {len(restarts)} ranks"
        return Result(self.world, tuple(sorted(culprits)), named, t2 - t1, t1 - t0 + t2 - t1,
                      verdict, entries[-1].message if entries else "")


def pick_culprits(world: int, n: int, group: int, seed: int) -> set[int]:
    """``n`` culprits in different inner groups (one stuck rank per group)."""
    groups = random.Random(seed).sample(range(world // group), n)
    return {g * group + random.Random(seed + g).randrange(group) for g in groups}


def run_once(world: int, n: int, group: int, seed: int) -> Result:
    return Rig(world).hang(pick_culprits(world, n, group, seed), group, seed)


def peak_mib(world: int, n: int, group: int, seed: int) -> float:
    """The Python heap's peak while the probe is decided (stacks in, verdict out), over
    what the rig held before it."""
    rig = Rig(world)
    culprits = pick_culprits(world, n, group, seed)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    rig.hang(culprits, group, seed)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (peak - base) / 2**20


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="64,256,1024")
    ap.add_argument("--culprits", default="1,2,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--group", type=int, default=8, help="ranks per inner process group")
    args = ap.parse_args()
    print(f"{'ranks':>6} {'culprits':>8} {'decide ms':>10} {'(max)':>7} {'intake ms':>10} "
          f"{'peak MiB':>9} {'RSS MiB':>8}  named")
    failed = 0
    for world in (int(x) for x in args.levels.split(",")):
        for n in (int(x) for x in args.culprits.split(",")):
            got = [run_once(world, n, args.group, seed) for seed in range(args.rounds)]
            bad = [g for g in got if not g.ok or g.verdict != "restart"]
            failed += len(bad)
            decide = [g.decide_s * 1000 for g in got]
            intake = [g.intake_s * 1000 for g in got]
            mem = peak_mib(world, n, args.group, 0)
            named = "ok" if not bad else \
                f"WRONG: {bad[0].verdict} named {bad[0].named}, not {bad[0].culprits}"
            print(f"{world:>6} {n:>8} {statistics.median(decide):>10.1f} {max(decide):>7.1f} "
                  f"{statistics.median(intake):>10.1f} {mem:>9.1f} {rss_mib():>8.0f}  "
                  f"{named} (e.g. {', '.join(map(str, got[0].named))})", flush=True)
            if bad:
                print(f"       {bad[0].reason[:400]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
