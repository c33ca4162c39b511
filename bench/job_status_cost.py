"""What one job's status costs the arbiter's event loop: GetJob (the job with its ranks)
and ListJobs (every job, no ranks) at 6,000 and 100,000 ranks.

    .venv/bin/python bench/job_status_cost.py [--ranks 6000,100000] [--repeat 5]

A real Registry, ranks registered by Hello (simulated connections, no network), every
rank with progress; one rank in 50 not running (its agent gone). Printed per size: the
median wall time of building and serializing GetJob's answer (now: at most 1,000 ranks
shown; before: every rank, as the code before built it, measured in the same run) and
ListJobs', and the answer's size. Noisy on a shared machine; compare sizes within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def main() -> None:
    from ftagent.arbiter import readout
    from ftagent.arbiter.policy import PolicyConfig
    from ftagent.arbiter.registry import Connection, Registry
    from ftagent.arbiter.timeline import Timeline
    from ftagent.v1 import ftagent_pb2 as pb

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="6000,100000")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    print(f"{'ranks':>8} {'GetJob':>10} {'bytes':>10} {'ranks shown':>12} {'ListJobs':>10} "
          f"{'GetJob before':>14} {'bytes before':>13}")
    now = readout.shown_ranks
    # Registration is not what is measured: before the job's first barrier is released
    # each Hello takes a pass over every rank (barrier.reconcile), so registering 100,000
    # ranks one by one costs 100,000^2 / 2 steps; the bench skips that decision.
    from ftagent.arbiter import jobs as jobs_module

    jobs_module.barrier.decide_hello = lambda job, rank, now: []  # type: ignore
    for n in (int(x) for x in a.ranks.split(",")):
        reg = Registry(PolicyConfig(max_restarts=5), Timeline(), None, "bench")
        conns = []
        for r in range(n):
            c = Connection(f"p{r}")
            reg.hello(c, pb.Hello(job="big", namespace="ns", rank=r, world_size=n,
                                  agent_instance=f"i{r}", pod=f"pod-{r}", node=f"n{r // 8}"))
            reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(step=10, ts=1.0)), 1.0)
            conns.append(c)
        for r in range(0, n, 50):
            reg.disconnect(conns[r])
        job = reg.jobs[("ns", "big")]
        get, size, shown = [], 0, 0
        for _ in range(a.repeat):
            t = time.perf_counter()
            info = reg.info(job, ranks=True, timeline_limit=20)
            raw = info.SerializeToString()
            get.append(time.perf_counter() - t)
            size, shown = len(raw), len(info.ranks)
        readout.shown_ranks = lambda job, s: now(job, s, limit=10**9)  # type: ignore
        old = []
        for _ in range(a.repeat):
            t = time.perf_counter()
            old_size = len(reg.info(job, ranks=True, timeline_limit=20).SerializeToString())
            old.append(time.perf_counter() - t)
        readout.shown_ranks = now  # type: ignore
        lst = []
        for _ in range(a.repeat):
            t = time.perf_counter()
            pb.ListJobsResponse(jobs=[reg.info(j, ranks=False) for j in reg.listing()]
                                ).SerializeToString()
            lst.append(time.perf_counter() - t)
        print(f"{n:8,} {statistics.median(get) * 1e3:8.1f}ms {size:10,} {shown:12,} "
              f"{statistics.median(lst) * 1e3:8.1f}ms {statistics.median(old) * 1e3:12.1f}ms "
              f"{old_size:13,}")


if __name__ == "__main__":
    main()
