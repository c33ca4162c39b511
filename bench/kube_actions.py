"""Node NotReady (a watch event) -> RESTART queued to every rank; decision -> cordon issued.

    .venv/bin/python bench/kube_actions.py [--ranks 256] [--per-node 8] [--rounds 20]

In one process: the fake API server of the tests (real HTTP, real chunked watch streams),
the real ``kubernetes`` client, the arbiter's Registry deciding and ``kube.cluster.Cluster``
with its node and pod watches. A job of ``--ranks`` ranks (``--per-node`` per node) runs;
each round one of its nodes turns Ready=False with ``--node-notready-grace 0``, and we time

* event -> decision: from the write that makes the node NotReady to the moment the
  registry has queued RESTART (REPLACE for the node's ranks) on every rank's stream (the
  decision listener runs right after the last queue put). The serialised command is on
  each stream's outbox; the gRPC write itself is not included (bench/arbiter_scale.py
  measures the fan-out over real streams);
* decision -> cordon issued: from that moment to the API server receiving the node
  update (the fake's request log).

The grace is 0 here: in a cluster the figure adds --node-notready-grace (40 s default).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftagent.arbiter.policy import PolicyConfig  # noqa: E402
from ftagent.arbiter.registry import Connection, Registry  # noqa: E402
from ftagent.arbiter.state import Decision, JobState, Verdict  # noqa: E402
from ftagent.arbiter.timeline import Timeline  # noqa: E402
from ftagent.kube.cluster import (  # noqa: E402
    JOB_LABEL,
    Cluster,
    KubeSettings,
    start_watches,
    tick_forever,
)
from ftagent.v1 import ftagent_pb2 as pb  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def main(args: argparse.Namespace) -> None:
    import logging

    logging.disable(logging.WARNING)  # the timeline logs every decision
    nodes = args.ranks // args.per_node
    fake = FakeKube()
    for n in range(nodes):
        fake.add_node(f"node-{n}")
    reg = Registry(PolicyConfig(max_restarts=10_000), Timeline(), None, "bench")
    conns = []
    for r in range(args.ranks):
        node = f"node-{r // args.per_node}"
        fake.add_pod("train", f"w-{r}", labels={JOB_LABEL: "big"}, node=node)
        c = Connection()
        reg.hello(c, pb.Hello(job="big", namespace="train", rank=r, world_size=args.ranks,
                              agent_instance=f"i{r}", pod=f"w-{r}", node=node))
        conns.append(c)
    api = fake.client()
    cl = Cluster(reg, api, KubeSettings(node_notready_grace=0.0, max_cordon_fraction=1.0))
    decided: dict[int, float] = {}

    def listener(job: JobState, d: Decision, now: float) -> None:
        if d.verdict is Verdict.REPLACE:
            decided[d.generation] = time.monotonic()

    reg.add_decision_listener(listener)
    stop = threading.Event()
    threads = start_watches(cl, api, asyncio.get_running_loop(), stop)
    ticker = asyncio.create_task(tick_forever(cl, 0.05))
    while len(cl.pod_cache) < args.ranks or len(cl.node_names) < nodes:
        await asyncio.sleep(0.01)
    job = reg.jobs[("train", "big")]
    to_decision, to_cordon = [], []
    rounds = min(args.rounds, nodes)
    for i in range(rounds):
        for c in conns:  # drain what the agents would have read
            while not c.outbox.empty():
                c.outbox.get_nowait()
        g = job.generation + 1
        mark = fake.mark()
        t0 = time.monotonic()
        await asyncio.to_thread(fake.set_node_ready, f"node-{i}", "False")
        while g not in decided:
            await asyncio.sleep(0.0005)
        to_decision.append(decided[g] - t0)
        queued = sum(1 for c in conns if not c.outbox.empty())
        assert queued == args.ranks, queued
        req = await asyncio.to_thread(fake.wait_for_request, "update", "nodes", mark, 10.0)
        to_cordon.append(req.at - decided[g])
    ticker.cancel()
    stop.set()
    fake.drop_watches()
    cl.close()
    for t in threads:
        t.join(5)
    fake.stop()
    ms = 1000.0
    print(f"command: .venv/bin/python bench/kube_actions.py --ranks {args.ranks} "
          f"--per-node {args.per_node} --rounds {rounds}")
    print(f"job of {args.ranks} ranks on {nodes} nodes, {rounds} node NotReady events "
          "(grace 0)")
    print(f"node NotReady event -> RESTART/REPLACE queued to all {args.ranks} ranks: "
          f"p50 {statistics.median(to_decision) * ms:.1f} ms, p99 "
          f"{pct(to_decision, 99) * ms:.1f} ms, max {max(to_decision) * ms:.1f} ms "
          "(goal: p99 <= 250 ms beyond the grace)")
    print(f"decision -> cordon (node update) at the API server: p50 "
          f"{statistics.median(to_cordon) * ms:.1f} ms, p99 {pct(to_cordon, 99) * ms:.1f} ms, "
          f"max {max(to_cordon) * ms:.1f} ms (goal: <= 100 ms)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    asyncio.run(main(p.parse_args()))
