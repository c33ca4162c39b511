"""Field validation the real API server does on writes that the fake serves (422 Invalid
with the real field path and message). Only the rules for fields ftagent reads are here.

Pod status, ``status.containerStatuses[i].allocatedResourcesStatus[j]`` (KEP-4680, from
k8s.io/kubernetes pkg/apis/core/validation ``validateContainerStatusAllocatedResourcesStatus``):
``name`` must be one of the container's resource requests (limits default requests for
extended resources), or ``claim:<claim>`` / ``claim:<claim>/<request>`` for one of its
``resources.claims``, when the container is in the spec (a status for a container the spec
lacks is not checked: kubernetes/kubernetes#124915); each ``resources[k].health`` is
Healthy, Unhealthy or Unknown; ``resourceID`` unique within the entry.

Pod spec on create, container restart rules (KEP-5307 ``ContainerRestartRules``, KEP-5532
``RestartAllContainersOnContainerExits``; k8s.io/kubernetes ``validateContainerRestartPolicy``):
with ``ContainerRestartRules`` off, a container's ``restartPolicy`` and
``restartPolicyRules`` are dropped (disabled-gate fields are cleared on create); with it on,
a container with rules must set ``restartPolicy``, at most 20 rules, each with
``exitCodes`` ("must be specified"), operator In or NotIn, at most 255 values, and action
``Restart`` -- or ``RestartAllContainers`` only with that gate on.

DeviceTaintRule (resource.k8s.io/v1, ``validateDeviceTaint``): ``spec.taint.key``
required, ``spec.taint.effect`` one of None, NoSchedule, NoExecute; the same for each
taint of a ResourceSlice's device (``spec.devices[].taints[]``, at most 16 per device).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ApiError, Obj, details
from .resources import Kind

HEALTH = ("Healthy", "Unhealthy", "Unknown")


def _held(container: Obj) -> tuple[set[str], set[str]]:
    res = container.get("resources") or {}
    names = set(res.get("requests") or {}) | set(res.get("limits") or {})
    claims = set()
    for c in res.get("claims") or []:
        if isinstance(c, dict) and c.get("name"):
            claims.add(f"claim:{c['name']}" + (f"/{c['request']}" if c.get("request") else ""))
    return names, claims


def pod(kind: Kind, obj: Obj) -> None:
    """Raise the real server's 422 for an invalid pod (the rules above)."""
    if kind.plural != "pods" or kind.group:
        return
    specs = {c.get("name"): c for c in (obj.get("spec") or {}).get("containers") or []
             if isinstance(c, dict)}
    errs: list[str] = []
    for i, st in enumerate((obj.get("status") or {}).get("containerStatuses") or []):
        if not isinstance(st, dict):
            continue
        for j, e in enumerate(st.get("allocatedResourcesStatus") or []):
            path = f"status.containerStatuses[{i}].allocatedResourcesStatus[{j}]"
            name = str(e.get("name", ""))
            spec = specs.get(st.get("name"))
            if spec is not None:
                names, claims = _held(spec)
                if name.startswith("claim:") and name not in claims:
                    errs.append(f"{path}.name: Invalid value: {json.dumps(name)}: must match "
                                "one of the container's resource claims in a format "
                                "'claim:<claimName>/<request>' or 'claim:<claimName>' if "
                                "request is empty")
                elif not name.startswith("claim:") and name not in names:
                    errs.append(f"{path}.name: Invalid value: {json.dumps(name)}: must match "
                                "one of the container's resource requests")
            seen: set[Any] = set()
            for k, r in enumerate(e.get("resources") or []):
                if r.get("health") not in HEALTH:
                    errs.append(f"{path}.resources[{k}].health: Unsupported value: "
                                f"{json.dumps(r.get('health'))}: supported values: "
                                + ", ".join(f'"{h}"' for h in HEALTH))
                if r.get("resourceID") in seen:
                    errs.append(f"{path}.resources[{k}].resourceID: Duplicate value: "
                                f"{json.dumps(r.get('resourceID'))}")
                seen.add(r.get("resourceID"))
    if errs:
        name = (obj.get("metadata") or {}).get("name", "")
        msg = errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"
        raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: {msg}',
                       details(kind, name))


EFFECTS = ("None", "NoSchedule", "NoExecute")


def device_taint_rule(kind: Kind, obj: Obj) -> None:
    """Raise the real server's 422 for an invalid DeviceTaintRule's taint."""
    if kind.plural != "devicetaintrules":
        return
    taint = (obj.get("spec") or {}).get("taint") or {}
    name = (obj.get("metadata") or {}).get("name", "")
    errs = []
    if not taint.get("key"):
        errs.append("spec.taint.key: Required value")
    if taint.get("effect") not in EFFECTS:
        errs.append(f"spec.taint.effect: Unsupported value: {json.dumps(taint.get('effect'))}"
                    ": supported values: " + ", ".join(f'"{e}"' for e in EFFECTS))
    if errs:
        msg = errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"
        raise ApiError(422, "Invalid", f'DeviceTaintRule.resource.k8s.io "{name}" is invalid: '
                       f"{msg}", details(kind, name))


def resource_slice(kind: Kind, obj: Obj) -> None:
    """Raise the real server's 422 for an invalid device taint in a ResourceSlice
    (``validateDeviceTaint`` on ``spec.devices[i].taints[j]``: key required, effect one
    of None, NoSchedule, NoExecute; at most 16 taints per device)."""
    if kind.plural != "resourceslices":
        return
    name = (obj.get("metadata") or {}).get("name", "")
    errs = []
    for i, d in enumerate((obj.get("spec") or {}).get("devices") or []):
        taints = (d or {}).get("taints") or []
        if len(taints) > 16:
            errs.append(f"spec.devices[{i}].taints: Too many: {len(taints)}: must have at "
                        "most 16 items")
        for j, t in enumerate(taints[:64]):
            path = f"spec.devices[{i}].taints[{j}]"
            if not (t or {}).get("key"):
                errs.append(f"{path}.key: Required value")
            if (t or {}).get("effect") not in EFFECTS:
                errs.append(f"{path}.effect: Unsupported value: "
                            f"{json.dumps((t or {}).get('effect'))}: supported values: "
                            + ", ".join(f'"{e}"' for e in EFFECTS))
    if errs:
        msg = errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"
        raise ApiError(422, "Invalid", f'ResourceSlice.resource.k8s.io "{name}" is invalid: '
                       f"{msg}", details(kind, name))


GATES = ("ContainerRestartRules", "RestartAllContainersOnContainerExits")
POLICIES = ("Always", "OnFailure", "Never")


def pod_spec(kind: Kind, obj: Obj, gates: set[str]) -> None:
    """On a pod's create: drop the restart-rule fields of a disabled gate, or raise the
    real server's 422 for invalid rules (the rules above)."""
    if kind.plural != "pods" or kind.group:
        return
    containers = [c for c in (obj.get("spec") or {}).get("containers") or []
                  if isinstance(c, dict)]
    if "ContainerRestartRules" not in gates:
        for c in containers:
            c.pop("restartPolicy", None)
            c.pop("restartPolicyRules", None)
        return
    actions = ["Restart"] + (["RestartAllContainers"]
                             if "RestartAllContainersOnContainerExits" in gates else [])
    errs: list[str] = []
    for i, c in enumerate(containers):
        path = f"spec.containers[{i}]"
        rules = c.get("restartPolicyRules") or []
        policy = c.get("restartPolicy")
        if policy is not None and policy not in POLICIES:
            errs.append(f"{path}.restartPolicy: Unsupported value: {json.dumps(policy)}: "
                        "supported values: " + ", ".join(f'"{p}"' for p in POLICIES))
        if rules and policy is None:
            errs.append(f"{path}.restartPolicy: Required value: must specify restartPolicy "
                        "when restartPolicyRules are used")
        if len(rules) > 20:
            errs.append(f"{path}.restartPolicyRules: Too many: {len(rules)}: must have at "
                        "most 20 items")
        for j, r in enumerate(rules[:64]):
            rp = f"{path}.restartPolicyRules[{j}]"
            if r.get("action") not in actions:
                errs.append(f"{rp}.action: Unsupported value: {json.dumps(r.get('action'))}: "
                            "supported values: " + ", ".join(f'"{a}"' for a in actions))
            ec = r.get("exitCodes")
            if not isinstance(ec, dict):
                errs.append(f"{rp}.exitCodes: Required value: must be specified")
                continue
            if ec.get("operator") not in ("In", "NotIn"):
                errs.append(f"{rp}.exitCodes.operator: Unsupported value: "
                            f"{json.dumps(ec.get('operator'))}: supported values: \"In\", "
                            "\"NotIn\"")
            if len(ec.get("values") or []) > 255:
                errs.append(f"{rp}.exitCodes.values: Too many: {len(ec['values'])}: must "
                            "have at most 255 items")
    if errs:
        name = (obj.get("metadata") or {}).get("name", "")
        msg = errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"
        raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: {msg}', details(kind, name))
