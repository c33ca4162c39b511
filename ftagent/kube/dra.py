"""DRA device taints on ResourceSlices (KEP-5055, resource.k8s.io/v1) -> a fault for the
rank whose pod holds the tainted device. Pure: slices, claims and pods in, faults out;
``cluster.py`` feeds it the ResourceSlice, ResourceClaim and pod watches.

A DRA driver (NVIDIA's turns an XID or a lost GPU into one) publishes a device's taint in
its ResourceSlice::

    spec: {driver: gpu.nvidia.com, pool: {name: node-2, ...},
           devices: [{name: gpu-3, taints: [{key: gpu.nvidia.com/xid, value: "79",
                                             effect: NoSchedule}]}]}

and the scheduler's allocation of a pod's claim is in the ResourceClaim's status::

    status: {allocation: {devices: {results: [{request: gpu, driver: gpu.nvidia.com,
                                               pool: node-2, device: gpu-3}]}},
             reservedFor: [{resource: pods, name: llm-worker-2, uid: ...}]}

The pod names its claims in ``spec.resourceClaims[].resourceClaimName`` or, for a
template's, ``status.resourceClaimStatuses[].resourceClaimName`` (its own namespace).

Both come from the driver and the scheduler through the API server, not from the pod:
evidence a pod cannot forge, node-scope (the device is replaced by tainting it, not by
cordoning its node). Read defensively all the same:

* a device counts for a pod only when a claim of the pod's namespace, named by the pod,
  is allocated to it and *reserved for that pod's uid* (``status.reservedFor``): a taint
  on a device of another job (or a claim another pod holds) is never acted on;
* only the effects that keep or take work off the device (NoSchedule, NoExecute) are a
  fault; ``None`` (a dry run, KEP-5055) and effects this version does not know are
  nothing ("consumers must treat unknown effects like None");
* ftagent's own taint key is never evidence (no loop on its own action);
* one fault per pod (its uid); bounded: ``MAX_DEVICES`` devices per slice,
  ``MAX_TAINTS`` taints per device, ``MAX_CLAIMS`` claims per pod, ``MAX_RESULTS``
  allocation results per claim, ``MAX_SLICES`` / ``MAX_CLAIMS_KEPT`` objects remembered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftagent.kube.cluster_faults import ClusterFault, _Once, get, name_of, text
from ftagent.kube.device_taint import TAINT_KEY
from ftagent.model import Fault, FaultKind, Scope, Severity

MAX_DEVICES = 1024  # devices per slice (the API server's own limit is 128/slice today)
MAX_TAINTS = 16  # taints per device (the API server allows 16; 4 before 1.35)
MAX_CLAIMS = 32  # claims per pod
MAX_RESULTS = 64  # allocation results per claim
MAX_SLICES = 100_000
MAX_CLAIMS_KEPT = 100_000
ACTING = ("NoSchedule", "NoExecute")  # effects that are a fault; None is a dry run

Dev = tuple[str, str, str]  # (driver, pool, device), as a DeviceTaintRule selects it


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else \
            f"{self.key}:{self.effect}"


def slice_taints(sl: Any) -> dict[Dev, Taint]:
    """The devices of one ResourceSlice that carry an acting taint (not ftagent's own):
    the first such taint of each."""
    driver = text(get(sl, "spec", "driver"), 63)
    pool = text(get(sl, "spec", "pool", "name"), 253)
    devices = get(sl, "spec", "devices")
    if not driver or not pool or not isinstance(devices, list):
        return {}
    out: dict[Dev, Taint] = {}
    for d in devices[:MAX_DEVICES]:
        if not isinstance(d, Mapping) or not isinstance(d.get("name"), str):
            continue
        taints = d.get("taints")
        if not isinstance(taints, list):
            continue
        for t in taints[:MAX_TAINTS]:
            if not isinstance(t, Mapping):
                continue
            key, effect = text(t.get("key"), 316), t.get("effect")
            if key and key != TAINT_KEY and effect in ACTING:
                out[(driver, pool, text(d["name"], 128))] = Taint(
                    key, text(t.get("value"), 63), str(effect))
                break
    return out


@dataclass(frozen=True)
class Claim:
    """What the arbiter keeps of a ResourceClaim: whom it is reserved for, what it got."""

    reserved: frozenset[str]  # pod uids in status.reservedFor
    devices: tuple[Dev, ...]  # status.allocation.devices.results


def claim_of(obj: Any) -> Claim:
    reserved = get(obj, "status", "reservedFor")
    uids = frozenset(text(r.get("uid"), 64) for r in (reserved or [])[:MAX_CLAIMS]
                     if isinstance(r, Mapping) and r.get("resource") == "pods"
                     and not r.get("apiGroup") and isinstance(r.get("uid"), str)) \
        if isinstance(reserved, list) else frozenset()
    results = get(obj, "status", "allocation", "devices", "results")
    devs: list[Dev] = []
    if isinstance(results, list):
        for r in results[:MAX_RESULTS]:
            if isinstance(r, Mapping) and all(isinstance(r.get(k), str) and r.get(k)
                                              for k in ("driver", "pool", "device")):
                devs.append((text(r["driver"], 63), text(r["pool"], 253),
                             text(r["device"], 128)))
    return Claim(uids, tuple(devs))


def pod_claims(pod: Any) -> list[str]:
    """The names of the ResourceClaims (in the pod's namespace) the pod uses."""
    names: list[str] = []
    for c in (get(pod, "spec", "resourceClaims") or [])[:MAX_CLAIMS]:
        if isinstance(c, Mapping) and isinstance(c.get("resourceClaimName"), str):
            names.append(text(c["resourceClaimName"], 253))
    for c in (get(pod, "status", "resourceClaimStatuses") or [])[:MAX_CLAIMS]:
        if isinstance(c, Mapping) and isinstance(c.get("resourceClaimName"), str):
            names.append(text(c["resourceClaimName"], 253))
    return list(dict.fromkeys(n for n in names if n))


@dataclass
class DraTaints:
    """The watches' slices and claims; ``observe(pod)`` -> one fault per pod of a running
    job whose allocated device carries an acting taint."""

    _slices: dict[str, dict[Dev, Taint]] = field(default_factory=dict)  # slice -> taints
    _claims: dict[tuple[str, str], Claim] = field(default_factory=dict)
    _once: _Once = field(default_factory=_Once)

    def on_slice(self, type_: str, sl: Any) -> bool:
        """A ResourceSlice event; True when the tainted devices changed."""
        name = name_of(sl)
        if not name:
            return False
        old = self._slices.get(name)
        new = {} if type_ == "DELETED" else slice_taints(sl)
        if new:
            if name in self._slices or len(self._slices) < MAX_SLICES:
                self._slices[name] = new
        else:
            self._slices.pop(name, None)
        return bool(new) and new != old

    def on_claim(self, type_: str, obj: Any) -> frozenset[str]:
        """A ResourceClaim event: the uids of the pods it is now reserved for when what it
        holds changed (those pods are looked at again, no others), else none."""
        ns, name = text(get(obj, "metadata", "namespace"), 63), name_of(obj)
        if not ns or not name:
            return frozenset()
        key = (ns, name)
        if type_ == "DELETED":
            self._claims.pop(key, None)
            return frozenset()
        c = claim_of(obj)
        changed = self._claims.get(key) != c
        if key in self._claims or len(self._claims) < MAX_CLAIMS_KEPT:
            self._claims[key] = c
        return c.reserved if changed and c.devices else frozenset()

    def taint_of(self, dev: Dev) -> Taint | None:
        for taints in self._slices.values():
            t = taints.get(dev)
            if t is not None:
                return t
        return None

    def held(self, pod: Any) -> list[Dev]:
        """The devices the pod holds: its claims' allocations reserved for its uid."""
        ns = text(get(pod, "metadata", "namespace"), 63)
        uid = get(pod, "metadata", "uid")
        if not ns or not isinstance(uid, str) or not uid:
            return []
        out: list[Dev] = []
        for name in pod_claims(pod):
            c = self._claims.get((ns, name))
            if c is not None and uid in c.reserved:
                out.extend(c.devices)
        return list(dict.fromkeys(out))

    def observe(self, pod: Any) -> list[ClusterFault]:
        """The fault for ``pod`` when a device it holds is tainted (once per pod)."""
        if not self._slices:
            return []
        name = name_of(pod)
        uid = text(get(pod, "metadata", "uid"), 64)
        if not name or not uid or get(pod, "metadata", "deletionTimestamp"):
            return []
        bad = [(d, t) for d in self.held(pod) if (t := self.taint_of(d)) is not None]
        if not bad or not self._once.first(uid):
            return []
        ns = text(get(pod, "metadata", "namespace"), 63)
        node = text(get(pod, "spec", "nodeName"), 253)
        (driver, pool, device), taint = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        where = f"pod {ns}/{name}" + (f" on node {node}" if node else "")
        msg = (f"{where}: DRA device {driver}/{pool}/{device} tainted {taint} in its "
               f"ResourceSlice{more}")
        evidence = {"dra_taint": True, "pod": name, "namespace": ns, "node": node,
                    "taint": str(taint), "dra": [list(d) for d, _ in bad[:16]]}
        f = Fault(FaultKind.NODE, msg, Severity.FATAL, Scope.NODE, evidence=evidence,
                  id=f"pod:{uid}:dra-taint")
        return [ClusterFault(f, node=node, namespace=ns, pod=name, uid=uid)]


__all__ = ["ACTING", "Claim", "DraTaints", "Taint", "claim_of", "pod_claims",
           "slice_taints"]
