"""Taint one DRA device instead of cordoning its node (KEP-5055, resource.k8s.io/v1
DeviceTaintRule, GA in 1.37): the scheduler keeps new claims off that device only, the
node's other devices stay schedulable. In a worker thread (an API call).

The rule's name is derived from (driver, pool, device), so a second fault on the same
device finds it there (409 AlreadyExists: done). ``Absent`` when the cluster does not
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


def taint_device(api_client: Any, driver: str, pool: str, device: str, reason: str,
                 fault_id: str, job: str) -> bool:
    """Create the rule (True), or find it there (False); Absent to fall back."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    body: Any = rule(driver, pool, device, reason, fault_id, job)
    try:
        client.ResourceV1Api(api_client).create_device_taint_rule(body, _request_timeout=10)
    except ApiException as e:
        if e.status == 409:
            return False
        if e.status in (403, 404, 405):
            raise Absent(f"DeviceTaintRule not writable ({e.status} {e.reason})") from None
        raise
    log.warning("tainted device %s/%s/%s (%s=device:NoSchedule) for job %s: %s", driver,
                pool, device, TAINT_KEY, job, reason)
    return True
