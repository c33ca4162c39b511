"""Taint one DRA device instead of cordoning its node (KEP-5055, resource.k8s.io/v1
DeviceTaintRule, GA in 1.37): the scheduler keeps new claims off that device only, the
node's other devices stay schedulable. In a worker thread (an API call).

The rule's name is derived from (driver, pool, device), so a second fault on the same
device finds it there (409 AlreadyExists: done, once its effect acts).

Staged (``stage``): the rule is created with effect ``None`` first -- KEP-5055's dry run:
the API server validates the rule and its selector, the taint controller reports in the
rule's status what it would affect, nothing is kept off the device yet -- and only then
its effect is set to ``NoSchedule`` (an update of the rule just made, with its
resourceVersion). A cluster that refuses the rule at the first step loses nothing. The
caller (``cluster.py``) asked the cordon breaker first: a tainted device costs what a
cordoned node costs there. ``Absent`` when the cluster does not
serve DeviceTaintRules (404: an older version, the API not enabled) or forbids it (403):
the caller falls back to the node's cordon, under the breaker.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

log = logging.getLogger("ftagent.kube.device_taint")

TAINT_KEY = "ftagent.io/fault"


class Absent(Exception):
    """DeviceTaintRules cannot be written here (not served, or forbidden)."""


def device_key(driver: str, pool: str, device: str) -> str:
    """The device's name in the cordon breaker (beside the nodes it holds)."""
    return f"device {driver}/{pool}/{device}"


def rule_name(driver: str, pool: str, device: str) -> str:
    digest = hashlib.sha256(f"{driver}/{pool}/{device}".encode()).hexdigest()[:16]
    return f"ftagent-{digest}"


def rule(driver: str, pool: str, device: str, reason: str, fault_id: str, job: str,
         effect: str = "NoSchedule") -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": {"name": rule_name(driver, pool, device),
                         "labels": {"app.kubernetes.io/managed-by": "ftagent"},
                         "annotations": {"ftagent.io/fault": reason[:1000],
                                         "ftagent.io/fault-id": fault_id[:200],
                                         "ftagent.io/fault-job": job[:300]}},
            "spec": {"deviceSelector": {"driver": driver, "pool": pool, "device": device},
                     "taint": {"key": TAINT_KEY, "value": "device", "effect": effect}}}


DRY_RUN = "None"
EFFECT = "NoSchedule"


def taint_device(api_client: Any, driver: str, pool: str, device: str, reason: str,
                 fault_id: str, job: str, stage: bool = True) -> bool:
    """Create the rule (True), or find it there already acting (False); Absent to fall
    back. ``stage``: effect None first (the dry run), then NoSchedule."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    api = client.ResourceV1Api(api_client)
    name = rule_name(driver, pool, device)
    body: Any = rule(driver, pool, device, reason, fault_id, job,
                     effect=DRY_RUN if stage else EFFECT)
    try:
        api.create_device_taint_rule(body, _request_timeout=10)
    except ApiException as e:
        if e.status in (403, 404, 405):
            raise Absent(f"DeviceTaintRule not writable ({e.status} {e.reason})") from None
        if e.status != 409:
            raise
        if not stage:
            return False
        # there already: a dry run left by a predecessor is carried on, an acting one kept
    if stage and not _act(api, name):
        return False
    log.warning("tainted device %s/%s/%s (%s=device:%s) for job %s: %s", driver, pool,
                device, TAINT_KEY, EFFECT, job, reason)
    return True


def _act(api: Any, name: str) -> bool:
    """The dry run's rule ``name`` set to NoSchedule (True), or found acting (False)."""
    from kubernetes.client.exceptions import ApiException

    for _ in range(3):  # a conflict (someone wrote it between): read again
        got = api.read_device_taint_rule(name, _request_timeout=10).to_dict(serialize=True)
        taint = (got.get("spec") or {}).get("taint") or {}
        if taint.get("effect") in ("NoSchedule", "NoExecute"):
            return False
        got.pop("status", None)  # the main resource: status is the controller's
        got["spec"]["taint"] = {**{k: v for k, v in taint.items() if v is not None},
                                "effect": EFFECT}
        try:
            api.replace_device_taint_rule(name, got, _request_timeout=10)
            return True
        except ApiException as e:
            if e.status != 409:
                raise
    raise RuntimeError(f"DeviceTaintRule {name}: conflicts on every update")
