"""Device health in pod status (KEP-4680) -> a fault for the rank whose pod holds the
device. Pure: a pod object in, faults out; ``cluster.py`` feeds it the pod watch.

The kubelet writes ``status.containerStatuses[].allocatedResourcesStatus[]``::

    {"name": "nvidia.com/gpu",                 # a resource of the container's spec, or
                                               # "claim:<claim>[/<request>]" (DRA)
     "resources": [{"resourceID": "GPU-8f1c...", "health": "Unhealthy",
                    "message": "ECC error count exceeded threshold"}]}

(``health``: Healthy | Unhealthy | Unknown; ``message`` only with the
ResourceHealthStatusMessage gate). It comes from the kubelet through the API server, not
from the pod: evidence a pod cannot forge, so an Unhealthy device is node-scope (its pod
is replaced, the node may be cordoned under the breaker) and needs no NVML in the pod.

Read defensively all the same (an older API server, a status written by something else):

* an entry counts only when it names a device the container holds -- a resource in its
  ``resources.limits``/``requests`` or one of its ``resources.claims`` (the API server's
  own validation rule) -- of a container the pod's spec has; anything else is ignored
  with its reason (``ignored``), never acted on;
* Unknown is not Unhealthy (a device plugin re-registering): nothing;
* one fault per pod (its uid): a device flapping Healthy/Unhealthy every second while the
  replacement is under way is decided once; the pod is replaced, the new pod is judged
  afresh. Bounded: at most ``MAX_CONTAINERS`` containers, ``MAX_ENTRIES`` entries and
  ``MAX_DEVICES`` devices each are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftagent.kube.cluster_faults import ClusterFault, _Once, get, name_of, text
from ftagent.model import Fault, FaultKind, Scope, Severity

MAX_CONTAINERS = 32
MAX_ENTRIES = 32
MAX_DEVICES = 128
HEALTH = ("Healthy", "Unhealthy", "Unknown")


@dataclass(frozen=True)
class BadDevice:
    """One Unhealthy device a container of the pod holds."""

    container: str
    resource: str  # the resource name or "claim:<claim>[/<request>]"
    device: str  # resourceID
    message: str = ""

    @property
    def dra(self) -> tuple[str, str, str] | None:
        """(driver, pool, device) of a DRA device (a ``claim:`` resource, whose
        resourceID the kubelet writes as ``<driver>/<pool>/<device>``), else None."""
        if not self.resource.startswith("claim:"):
            return None
        parts = self.device.split("/")
        if len(parts) != 3 or not all(parts):
            return None
        return parts[0], parts[1], parts[2]


def held(container: Mapping[str, Any]) -> set[str]:
    """The resource names a spec container holds, as ``allocatedResourcesStatus[].name``
    must spell them: its requests and limits (limits default requests for extended
    resources) and ``claim:<name>`` or ``claim:<name>/<request>`` per resources.claims."""
    res = container.get("resources")
    if not isinstance(res, Mapping):
        return set()
    out: set[str] = set()
    for part in ("requests", "limits"):
        got = res.get(part)
        if isinstance(got, Mapping):
            out.update(k for k in list(got)[:MAX_ENTRIES] if isinstance(k, str))
    claims = res.get("claims")
    if isinstance(claims, list):
        for c in claims[:MAX_ENTRIES]:
            if isinstance(c, Mapping) and isinstance(c.get("name"), str):
                req = c.get("request")
                out.add(f"claim:{c['name']}" + (f"/{req}" if isinstance(req, str) and req
                                                  else ""))
    return out


def unhealthy(pod: Any) -> tuple[list[BadDevice], list[str]]:
    """(Unhealthy devices the pod's containers hold, reasons entries were ignored)."""
    specs = get(pod, "spec", "containers")
    statuses = get(pod, "status", "containerStatuses")
    if not isinstance(specs, list) or not isinstance(statuses, list):
        return [], []
    by_name = {c.get("name"): c for c in specs[:MAX_CONTAINERS] if isinstance(c, Mapping)}
    bad: list[BadDevice] = []
    ignored: list[str] = []
    for st in statuses[:MAX_CONTAINERS]:
        if not isinstance(st, Mapping):
            continue
        entries = st.get("allocatedResourcesStatus")
        if not isinstance(entries, list) or not entries:
            continue
        cname = text(st.get("name"), 63)
        spec = by_name.get(cname)
        holds = held(spec) if isinstance(spec, Mapping) else set()
        for e in entries[:MAX_ENTRIES]:
            if not isinstance(e, Mapping):
                continue
            rname = text(e.get("name"), 253)
            devs = e.get("resources")
            if not isinstance(devs, list):
                continue
            sick = [d for d in devs[:MAX_DEVICES] if isinstance(d, Mapping)
                    and d.get("health") == "Unhealthy"]
            if not sick:
                continue
            if spec is None:
                ignored.append(f"container {cname!r} is not in the pod's spec")
                continue
            if rname not in holds:
                ignored.append(f"container {cname} does not hold {rname!r} (not among its "
                               "resources or claims)")
                continue
            for d in sick:
                bad.append(BadDevice(cname, rname, text(d.get("resourceID"), 128),
                                     text(d.get("message"))))
    return bad, ignored


@dataclass
class DeviceHealth:
    """Pods of running jobs -> one fault per pod whose held device turned Unhealthy."""

    _once: _Once = field(default_factory=_Once)
    _ignored: _Once = field(default_factory=_Once)

    def observe(self, pod: Any) -> tuple[list[ClusterFault], list[str]]:
        """(faults, reasons newly ignored: each said once per pod and reason)."""
        name = name_of(pod)
        uid = text(get(pod, "metadata", "uid"), 64)
        if not name or not uid or get(pod, "metadata", "deletionTimestamp"):
            return [], []
        bad, ignored = unhealthy(pod)
        said = [w for w in ignored if self._ignored.first(f"{uid}:{w}")]
        if not bad or not self._once.first(uid):
            return [], said
        ns = text(get(pod, "metadata", "namespace"), 63)
        node = text(get(pod, "spec", "nodeName"), 253)
        first = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        why = f": {first.message}" if first.message else ""
        where = f"pod {ns + '/' if ns else ''}{name}" + (f" on node {node}" if node else "")
        msg = (f"{where}: device {first.device or '?'} ({first.resource}, container "
               f"{first.container}) reported Unhealthy by the kubelet{why}{more}")
        evidence = {"device_health": True, "pod": name, "namespace": ns, "node": node,
                    "devices": [{"container": b.container, "resource": b.resource,
                                 "device": b.device} for b in bad[:16]],
                    # every one a DRA device: the arbiter taints them, not the node
                    "dra": [list(d) for b in bad[:16] if (d := b.dra) is not None]
                    if all(b.dra is not None for b in bad) else []}
        f = Fault(FaultKind.NODE, msg, Severity.FATAL, Scope.NODE, evidence=evidence,
                  id=f"pod:{uid}:device-unhealthy")
        return [ClusterFault(f, node=node, namespace=ns, pod=name, uid=uid)], said


__all__ = ["BadDevice", "DeviceHealth", "HEALTH", "held", "unhealthy"]
