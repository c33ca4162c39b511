"""deploy/: the alert rules are valid and behave as their unit tests say (promtool); the
kustomize base and every overlay build (real kubectl kustomize) and every object validates
against the Kubernetes schemas offline; RBAC without wildcards; the examples validate."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.conftest import ROOT
from tests.webhook_pods import EXAMPLES, load_all

RULES = ROOT / "deploy" / "prometheus"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool missing: `make deps` installs Debian's prometheus package")


@needs_promtool
def test_rules_are_valid() -> None:
    r = subprocess.run(["promtool", "check", "rules", str(RULES / "ftagent-rules.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_rules_unit_tests_pass() -> None:
    r = subprocess.run(["promtool", "test", "rules", "ftagent-rules.test.yaml"],
                       cwd=RULES, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------ kustomize, schemas

KUSTOMIZATIONS = ["deploy", "deploy/overlays/cert-manager", "deploy/overlays/monitoring",
                  "deploy/overlays/node"]
K8S_VERSION = "1.32"
# Custom resources with no schema in the Kubernetes release: checked for shape, and the pod
# templates inside them are validated as PodTemplateSpecs.
CUSTOM_KINDS = {"Certificate", "Issuer", "PodMonitor", "ServiceMonitor", "PrometheusRule"}

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl (with kustomize) missing")


def kustomize(path: str) -> list[dict[str, Any]]:
    r = subprocess.run(["kubectl", "kustomize", str(ROOT / path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def validate(obj: dict[str, Any]) -> None:
    if obj["kind"] in CUSTOM_KINDS:
        assert obj["apiVersion"].count("/") == 1 and obj["metadata"]["name"]
        return
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomization_builds_and_validates(path: str) -> None:
    objs = kustomize(path)
    assert objs
    for obj in objs:
        validate(obj)
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "Deployment", "Service", "PodDisruptionBudget",
            "MutatingWebhookConfiguration"} <= kinds


@needs_kubectl
def test_rbac_is_least_privilege() -> None:
    for path in KUSTOMIZATIONS:
        for obj in kustomize(path):
            for rule in obj.get("rules", []) if obj["kind"] in ("Role", "ClusterRole") else []:
                for key in ("verbs", "resources", "apiGroups"):
                    assert "*" not in rule.get(key, []), (path, obj["metadata"]["name"])
                assert set(rule["verbs"]) <= {"get", "list", "watch", "create", "update",
                                              "patch", "delete"}
    objs = {(o["kind"], o["metadata"]["name"]): o for o in kustomize("deploy")}
    mwc_rule = objs[("ClusterRole", "ftagent-webhook")]["rules"][0]
    assert mwc_rule["resourceNames"] == ["ftagent"]  # its own configuration only
    cert_manager = {(o["kind"], o["metadata"]["name"]) for o in
                    kustomize("deploy/overlays/cert-manager")}
    assert not {k for k in cert_manager if k[0] in ("Role", "ClusterRole")
                and k[1] == "ftagent-webhook"}  # cert-manager writes the webhook's certificate


@needs_kubectl
def test_webhook_configuration() -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in kustomize("deploy")}
    hooks = objs[("MutatingWebhookConfiguration", "ftagent")]["webhooks"]
    assert len(hooks) == 2
    for h in hooks:
        assert h["failurePolicy"] == "Ignore" and h["timeoutSeconds"] <= 5
        assert h["reinvocationPolicy"] == "IfNeeded" and h["sideEffects"] == "None"
        assert h["clientConfig"]["service"]["path"] == "/mutate"
        excluded = next(e for e in h["namespaceSelector"]["matchExpressions"]
                        if e["key"] == "kubernetes.io/metadata.name")
        assert "ftagent-system" in excluded["values"]
    webhook = objs[("Deployment", "ftagent-webhook")]["spec"]["template"]["spec"]
    c = webhook["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["FTAGENT_IMAGE"]["value"] == c["image"]  # the init container = this image
    assert env["FTAGENT_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ftagent-secret"
    # every agent dials the one Service, whose Ready endpoint is the leader
    addresses = next(a for a in c["args"] if a.startswith("--arbiter=")).split("=", 1)[1]
    assert addresses == "ftagent-arbiter.ftagent-system.svc:9400"


@needs_kubectl
def test_the_arbiter_is_an_active_passive_pair() -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in kustomize("deploy")}
    assert ("StatefulSet", "ftagent-arbiter") not in objs
    arbiter = objs[("Deployment", "ftagent-arbiter")]
    assert arbiter["spec"]["replicas"] == 2
    assert arbiter["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = arbiter["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "--leader-elect" in c["args"] and "--leader-elect-lease=ftagent-arbiter" in c["args"]
    assert "--history-namespace=$(POD_NAMESPACE)" in c["args"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert f"--metrics-port={ports['metrics']}" in c["args"]
    assert pod["serviceAccountName"] == "ftagent-arbiter"
    assert pod.get("automountServiceAccountToken", True)  # it calls the API now
    svc = objs[("Service", "ftagent-arbiter")]["spec"]
    assert svc.get("clusterIP") != "None" and not svc.get("publishNotReadyAddresses")
    pdb = objs[("PodDisruptionBudget", "ftagent-arbiter")]["spec"]
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # the standby is not Ready


def _rules(obj: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in obj["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


@needs_kubectl
def test_the_arbiter_may_do_exactly_what_it_calls() -> None:
    """The verbs of kube/lease.py, kube/job_record.py (namespaced) and of the cluster
    actions (kube/actuator.py, recorder.py, cluster.py's watches), nothing more."""
    objs = {(o["kind"], o["metadata"]["name"]): o for o in kustomize("deploy")}
    role = objs[("Role", "ftagent-arbiter")]
    assert role["metadata"]["namespace"] == "ftagent-system"
    assert _rules(role) == {
        ("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")} | {
        ("", "configmaps", v) for v in ("get", "list", "create", "update", "delete")}
    assert _rules(objs[("ClusterRole", "ftagent-arbiter")]) == {
        ("", "pods", v) for v in ("list", "watch", "delete", "patch")} | {
        ("", "nodes", v) for v in ("get", "list", "watch", "update")} | {
        ("", "events", v) for v in ("create", "patch")} | {
        ("batch", "jobs", "get"), ("jobset.x-k8s.io", "jobsets", "get")}
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        b = objs[(kind, "ftagent-arbiter")]
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "ftagent-arbiter",
                                  "namespace": "ftagent-system"}]


@needs_kubectl
def test_prometheus_rule_matches_the_tested_rules() -> None:
    rule = next(o for o in kustomize("deploy/overlays/monitoring")
                if o["kind"] == "PrometheusRule")
    tested = yaml.safe_load((RULES / "ftagent-rules.yaml").read_text())
    assert rule["spec"]["groups"] == tested["groups"]
    monitor = next(o for o in kustomize("deploy/overlays/monitoring")
                   if o["kind"] == "PodMonitor")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "ftagent-metrics" and endpoint["honorLabels"] is True


def _templates(obj: Any) -> list[dict[str, Any]]:
    """Every pod template ({metadata, spec: {containers}}) inside a manifest."""
    found = []
    if isinstance(obj, dict):
        spec = obj.get("spec")
        if isinstance(spec, dict) and "containers" in spec and "metadata" in obj:
            found.append(obj)
        for v in obj.values():
            found += _templates(v)
    elif isinstance(obj, list):
        for v in obj:
            found += _templates(v)
    return found


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_manifests_validate(example: str) -> None:
    for doc in load_all(EXAMPLES / example):
        if doc["apiVersion"] in ("batch/v1", "v1", "apps/v1"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        templates = _templates(doc)
        assert templates or doc["kind"] == "TrainJob"
        for t in templates:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": "t"}, "template": t},
                                         K8S_VERSION, strict=True)


def test_dockerfile_ships_what_the_webhook_copies() -> None:
    """No image can be built here: check that the Dockerfile's bundle lands where the
    webhook's init container copies it from, and that what it COPYs exists."""
    from ftagent.kube.inject import Settings

    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"/src/build/bundle/ftagent {Settings().bundle_dir}" in text
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    assert "packaging/build_bundle.py" in text and "[kube]" in text


@needs_kubectl
def test_node_daemonset_runs_ftagent_node_with_what_it_reads() -> None:
    from ftagent.node.cli import parse

    objs = {(o["kind"], o["metadata"]["name"]): o for o in kustomize("deploy/overlays/node")}
    spec = objs[("DaemonSet", "ftagent-node")]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert spec["hostNetwork"] and c["args"][0] == "node"
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["FTAGENT_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ftagent-node-token", \
        "a node token, never the arbiter's secret"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/dev/kmsg"]["readOnly"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols[mounts["/dev/kmsg"]["name"]]["hostPath"] == {"path": "/dev/kmsg",
                                                              "type": "CharDevice"}
    plain = {k: v["value"] for k, v in env.items() if "value" in v}
    s = parse(c["args"][1:], {**plain, "NODE_NAME": "gpu-1", "FTAGENT_TOKEN": "t"})
    assert s.node.kube_api == "in-cluster" and s.node.metrics_port == 9432
    assert len(s.arbiter.arbiter.split(",")) == 2, "every shard gets the reports"
    binding = objs[("ClusterRoleBinding", "ftagent-node")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ftagent-node",
                                    "namespace": "ftagent-system"}]
    rules = objs[("ClusterRole", binding["roleRef"]["name"])]["rules"]
    assert {"resources": ["nodes/status"], "verbs": ["patch"], "apiGroups": [""]} in rules
