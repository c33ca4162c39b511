"""When a fault is the node's and not one pod's: the evidence a cordon needs. Pure.

A pod agent runs beside user code (the trainer) and speaks only for its pod: a GPU or NIC
fault it reports replaces that pod, but by itself never cordons the node, which other jobs
share. A node is cordoned only on node-scope evidence:

* the API server's own view (the node watch: NotReady past the grace; ``cluster_faults``);
* a report of the node's own agent (``ftagent node``, verified: its token is bound to a pod
  on that node), for that node;
* a pod agent's GPU or NIC fault that the node agent confirms within ``window`` (before or
  after the pod's report: a later node report cordons the node then, ``confirmations``);
* the same kind of node-scope fault from ranks of two different jobs on that node within
  ``window`` (two tenants do not share a trainer).

Everything else (one pod alone, a crash, a hang, a straggler) replaces the pod and leaves
the node schedulable, and the Event says why.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

V = TypeVar("V")

WINDOW = 300.0
NODE_KINDS = frozenset({"gpu", "nic"})  # what a pod can see of its node
MAX_NODES = 50_000  # nodes with evidence kept (oldest dropped first)
MAX_PER_NODE = 64


@dataclass(frozen=True)
class PodReport:
    at: float
    job: str
    kind: str
    fault_id: str


class NodeEvidence:
    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._agent: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()
        self._agent_ids: OrderedDict[str, str] = OrderedDict()  # fault id -> node
        self._pods: OrderedDict[str, list[PodReport]] = OrderedDict()

    def node_agent(self, node: str, kinds: set[str], fault_ids: list[str], now: float) -> None:
        """A verified node agent reported these faults for ``node``."""
        self._agent[node] = (now, frozenset(kinds))
        self._agent.move_to_end(node)
        for fid in fault_ids:
            self._agent_ids[fid] = node
        _bound(self._agent)
        _bound(self._agent_ids)

    def from_node_agent(self, fault_id: str, node: str) -> bool:
        return self._agent_ids.get(fault_id) == node

    def _fresh(self, node: str, now: float) -> list[PodReport]:
        kept = [p for p in self._pods.get(node, ()) if now - p.at < self.window]
        if kept:
            self._pods[node] = kept[-MAX_PER_NODE:]
        else:
            self._pods.pop(node, None)
        return kept

    def verdict(self, node: str, job: str, kind: str, fault_id: str, now: float
                ) -> tuple[bool, str]:
        """May ``node`` be cordoned for this fault (reported for ``job``'s pod there)?
        (True, why) or (False, why not). A pod-sourced node-kind fault is remembered for
        the two-jobs rule and for a node agent's later confirmation."""
        if self.from_node_agent(fault_id, node):
            return True, f"node {node}'s agent reported it"
        if kind not in NODE_KINDS:
            return False, (f"a {kind or 'pod'} fault is the pod's own: node {node} stays "
                           "schedulable")
        agent = self._agent.get(node)
        if agent is not None and now - agent[0] < self.window and kind in agent[1]:
            return True, f"node {node}'s agent confirmed a {kind} fault"
        reports = self._fresh(node, now)
        if all(p.fault_id != fault_id for p in reports):
            reports.append(PodReport(now, job, kind, fault_id))
            self._pods[node] = reports[-MAX_PER_NODE:]
            self._pods.move_to_end(node)
            _bound(self._pods)
        jobs = {p.job for p in reports if p.kind == kind}
        if len(jobs) >= 2:
            return True, (f"{kind} faults on node {node} from {len(jobs)} jobs "
                          f"({', '.join(sorted(jobs)[:4])})")
        return False, (f"a {kind} fault reported by job {job}'s pod alone: node {node} stays "
                       "schedulable until its node agent or a second job's ranks there "
                       f"report it (within {self.window:.0f}s)")

    def confirmations(self, node: str, kinds: set[str], now: float) -> list[PodReport]:
        """Pod reports on ``node`` that a node agent's report of ``kinds`` now confirms
        (each returned once: the caller cordons)."""
        reports = self._fresh(node, now)
        confirmed = [p for p in reports if p.kind in kinds]
        if confirmed:
            rest = [p for p in reports if p.kind not in kinds]
            if rest:
                self._pods[node] = rest
            else:
                self._pods.pop(node, None)
        return confirmed


def _bound(d: OrderedDict[str, V]) -> None:
    while len(d) > MAX_NODES:
        d.popitem(last=False)
