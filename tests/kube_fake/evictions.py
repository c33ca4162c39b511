"""The Eviction subresource (``POST pods/NAME/eviction``) with PodDisruptionBudget rules,
as ``pkg/registry/core/pod/storage/eviction.go`` and the disruption controller apply them:

* no PDB selects the pod: the pod is deleted (graceful), ``201`` with a Success Status;
* more than one PDB selects it: ``500`` ("more than one PodDisruptionBudget");
* the pod is not Ready and the PDB's ``unhealthyPodEvictionPolicy`` is ``AlwaysAllow``
  (or, with the default ``IfHealthyBudget``, the budget is met): evicted;
* otherwise ``disruptionsAllowed = currentHealthy - desiredHealthy`` where
  ``currentHealthy`` counts the selected pods that are Ready and not terminating,
  ``expectedPods`` the selected pods (the real controller asks the owner's scale; here the
  pods themselves stand for it) and ``desiredHealthy`` is ``minAvailable`` or
  ``expectedPods - maxUnavailable`` (integers or percentages, rounded up as the
  controller does); at 0 or less: ``429 TooManyRequests`` with the cause
  ``DisruptionBudget`` and the message the real server gives.

The fake computes the budget at each request instead of reading a controller-maintained
``status.disruptionsAllowed``: what the test sees is what the controller would have
written once it caught up.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ApiError
from .resources import Requirement, kind_for

Obj = dict[str, Any]


def _ready(pod: Obj) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])


def _selects(pdb: Obj, labels: dict[str, str]) -> bool:
    sel = pdb.get("spec", {}).get("selector") or {}
    reqs = [Requirement(k, "=", (v,)) for k, v in (sel.get("matchLabels") or {}).items()]
    for e in sel.get("matchExpressions") or []:
        op = {"In": "in", "NotIn": "notin", "Exists": "exists",
              "DoesNotExist": "!exists"}[e["operator"]]
        reqs.append(Requirement(e["key"], op, tuple(e.get("values") or ())))
    return bool(reqs) and all(r.matches(labels) for r in reqs)


def _count(value: Any, expected: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * expected / 100)
    return int(value)


def evict(store: Any, namespace: str, name: str, body: Any) -> Obj:
    """Answer one eviction: the Success Status, or raise the ApiError the server gives."""
    pods, pdbs = kind_for("pods"), kind_for("poddisruptionbudgets.policy")
    pod = store.get(pods, namespace, name)  # 404 as the real server
    labels = pod.get("metadata", {}).get("labels") or {}
    matching = [b for b in store.list_objects(pdbs, namespace, [], [], None, None, None,
                                              None)["items"] if _selects(b, labels)]
    if len(matching) > 1:
        raise ApiError(500, "InternalError", "This pod has more than one "
                       "PodDisruptionBudget, which the eviction subresource does not support.")
    if matching and not pod.get("metadata", {}).get("deletionTimestamp"):
        pdb = matching[0]
        spec = pdb.get("spec", {})
        always = spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow"
        if not (always and not _ready(pod)):
            selected = [p for p in store.list_objects(pods, namespace, [], [], None, None,
                                                      None, None)["items"]
                        if _selects(pdb, p.get("metadata", {}).get("labels") or {})]
            expected = len(selected)
            healthy = sum(1 for p in selected if _ready(p))
            if "minAvailable" in spec:
                desired = _count(spec["minAvailable"], expected)
            else:
                desired = expected - _count(spec.get("maxUnavailable", 0), expected)
            # a Ready pod needs a disruption to spare; an unready one (IfHealthyBudget)
            # only a budget that is met
            if (healthy - desired <= 0) if _ready(pod) else (healthy < desired):
                raise ApiError(
                    429, "TooManyRequests", "Cannot evict pod as it would violate the "
                    "pod's disruption budget.",
                    {"causes": [{"reason": "DisruptionBudget", "message": (
                        f"The disruption budget {pdb['metadata']['name']} needs {desired} "
                        f"healthy pods and has {healthy} currently")}]})
    grace = None
    if isinstance(body, dict) and isinstance(body.get("deleteOptions"), dict):
        grace = body["deleteOptions"].get("gracePeriodSeconds")
    store.delete(pods, namespace, name, grace, None)
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "code": 201}
