"""NotReady is not death. Pure: a NotReady node's ranks of one job, their last steps and
a clock in, a verdict out; ``cluster.py`` asks it before a node's NotReady fault reaches a
job, and again on every tick while the fault is held back.

Transient NotReady (a kubelet restart, an API-server partition, a slow heartbeat) far
outnumbers real node deaths, and the pods on such a node keep running. A job whose ranks
on the node are all still stepping -- their agents connected, each rank's last step after
the node went NotReady and within ``window`` -- is not hurt: the fault is held back as a
blip (a timeline entry says so), nothing is replaced or cordoned. Once a rank there stops
(no step within ``window``, or its agent's stream is gone) while the node is still
NotReady, the fault goes to that job as today. A deleted node is never a blip.

``window`` is at least ``STEP_WINDOW``: agents report progress every 5 s (coalesced), so
a rank's last step as the arbiter knows it may be that old on a healthy rank. With the
default grace (40 s, as long as the node controller's own) a rank that died with its node
is staler than that at the grace already: a real loss is not delayed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

STEP_WINDOW = 15.0  # three of the agents' progress reports (agent/reporter.py)


class Rank(Protocol):
    rank: int
    connected: bool
    last_step_at: float | None


@dataclass(frozen=True)
class Stepping:
    stepping: bool
    why: str


def still_stepping(ranks: Iterable[Rank], since: float, now: float,
                   window: float) -> Stepping:
    """Are all of these ranks (one job's, on the node NotReady since ``since``) still
    training: connected, each stepped within ``window``?"""
    rs = list(ranks)
    if not rs:
        return Stepping(False, "no ranks there")
    stale = []
    oldest = None
    for r in rs:
        t = r.last_step_at
        if not r.connected:
            stale.append(f"rank {r.rank}'s agent is not connected")
        elif t is None:
            stale.append(f"rank {r.rank} has not stepped yet")
        elif now - t > window:
            stale.append(f"rank {r.rank}'s last step was {now - t:.0f}s ago")
        else:
            oldest = t if oldest is None else min(oldest, t)
    if stale:
        return Stepping(False, "; ".join(stale[:4]) + (" ..." if len(stale) > 4 else ""))
    names = ", ".join(str(r.rank) for r in sorted(rs, key=lambda r: r.rank)[:16])
    age = now - oldest if oldest is not None else 0.0
    after = " since it went NotReady" if oldest is not None and oldest >= since else ""
    return Stepping(True, f"rank{'s' if len(rs) > 1 else ''} {names} there still stepping "
                    f"(every one within the last {max(age, 0.0):.1f}s{after})")
