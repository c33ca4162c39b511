"""Which ranks run on a node and in a pod, for the cluster's hooks (``kube/cluster.py``).

Indexes built from Hellos (``Hello.node``, ``Hello.pod``): a hint only, checked against
the rank's current state on every lookup (an index entry whose rank moved or whose job
was forgotten is dropped when it is met), so a stale entry can never point an action at
the wrong rank.
"""

from __future__ import annotations

from ftagent.arbiter.state import JobState, RankState

Key = tuple[str, str]  # (namespace, job)


class NodeMap:
    def __init__(self, jobs: dict[Key, JobState]) -> None:
        self.jobs = jobs
        self._pods: dict[Key, tuple[Key, int]] = {}  # (namespace, pod) -> (job, rank)
        self._nodes: dict[str, set[tuple[Key, int]]] = {}

    def index(self, key: Key, rs: RankState) -> None:
        if rs.pod:
            self._pods[(key[0], rs.pod)] = (key, rs.rank)
        if rs.node:
            self._nodes.setdefault(rs.node, set()).add((key, rs.rank))

    def unindex(self, key: Key) -> None:
        """Drop a forgotten job's pods and nodes from the indexes (once per job)."""
        self._pods = {k: v for k, v in self._pods.items() if v[0] != key}
        for node in list(self._nodes):
            self._nodes[node] = {v for v in self._nodes[node] if v[0] != key}
            if not self._nodes[node]:
                del self._nodes[node]

    def ranks_on_node(self, node: str) -> list[tuple[JobState, RankState]]:
        """Every live job's ranks whose agent said it runs on ``node`` (Hello.node)."""
        out = []
        for key, rank in list(self._nodes.get(node, ())):
            j = self.jobs.get(key)
            rs = j.ranks.get(rank) if j is not None else None
            if j is not None and rs is not None and rs.node == node:
                out.append((j, rs))
            else:
                self._nodes[node].discard((key, rank))
        if node in self._nodes and not self._nodes[node]:
            del self._nodes[node]
        return sorted(out, key=lambda t: (t[0].namespace, t[0].job, t[1].rank))

    def rank_of_pod(self, namespace: str, pod: str) -> tuple[JobState, RankState] | None:
        """The job and rank whose agent said it runs in pod ``namespace/pod`` (Hello.pod;
        an agent that gave no namespace matches any)."""
        for ns in (namespace, ""):
            got = self._pods.get((ns, pod))
            if got is None:
                continue
            j = self.jobs.get(got[0])
            rs = j.ranks.get(got[1]) if j is not None else None
            if j is not None and rs is not None and rs.pod == pod:
                return j, rs
            del self._pods[(ns, pod)]
        return None
