"""When a fault is the node's and not one pod's: the evidence a cordon needs. Pure.

A pod agent runs beside user code (the trainer) and speaks only for its pod: a GPU or NIC
fault it reports replaces that pod, but by itself never cordons the node, which other
tenants share. Anyone who may create pods in one namespace can run several "jobs" there,
so two jobs agreeing proves nothing. A node is cordoned only on evidence a pod cannot
forge:

* the API server's own view (the node watch: NotReady past the grace; ``cluster_faults``);
* a report of the node's own agent (``ftagent node``, verified: its token is bound to a pod
  on that node), for that node;
* a pod agent's GPU or NIC fault that the node agent confirms within ``window`` (before or
  after the pod's report: a later node report cordons the node then, ``confirmations``);
* corroboration: the same kind of node-scope fault on that node within ``window`` from pods
  of at least two distinct namespaces *and* two distinct ServiceAccounts (a ServiceAccount
  is ``namespace/name``: Kubernetes scopes it to its namespace). Each namespace may take
  part in at most ``per_namespace`` corroborated cordons per ``namespace_window`` (an
  hour): a tenant who holds two namespaces still cannot walk through the cluster.

Everything else (one pod alone, one namespace's many jobs, a crash, a hang, a straggler)
replaces the pod and leaves the node schedulable, and the Event says why.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TypeVar

V = TypeVar("V")

WINDOW = 300.0
NODE_KINDS = frozenset({"gpu", "nic"})  # what a pod can see of its node
MAX_NODES = 50_000  # nodes with evidence kept (oldest dropped first)
MAX_PER_NODE = 64
PER_NAMESPACE = 2  # corroborated cordons a namespace may take part in per namespace_window
NAMESPACE_WINDOW = 3600.0
MAX_NAMESPACES = 50_000


@dataclass(frozen=True)
class PodReport:
    at: float
    job: str
    kind: str
    fault_id: str
    namespace: str = ""
    account: str = ""  # the pod's ServiceAccount (spec.serviceAccountName), as the watch sees it


class NodeEvidence:
    def __init__(self, window: float = WINDOW, per_namespace: int = PER_NAMESPACE,
                 namespace_window: float = NAMESPACE_WINDOW) -> None:
        self.window = window
        self.per_namespace = per_namespace
        self.namespace_window = namespace_window
        self._agent: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()
        self._agent_ids: OrderedDict[str, str] = OrderedDict()  # fault id -> node
        self._pods: OrderedDict[str, list[PodReport]] = OrderedDict()
        # namespace -> times it took part in a corroborated cordon (its rate limit)
        self._spent: OrderedDict[str, deque[float]] = OrderedDict()

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

    def agent_confirms(self, node: str, kind: str, now: float) -> bool:
        """Did ``node``'s own agent report a ``kind`` fault within the window?"""
        agent = self._agent.get(node)
        return agent is not None and now - agent[0] < self.window and kind in agent[1]

    def _fresh(self, node: str, now: float) -> list[PodReport]:
        kept = [p for p in self._pods.get(node, ()) if now - p.at < self.window]
        if kept:
            self._pods[node] = kept[-MAX_PER_NODE:]
        else:
            self._pods.pop(node, None)
        return kept

    def _spent_by(self, namespace: str, now: float) -> int:
        times = self._spent.get(namespace)
        while times and now - times[0] >= self.namespace_window:
            times.popleft()
        if times is not None and not times:
            del self._spent[namespace]
            return 0
        return len(times) if times else 0

    def _spend(self, namespace: str, now: float) -> None:
        self._spent.setdefault(namespace, deque()).append(now)
        self._spent.move_to_end(namespace)
        while len(self._spent) > MAX_NAMESPACES:
            self._spent.popitem(last=False)

    def verdict(self, node: str, job: str, kind: str, fault_id: str, now: float,
                namespace: str = "", account: str = "") -> tuple[bool, str]:
        """May ``node`` be cordoned for this fault (reported for ``job``'s pod there, which
        runs in ``namespace`` as ServiceAccount ``account``)? (True, why) or (False, why
        not). A pod-sourced node-kind fault is remembered for corroboration and for a node
        agent's later confirmation."""
        if self.from_node_agent(fault_id, node):
            return True, f"node {node}'s agent reported it"
        if kind not in NODE_KINDS:
            return False, (f"a {kind or 'pod'} fault is the pod's own: node {node} stays "
                           "schedulable")
        if self.agent_confirms(node, kind, now):
            return True, f"node {node}'s agent confirmed a {kind} fault"
        reports = self._fresh(node, now)
        if all(p.fault_id != fault_id for p in reports):
            reports.append(PodReport(now, job, kind, fault_id, namespace, account))
            self._pods[node] = reports[-MAX_PER_NODE:]
            self._pods.move_to_end(node)
            _bound(self._pods)
        # one voice per namespace, and only namespaces still within their rate
        voices: dict[str, PodReport] = {}
        limited: set[str] = set()
        for p in reports:
            if p.kind != kind or not p.namespace or p.namespace in voices:
                continue
            if self._spent_by(p.namespace, now) >= self.per_namespace:
                limited.add(p.namespace)
                continue
            voices[p.namespace] = p
        accounts = {f"{p.namespace}/{p.account}" for p in voices.values() if p.account}
        if len(voices) >= 2 and len(accounts) >= 2:
            for ns in voices:
                self._spend(ns, now)
            return True, (f"{kind} faults on node {node} from {len(voices)} namespaces "
                          f"({', '.join(sorted(voices)[:4])}) and {len(accounts)} "
                          "ServiceAccounts")
        why = ""
        if namespace in limited:
            why = (f"; namespace {namespace} already took part in {self.per_namespace} "
                   f"corroborated cordons within {self.namespace_window / 60:.0f} min")
        return False, (f"a {kind} fault reported by pods of namespace {namespace or '?'} "
                       f"alone (job {job}): node {node} stays schedulable until its node "
                       "agent reports it or pods of another namespace and ServiceAccount "
                       f"there do (within {self.window:.0f}s){why}")

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
