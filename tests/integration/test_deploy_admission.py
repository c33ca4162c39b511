"""The arbiter's ValidatingAdmissionPolicies (deploy/components/arbiter/admission-policy.yaml),
rendered by the real ``kubectl kustomize``, validated against the Kubernetes schemas and
their CEL evaluated offline (cel-python) on the very writes the arbiter's actuator makes:
those pass, anything else it might be tricked or bugged into is denied. Before, RBAC alone
let the arbiter delete and patch any pod and update any node."""

from __future__ import annotations

import copy
import shutil
from typing import Any

import pytest

celpy = pytest.importorskip("celpy")

from ftagent.kube.actuator import _mark, _unmark  # noqa: E402
from tests.integration.test_deploy import index, kustomize, validate  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl (with kustomize) missing")
ARBITER = "system:serviceaccount:ml-infra:ftagent-arbiter"


def _policy(name: str) -> dict[str, Any]:
    objs = index(kustomize("deploy"))
    pol = objs[("ValidatingAdmissionPolicy", name)]
    binding = objs[("ValidatingAdmissionPolicyBinding", name)]
    validate(pol)
    validate(binding)
    assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}
    return pol["spec"]


def _run(expr: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    prog = env.program(env.compile(expr))
    return prog.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})


def admitted(name: str, op: str, old: Any, new: Any, user: str = ARBITER) -> bool:
    """Would the API server admit this write under the policy (True also when the policy
    does not match the request)?"""
    spec = _policy(name)
    request = {"operation": op, "userInfo": {"username": user, "extra": {}}}
    act = {"object": new, "oldObject": old, "request": request}
    if not all(bool(_run(c["expression"], act)) for c in spec["matchConditions"]):
        return True
    return all(bool(_run(v["expression"], act)) for v in spec["validations"])


POD = {"metadata": {"name": "llm-0", "namespace": "team", "labels": {"ftagent.io/job": "llm"},
                    "annotations": {"kubectl.kubernetes.io/default-container": "trainer"}},
       "spec": {"nodeName": "n1", "containers": [{"name": "trainer", "image": "t"}]}}
NODE = {"metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "n1"},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"podCIDR": "10.0.1.0/24", "taints": [
            {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]}}


def test_the_arbiter_deletes_and_annotates_only_pods_of_ftagent_jobs() -> None:
    p = "ftagent-arbiter-pods"
    assert admitted(p, "DELETE", POD, None)
    other = copy.deepcopy(POD)
    del other["metadata"]["labels"]["ftagent.io/job"]
    assert not admitted(p, "DELETE", other, None)  # coredns, another tenant's pod
    assert admitted(p, "DELETE", other, None, user="system:serviceaccount:kube-system:gc")
    noted = copy.deepcopy(POD)
    noted["metadata"]["annotations"]["ftagent.io/state"] = "restarting"  # annotate_pod
    assert admitted(p, "UPDATE", POD, noted)
    for path, value in ((("metadata", "labels", "app"), "x"),
                        (("metadata", "annotations", "kubectl.kubernetes.io/default-container"),
                         "sidecar"),
                        (("spec", "nodeName"), "n2")):
        bad = copy.deepcopy(noted)
        obj = bad
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
        assert not admitted(p, "UPDATE", POD, bad), path
    gone = copy.deepcopy(POD)
    del gone["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"]
    assert not admitted(p, "UPDATE", POD, gone)


def test_the_arbiter_changes_only_the_node_fields_it_writes() -> None:
    p = "ftagent-arbiter-nodes"
    cordoned = copy.deepcopy(NODE)
    assert _mark(cordoned, "gpu", "Xid 79", "f1", "team/llm", "2026-01-01T00:00:00Z",
                 "node-agent")
    assert admitted(p, "UPDATE", NODE, cordoned)  # actuator.cordon's write
    again = copy.deepcopy(cordoned)
    assert _unmark(again)
    assert admitted(p, "UPDATE", cordoned, again)  # actuator.uncordon's write
    changes = [
        lambda n: n["spec"]["taints"].pop(0),  # another taint removed
        lambda n: n["spec"]["taints"].append({"key": "x", "effect": "NoExecute"}),
        lambda n: n["spec"].__setitem__("podCIDR", "10.9.9.0/24"),
        lambda n: n["metadata"]["labels"].__setitem__("node-role.kubernetes.io/x", ""),
        lambda n: n["metadata"]["annotations"].pop("node.alpha.kubernetes.io/ttl"),
    ]
    for i, change in enumerate(changes):
        bad = copy.deepcopy(cordoned)
        change(bad)
        assert not admitted(p, "UPDATE", NODE, bad), i
