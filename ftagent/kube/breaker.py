"""The cordon circuit breaker: a bad rule must not drain a cluster. Pure (clock passed in).

It counts the nodes ftagent holds cordoned *now*, not the cordons of a past hour: a node
stays counted until it is uncordoned (by an operator's ``kubectl uncordon``, or by the
arbiter's own uncordon), so a slow rule cannot cordon 100 nodes in 10 hours while the
breaker counts none. The memory is the cluster itself: every cordon ftagent makes is
annotated on the node (``ftagent.io/cordoned-by``, ``-at``, ``fault-job``,
``cordon-evidence``), and ``observe`` takes each node as the node watch sees it: held while
it carries ftagent's annotation and is unschedulable, released when either is gone. A new
leader (or a restarted arbiter) therefore counts what its predecessor holds.

Two budgets:

* cordons on pod evidence that other pods corroborated (``node_scope``): at most
  ``--max-cordon-fraction`` of the nodes one job uses and of the cluster's nodes (each
  rounded down but at least one node; 0 never cordons), and at most ``max_nodes``
  (``--max-cordons``) in the cluster;
* cordons confirmed by evidence a pod cannot forge (the node's own agent, the API server's
  node conditions): their own cap, ``max_confirmed`` (``--max-confirmed-cordons``), and the
  cluster fraction (a broken node agent still cannot drain the cluster).

A node already held costs nothing again. The counts are of nodes the API server knows (the
node watch), never of nodes a peer names. When the breaker refuses, the pod is still
deleted and replaced; only the cordon (and taint) is skipped, with the reason in the
timeline, the log and a Kubernetes Event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_NODES = 10  # default of --max-cordons: nodes held cordoned on corroborated pod evidence
MAX_CONFIRMED = 50  # default of --max-confirmed-cordons: held on node evidence
# A cordon made here that the node watch has not shown yet is counted for this long even
# when the watch shows the node without it (the watch may be behind the write).
SETTLE = 60.0
MAX_HELD = 100_000


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str  # why not (empty when allowed)


@dataclass(frozen=True)
class Held:
    """A node ftagent holds cordoned: for which job, since when, on which evidence."""

    job: str
    at: float
    confirmed: bool  # node evidence (its agent, its conditions), not corroborated pods
    seen: bool = False  # the node watch has shown it (else made here, at ``at``)


@dataclass
class CordonBreaker:
    max_fraction: float
    max_nodes: int = MAX_NODES
    max_confirmed: int = MAX_CONFIRMED
    settle: float = SETTLE
    _held: dict[str, Held] = field(default_factory=dict)

    @staticmethod
    def limit(fraction: float, nodes: int) -> int:
        """Nodes that may be cordoned out of ``nodes`` (0 when the fraction is 0)."""
        if fraction <= 0 or nodes <= 0:
            return 0
        return max(1, math.floor(fraction * nodes + 1e-9))

    def check(self, node: str, job: str, job_nodes: int, cluster_nodes: int,
              now: float, confirmed: bool = False) -> Verdict:
        """May ``node`` be cordoned for ``job``, which runs on ``job_nodes`` nodes of a
        cluster of ``cluster_nodes`` (0: unknown, the job's count stands in)? ``confirmed``:
        on node evidence (its own budget)."""
        if node in self._held:
            return Verdict(True, "")
        if self.max_fraction <= 0:
            return Verdict(False, "cordoning is off (--max-cordon-fraction 0)")
        held = self._held.values()
        total = cluster_nodes or job_nodes
        allowed_all = self.limit(self.max_fraction, max(total, 1))
        if confirmed:
            pool = sum(1 for h in held if h.confirmed)
            if pool + 1 > self.max_confirmed:
                return Verdict(False, f"circuit breaker: {pool} nodes held cordoned on node "
                               f"evidence now (--max-confirmed-cordons {self.max_confirmed})")
        else:
            mine = sum(1 for h in held if h.job == job)
            allowed_job = self.limit(self.max_fraction, max(job_nodes, 1))
            if mine + 1 > allowed_job:
                return Verdict(False, f"circuit breaker: {mine} of the job's {job_nodes} nodes "
                               f"held cordoned now (--max-cordon-fraction "
                               f"{self.max_fraction:g} allows {allowed_job})")
            pool = sum(1 for h in held if not h.confirmed)
            if pool + 1 > self.max_nodes:
                return Verdict(False, f"circuit breaker: {pool} nodes held cordoned on pod "
                               f"evidence in the cluster now (--max-cordons {self.max_nodes})")
        if len(self._held) + 1 > allowed_all:
            return Verdict(False, f"circuit breaker: {len(self._held)} of the cluster's "
                           f"{total} nodes held cordoned now (--max-cordon-fraction "
                           f"{self.max_fraction:g} allows {allowed_all})")
        return Verdict(True, "")

    def record(self, node: str, job: str, now: float, confirmed: bool = False) -> None:
        """A cordon is being made (call after ``check`` allowed it)."""
        if node not in self._held and len(self._held) < MAX_HELD:
            self._held[node] = Held(job, now, confirmed)

    def observe(self, node: str, held: Held | None, now: float) -> None:
        """The node watch's view of ``node``: ``held`` when it carries ftagent's cordon
        (annotation + unschedulable), None when it does not (or it was deleted)."""
        if held is not None:
            if node in self._held or len(self._held) < MAX_HELD:
                self._held[node] = Held(held.job, held.at, held.confirmed, seen=True)
            return
        mine = self._held.get(node)
        if mine is None:
            return
        if mine.seen or now - mine.at >= self.settle:
            del self._held[node]  # uncordoned (or never written)

    def release(self, node: str) -> None:
        """ftagent uncordoned ``node`` itself."""
        self._held.pop(node, None)

    def seed(self, node: str, job: str, at: float, now: float, confirmed: bool = False) -> None:
        """A cordon found on a node (its annotations, from the watch)."""
        self.observe(node, Held(job, at, confirmed), now)

    def count(self) -> int:
        """Nodes held cordoned now (safe from another thread: one len)."""
        return len(self._held)

    def held(self, node: str) -> Held | None:
        return self._held.get(node)

    def cordoned(self, now: float = 0.0) -> list[str]:
        """Nodes held cordoned now, oldest first."""
        return [n for n, _ in sorted(self._held.items(), key=lambda kv: kv[1].at)]
