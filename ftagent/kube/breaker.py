"""The cordon circuit breaker: a bad rule must not drain a cluster. Pure (clock passed in).

Within any ``window`` (an hour), ftagent cordons at most ``--max-cordon-fraction`` of the
nodes one job uses, and of the cluster's nodes, each rounded down but at least one node
(a job on 4 nodes with 0.1 may still lose its one broken node). A fraction of 0 never
cordons. Beside the fractions, at most ``max_nodes`` nodes in the whole cluster per window
(``--max-cordons``: a fraction of a large cluster is still many nodes). A node already
cordoned by ftagent in the window costs nothing again. The counts are of nodes the API
server knows (the node watch), never of nodes a peer names.

The breaker's memory is the cluster itself: every cordon ftagent makes is annotated on the
node (``ftagent.io/cordoned-at``, ``ftagent.io/fault-job``), and ``seed`` takes those back
from the node watch, so a new leader (or a restarted arbiter) counts what its predecessor
did within the window. When the breaker refuses, the pod is still deleted and replaced;
only the cordon (and taint) is skipped, with the reason in the timeline, the log and a
Kubernetes Event.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

WINDOW = 3600.0
MAX_NODES = 10  # default of --max-cordons: nodes cordoned cluster-wide per window


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str  # why not (empty when allowed)


@dataclass
class CordonBreaker:
    max_fraction: float
    window: float = WINDOW
    max_nodes: int = MAX_NODES
    # (time, node, job) of each cordon made, oldest first
    _made: deque[tuple[float, str, str]] = field(default_factory=deque)

    def _expire(self, now: float) -> None:
        while self._made and now - self._made[0][0] >= self.window:
            self._made.popleft()

    @staticmethod
    def limit(fraction: float, nodes: int) -> int:
        """Nodes that may be cordoned out of ``nodes`` (0 when the fraction is 0)."""
        if fraction <= 0 or nodes <= 0:
            return 0
        return max(1, math.floor(fraction * nodes + 1e-9))

    def check(self, node: str, job: str, job_nodes: int, cluster_nodes: int,
              now: float) -> Verdict:
        """May ``node`` be cordoned for ``job``, which runs on ``job_nodes`` nodes of a
        cluster of ``cluster_nodes`` (0: unknown, the job's count stands in)?"""
        self._expire(now)
        if any(n == node for _, n, _ in self._made):
            return Verdict(True, "")
        if self.max_fraction <= 0:
            return Verdict(False, "cordoning is off (--max-cordon-fraction 0)")
        mine = {n for _, n, j in self._made if j == job}
        allowed_job = self.limit(self.max_fraction, max(job_nodes, 1))
        if len(mine) + 1 > allowed_job:
            return Verdict(False, f"circuit breaker: {len(mine)} of the job's {job_nodes} "
                           f"nodes already cordoned in the last {self.window / 60:.0f} min "
                           f"(--max-cordon-fraction {self.max_fraction:g} allows "
                           f"{allowed_job})")
        every = {n for _, n, _ in self._made}
        if len(every) + 1 > self.max_nodes:
            return Verdict(False, f"circuit breaker: {len(every)} nodes already cordoned in "
                           f"the cluster in the last {self.window / 60:.0f} min (--max-cordons "
                           f"{self.max_nodes})")
        total = cluster_nodes or job_nodes
        allowed_all = self.limit(self.max_fraction, max(total, 1))
        if len(every) + 1 > allowed_all:
            return Verdict(False, f"circuit breaker: {len(every)} of the cluster's {total} "
                           f"nodes already cordoned in the last {self.window / 60:.0f} min "
                           f"(--max-cordon-fraction {self.max_fraction:g} allows "
                           f"{allowed_all})")
        return Verdict(True, "")

    def record(self, node: str, job: str, now: float) -> None:
        """A cordon was made (call after ``check`` allowed it)."""
        self._expire(now)
        self._made.append((now, node, job))

    def seed(self, node: str, job: str, at: float, now: float) -> None:
        """A cordon found on a node (its annotations, from the watch): counted while within
        the window, once per node."""
        self._expire(now)
        if now - at >= self.window or any(n == node for _, n, _ in self._made):
            return
        self._made.append((at, node, job))
        self._made = deque(sorted(self._made))

    def cordoned(self, now: float) -> list[str]:
        """Nodes cordoned within the window, oldest first."""
        self._expire(now)
        return list(dict.fromkeys(n for _, n, _ in self._made))
