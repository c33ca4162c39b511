"""When a node ftagent cordoned may be given back: its own node agent says it is healthy,
without a break, for ``after`` seconds. Pure (clock passed in).

Opt-in (``--uncordon-after SECONDS``, 0: never, the default): only a node that carries
ftagent's own cordon is uncordoned (an operator's cordon is theirs), and only on the
node agent's word (``NodeReport.healthy``: no lasting fault holds on the node; a node agent
older than this field never says so, so its nodes stay cordoned). A fault report, an
unhealthy heartbeat, or heartbeats that stop for ``stale`` seconds start the count again.
The manual path is in docs/runbooks.md ("A node ftagent cordoned").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

STALE = 120.0  # seconds without a heartbeat after which "healthy since" no longer holds
MAX_NODES = 50_000


@dataclass
class NodeHealth:
    after: float  # seconds healthy before an uncordon (<= 0: never)
    stale: float = STALE
    # node -> (healthy since, last heartbeat)
    _healthy: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)

    def report(self, node: str, healthy: bool, now: float) -> None:
        """A verified node agent's report for ``node``."""
        if not healthy:
            self._healthy.pop(node, None)
            return
        since, last = self._healthy.get(node, (now, now))
        if now - last > self.stale:
            since = now  # heartbeats stopped for a while: count again
        self._healthy[node] = (since, now)
        self._healthy.move_to_end(node)
        while len(self._healthy) > MAX_NODES:
            self._healthy.popitem(last=False)

    def due(self, held: list[str], now: float) -> list[str]:
        """Of the nodes ftagent holds cordoned, those healthy for ``after`` seconds with a
        fresh heartbeat."""
        if self.after <= 0:
            return []
        out = []
        for node in held:
            got = self._healthy.get(node)
            if got is not None and now - got[1] <= self.stale and now - got[0] >= self.after:
                out.append(node)
        return out

    def forget(self, node: str) -> None:
        self._healthy.pop(node, None)
