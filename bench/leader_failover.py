"""Leader failover: time from SIGKILL of the leading arbiter to a fault decided by the new one.

Two real arbiter processes (``--leader-elect``) share one Lease in the fake API server
(tests/kube_fake, real HTTP, the real kubernetes client); agents (real ArbiterLinks) reach
them through a readiness-routed "Service" proxy (as kube-proxy with Ready endpoints only).
Each repetition: a fresh job of N ranks connects to the leader, the leader is SIGKILLed, a
rank reports a crash at once (queued while offline, re-sent on reconnect), and the clock
stops when every rank holds the RESTART the new leader decided. The killed replica is
restarted as the next standby. Printed: the lease settings, the command, p50/max of
"standby ready" and "fault decided for every rank" after the kill.

    .venv/bin/python bench/leader_failover.py [--reps 5] [--ranks 4]
        [--lease-duration 3 --renew-deadline 2 --retry-period 0.5]

What bounds it: the lease duration (the standby waits for the lease to expire on its own
clock, then at most one retry period) plus the agents' reconnect backoff (up to 4 s).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftagent.model import ActionKind, Fault, FaultKind  # noqa: E402
from tests.arbiter_helpers import running_links, wait_until  # noqa: E402
from tests.integration.test_leader_election import (  # noqa: E402
    Arbiter,
    service,
    the_leader,
    two_arbiters,
)
from tests.kube_fake import FakeKube  # noqa: E402


async def one(arbiters: list[Arbiter], i: int, ranks: int, timeout: float
              ) -> tuple[float, float]:
    leader = await the_leader(arbiters, timeout)
    standby = next(a for a in arbiters if a is not leader)
    async with service(arbiters) as svc, running_links(svc.address, f"job-{i}", ranks) as links:
        leader.proc.kill()
        killed = time.monotonic()
        links[0].report_fault(Fault(FaultKind.CRASH, "segfault"), exit_status=139)
        ready_at: list[float] = []

        async def watch_ready() -> None:
            await wait_until(standby.ready, timeout, "the standby to lead", interval=0.02)
            ready_at.append(time.monotonic() - killed)

        watcher = asyncio.create_task(watch_ready())
        for lk in links:
            cmd = await asyncio.wait_for(lk.commands.get(), timeout)
            assert cmd.kind is ActionKind.RESTART, cmd
        decided = time.monotonic() - killed
        await watcher
    leader.proc.start()  # back as the standby (same gRPC port, a new metrics port)
    leader.metrics = Arbiter(leader.proc).metrics
    return ready_at[0], decided


async def run(args: argparse.Namespace, arbiters: list[Arbiter]) -> list[tuple[float, float]]:
    out = []
    timeout = args.lease_duration * 3 + 20
    for i in range(args.reps):
        ready, decided = await one(arbiters, i, args.ranks, timeout)
        print(f"  rep {i + 1}: standby ready {ready:.2f} s, fault decided for all "
              f"{args.ranks} ranks {decided:.2f} s after the SIGKILL", flush=True)
        out.append((ready, decided))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--lease-duration", type=float, default=3.0)
    p.add_argument("--renew-deadline", type=float, default=2.0)
    p.add_argument("--retry-period", type=float, default=0.5)
    args = p.parse_args()
    logging.getLogger("ftagent.reporter").setLevel(logging.ERROR)  # "unreachable, retrying"
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"lease: duration {args.lease_duration:g} s, renew deadline {args.renew_deadline:g} "
          f"s, retry period {args.retry_period:g} s; {args.ranks} ranks; {args.reps} reps")
    with FakeKube() as fake, two_arbiters(fake.url, duration=args.lease_duration,
                                          deadline=args.renew_deadline,
                                          retry=args.retry_period) as arbiters:
        got = asyncio.run(run(args, arbiters))
    ready = [r for r, _ in got]
    decided = [d for _, d in got]
    print(f"standby ready after SIGKILL:         p50 {statistics.median(ready):.2f} s, "
          f"max {max(ready):.2f} s")
    print(f"fault decided for every rank after: p50 {statistics.median(decided):.2f} s, "
          f"max {max(decided):.2f} s (lease duration {args.lease_duration:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
