"""Node and pod objects -> faults for the jobs on them. Pure: objects and a clock in,
values out; ``cluster.py`` feeds it the watches' events and hands the faults to
``Registry.report_fault``, so the policy decides them like any agent's fault.

Objects are the API's JSON (camelCase dicts, as the watch sends them; a client model goes
through ``ApiClient.sanitize_for_serialization`` first). A missing or odd field is read
as "not known", never an exception: what an API server sends is untrusted input.

What becomes a fault (every one is ``FaultKind.NODE``; the scope says what to act on):

=========================================== ==============================================
seen                                        fault
=========================================== ==============================================
node Ready False/Unknown for --node-        FATAL, scope NODE: the job's ranks there are
  notready-grace (from lastTransitionTime)    replaced, the node cordoned (actuator.py)
node deleted while ranks ran on it          FATAL, scope NODE, at once
pod gets DisruptionTarget=True              ERROR, scope POD: preempted / evicted / taint
  (preemption, eviction API, taint manager)   manager; replaced, the node is not cordoned
pod Failed with reason Evicted (kubelet)    ERROR, scope POD
pod deleted (deletionTimestamp or DELETED)  ERROR, scope POD (not when ftagent deleted it)
replacement pod Pending past --pending-     WARNING, scope POD: only recorded (and an
  grace after a REPLACE                       Event); the barrier timeout decides
=========================================== ==============================================
"""

from __future__ import annotations

import datetime as dt
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftagent.model import Fault, FaultKind, Scope, Severity

# Faults remembered per watch so that the same condition is reported once (bounded).
KEPT = 10_000
MAX_TEXT = 300  # characters of a reason/message taken from an object


@dataclass(frozen=True)
class ClusterFault:
    """A fault about a node or one pod; ``cluster.py`` maps it to jobs and ranks."""

    fault: Fault
    node: str = ""  # the node it is about (scope NODE), or the pod's node
    namespace: str = ""  # the pod's (scope POD)
    pod: str = ""
    uid: str = ""  # the pod's uid (scope POD)


def get(obj: Any, *path: str) -> Any:
    """``obj[path[0]][path[1]]...``, None where any step is missing or not a mapping."""
    for p in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(p)
    return obj


def text(v: Any, limit: int = MAX_TEXT) -> str:
    s = v if isinstance(v, str) else ""
    return s if len(s) <= limit else s[:limit] + "..."


def parse_time(v: Any) -> float | None:
    """RFC 3339 (``2024-05-01T10:00:00Z``, with fractions or an offset) -> epoch seconds."""
    if not isinstance(v, str) or not v or len(v) > 40:
        return None
    try:
        t = dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


def condition(obj: Any, kind: str) -> Mapping[str, Any] | None:
    conds = get(obj, "status", "conditions")
    if not isinstance(conds, list):
        return None
    for c in conds:
        if isinstance(c, Mapping) and c.get("type") == kind:
            return c
    return None


def name_of(obj: Any) -> str:
    return text(get(obj, "metadata", "name"), 253)


class _Once:
    """Keys already reported (bounded, oldest forgotten first)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, None] = OrderedDict()

    def first(self, key: str) -> bool:
        if key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > KEPT:
            self._seen.popitem(last=False)
        return True


@dataclass
class _NotReady:
    since: float
    status: str
    reason: str
    message: str
    key: str


@dataclass
class NodeFaults:
    """Node Ready condition -> a fault once it stays False/Unknown past ``grace``.

    ``observe`` on every node event, ``due`` on a tick (and right after ``observe``): a
    node that turns Ready again within the grace never becomes a fault.
    """

    grace: float
    _down: dict[str, _NotReady] = field(default_factory=dict)
    _once: _Once = field(default_factory=_Once)

    def observe(self, node: Any, now: float, deleted: bool = False) -> list[ClusterFault]:
        name = name_of(node)
        if not name:
            return []
        if deleted:
            self._down.pop(name, None)
            uid = text(get(node, "metadata", "uid"), 64)
            if not self._once.first(f"deleted:{name}:{uid}"):
                return []
            return [_node_fault(name, f"node {name} was deleted from the cluster",
                                {"node": name, "deleted": True}, f"node:{name}:{uid}:deleted")]
        ready = condition(node, "Ready")
        status = ready.get("status") if ready is not None else None
        if ready is None or status == "True":
            self._down.pop(name, None)
            return []
        if status not in ("False", "Unknown"):
            return []
        t = parse_time(ready.get("lastTransitionTime"))
        since = min(t, now) if t is not None else now
        prev = self._down.get(name)
        key = f"node:{name}:{ready.get('lastTransitionTime') or ''}"
        if prev is None or prev.key != key:
            if prev is not None and t is None:
                since, key = prev.since, prev.key  # no transition time: keep counting
            self._down[name] = _NotReady(since, str(status), text(ready.get("reason")),
                                         text(ready.get("message")), key)
        return self.due(now, only=name)

    def due(self, now: float, only: str | None = None) -> list[ClusterFault]:
        """Nodes NotReady for ``grace`` or longer, each reported once per transition."""
        out = []
        names = [only] if only is not None else list(self._down)
        for name in names:
            d = self._down.get(name)
            if d is None or now - d.since < self.grace or not self._once.first(d.key):
                continue
            why = f" ({d.reason}: {d.message})" if d.reason or d.message else ""
            msg = (f"node {name} not Ready (Ready={d.status}) for {now - d.since:.0f}s, "
                   f"past the {self.grace:.0f}s grace{why}")
            out.append(_node_fault(name, msg, {"node": name, "ready": d.status,
                                               "reason": d.reason, "since": d.since}, d.key))
        return out

    def down(self, name: str, key: str) -> float | None:
        """Since when ``name`` is NotReady, if still in the same transition ``key`` (the
        fault's id), else None (Ready again, deleted, or a newer transition)."""
        d = self._down.get(name)
        return d.since if d is not None and d.key == key else None

    def next_deadline(self) -> float | None:
        """When the earliest NotReady node passes its grace (None: none pending)."""
        times = [d.since + self.grace for d in self._down.values()]
        return min(times) if times else None


def _node_fault(name: str, msg: str, evidence: dict[str, Any], key: str) -> ClusterFault:
    return ClusterFault(Fault(FaultKind.NODE, msg, Severity.FATAL, Scope.NODE,
                              evidence=evidence, id=key), node=name)


# DisruptionTarget reasons (k8s.io/api/core/v1 PodReason*) in the users' words.
DISRUPTIONS = {
    "PreemptionByScheduler": "preempted by the scheduler for a higher-priority pod",
    "PreemptionByKubeScheduler": "preempted by the scheduler for a higher-priority pod",
    "EvictionByEvictionAPI": "evicted (Eviction API: a drain or an autoscaler)",
    "DeletionByTaintManager": "deleted by the taint manager (a NoExecute taint on its node)",
    "DeletionByPodGC": "deleted by the pod garbage collector (its node is gone)",
    "TerminationByKubelet": "terminated by the kubelet (node pressure or shutdown)",
}


@dataclass
class PodFaults:
    """Pod objects of running jobs -> faults: preempted, evicted, deleted.

    ``ours`` holds the uids of pods ftagent itself deleted (a REPLACE): their deletion is
    the action, not a new fault.
    """

    ours: _Once = field(default_factory=_Once)
    _once: _Once = field(default_factory=_Once)

    def deleted_by_us(self, uid: str) -> None:
        if uid:
            self.ours.first(uid)

    def observe(self, pod: Any, deleted: bool = False) -> list[ClusterFault]:
        name = name_of(pod)
        uid = text(get(pod, "metadata", "uid"), 64)
        if not name or not uid:
            return []
        ns = text(get(pod, "metadata", "namespace"), 63)
        node = text(get(pod, "spec", "nodeName"), 253)
        where = f"pod {ns + '/' if ns else ''}{name}" + (f" on node {node}" if node else "")
        dis = condition(pod, "DisruptionTarget")
        if dis is not None and dis.get("status") == "True":
            reason = text(dis.get("reason"))
            said = DISRUPTIONS.get(reason, f"disrupted ({reason or 'no reason given'})")
            extra = text(dis.get("message"))
            return self._pod(f"{uid}:disrupted", f"{where} {said}"
                             + (f": {extra}" if extra else ""), pod, name, ns, node, uid,
                             {"reason": reason, "disruption": True})
        if get(pod, "status", "phase") == "Failed" and get(pod, "status", "reason") == "Evicted":
            extra = text(get(pod, "status", "message"))
            return self._pod(f"{uid}:evicted", f"{where} evicted by the kubelet"
                             + (f": {extra}" if extra else ""), pod, name, ns, node, uid,
                             {"reason": "Evicted"})
        if deleted or get(pod, "metadata", "deletionTimestamp"):
            if uid in self.ours._seen:
                return []
            return self._pod(f"{uid}:deleted", f"{where} deleted while its job runs",
                             pod, name, ns, node, uid, {"reason": "Deleted"})
        return []

    def _pod(self, key: str, msg: str, pod: Any, name: str, ns: str, node: str, uid: str,
             evidence: dict[str, Any]) -> list[ClusterFault]:
        if uid in self.ours._seen or not self._once.first(uid):  # one fault per pod
            return []
        evidence = {**evidence, "pod": name, "namespace": ns, "node": node}
        f = Fault(FaultKind.NODE, msg, Severity.ERROR, Scope.POD, evidence=evidence,
                  id=f"pod:{key}")
        return [ClusterFault(f, node=node, namespace=ns, pod=name, uid=uid)]


def waits_for_a_node(pod: Any) -> bool:
    """A pod Pending that the scheduler has not placed (its PodScheduled condition is not
    True, or there is none yet): it waits for capacity, not for its own start-up (a pod
    scheduled but pulling its image is Pending too)."""
    if get(pod, "status", "phase") != "Pending" or get(pod, "metadata", "deletionTimestamp"):
        return False
    sched = condition(pod, "PodScheduled")
    return sched is None or sched.get("status") != "True"


def pending_fault(pod: Any, now: float, since: float, grace: float,
                  once: set[str] | None = None) -> ClusterFault | None:
    """A replacement pod still Pending ``grace`` seconds after ``since`` (the REPLACE):
    a WARNING saying why the scheduler cannot place it (its PodScheduled condition)."""
    if get(pod, "status", "phase") != "Pending" or now - since < grace:
        return None
    name, uid = name_of(pod), text(get(pod, "metadata", "uid"), 64)
    if not name or (once is not None and uid in once):
        return None
    if once is not None:
        once.add(uid)
    ns = text(get(pod, "metadata", "namespace"), 63)
    sched = condition(pod, "PodScheduled")
    why = ""
    if sched is not None and sched.get("status") != "True":
        why = f": {text(sched.get('reason')) or 'not scheduled'}"
        if sched.get("message"):
            why += f" ({text(sched.get('message'))})"
    msg = (f"replacement pod {ns + '/' if ns else ''}{name} still Pending {now - since:.0f}s "
           f"after the replace{why}")
    f = Fault(FaultKind.NODE, msg, Severity.WARNING, Scope.POD,
              evidence={"pod": name, "namespace": ns, "pending": True}, id=f"pod:{uid}:pending")
    return ClusterFault(f, namespace=ns, pod=name, uid=uid)


def terminal_status(pod: Any, trainer: str = "") -> int | None:
    """How a pod's trainer ended, from its terminal phase (the kubelet's word, read when
    its agent could not say it): 0 for ``Succeeded``; for ``Failed``, the ``trainer``
    container's ``state.terminated`` (``128 + signal`` when a signal is given, else its
    ``exitCode``), else the first container that terminated non-zero, else 1. None while
    the pod runs, and for a pod the cluster took away (evicted, a disruption, deleted):
    that is a fault the job recovers from (``PodFaults``), not how it ended."""
    phase = get(pod, "status", "phase")
    if phase == "Succeeded":
        return 0
    if phase != "Failed" or get(pod, "status", "reason") == "Evicted" or \
            get(pod, "metadata", "deletionTimestamp"):
        return None
    dis = condition(pod, "DisruptionTarget")
    if dis is not None and dis.get("status") == "True":
        return None
    statuses = get(pod, "status", "containerStatuses")
    codes: list[tuple[bool, int]] = []
    for st in statuses if isinstance(statuses, list) else []:
        done = get(st, "state", "terminated")
        code, sig = get(done, "exitCode"), get(done, "signal")
        if not isinstance(code, int) or isinstance(code, bool):
            continue
        if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < 128:
            code = 128 + sig
        codes.append((get(st, "name") == trainer and bool(trainer), max(0, min(code, 255))))
    mine = next((c for is_trainer, c in codes if is_trainer), None)
    if mine is not None:
        return mine
    return next((c for _, c in codes if c != 0), 1)
