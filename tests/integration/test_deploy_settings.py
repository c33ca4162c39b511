"""deploy/ as a platform engineer installs it (issue 32): an overlay that uses deploy/ as a
remote base with its own namespace renders a working install (no reference left in
ftagent-system); no platform is hard-coded in the default and each platform setting is a
component or one patch (the overlay in docs/deploy.md, rendered as it is written); no
rank's metrics port can be a port of ftagent's own pods. Real ``kubectl kustomize``;
schemas offline; the checks of tests/integration/test_deploy.py (dangling references,
probes, Pod Security) reused."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT
from tests.integration.test_deploy import (
    DEFAULT,
    DEPLOY,
    _run_kustomize,
    dangling,
    index,
    kustomize,
    needs_kubectl,
    no_probe,
    pod_templates,
    render,
    validate,
)

REMOTE = "https://github.com/ftagent/ftagent//deploy"
# kustomize 5.5 writes metadata.namespace on these cluster-scoped kinds (kustomize#6051,
# docs/deploy.md): the API server drops it; nothing else may carry one it should not.
VAP_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def overlay(text: str) -> list[dict[str, Any]]:
    """A kustomization in a directory of its own (as in a user's repository) whose remote
    paths of ftagent's deploy/ point at this checkout."""
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build) as d:
        rel = os.path.relpath(DEPLOY, d)
        text = re.sub(re.escape(REMOTE) + r"([^?\s]*)\?ref=\S+", rf"{rel}\1", text)
        assert "github.com" not in text
        (Path(d) / "kustomization.yaml").write_text(text)
        return _run_kustomize(Path(d))


def referenced_namespaces(objs: list[dict[str, Any]]) -> set[str]:
    """Every namespace the render names, wherever: metadata, RBAC subjects, webhook
    Services, NAME.NS.svc strings."""
    found: set[str] = set()
    for o in objs:
        if o["kind"] == "Namespace":
            found.add(o["metadata"]["name"])
        elif o["kind"] not in VAP_KINDS and "namespace" in o["metadata"]:
            found.add(o["metadata"]["namespace"])
        for s in o.get("subjects", []):
            found.add(s.get("namespace", "<none>"))
        for h in o.get("webhooks", []):
            found.add(h["clientConfig"]["service"].get("namespace", "<none>"))
    text = yaml.safe_dump_all(objs)
    found |= set(re.findall(r"\b[a-z0-9-]+\.([a-z0-9-]+)\.svc\b", text))
    return found


# ------------------------------------------------------------------ an overlay's namespace


@needs_kubectl
def test_an_overlay_of_deploy_with_its_own_namespace_renders_a_working_install() -> None:
    """The Argo CD / Flux way: deploy/ (a tagged path) under `resources:` and the overlay's
    own `namespace:`. Before: RBAC subjects and the webhook's Service stayed in
    ftagent-system (the ServiceAccounts had no permissions, the API server called a
    webhook Service that did not exist)."""
    objs = overlay(f"namespace: ml-platform\nresources:\n  - {REMOTE}?ref=v0.1.0\n")
    for o in objs:
        validate(o)
    assert dangling(objs) == [] and no_probe(objs) == []
    assert "ftagent-system" not in yaml.safe_dump_all(objs)
    assert referenced_namespaces(objs) == {"ml-platform"}
    keys = index(objs)
    ns = keys[("Namespace", "ml-platform")]["metadata"]["labels"]
    assert ns["ftagent.io/inject"] == "false"  # ftagent's own pods are never injected
    for kind, name in (("RoleBinding", "ftagent-arbiter"), ("RoleBinding", "ftagent-webhook"),
                       ("ClusterRoleBinding", "ftagent-arbiter"),
                       ("ClusterRoleBinding", "ftagent-node"),
                       ("ClusterRoleBinding", "ftagent-webhook")):
        assert keys[(kind, name)]["subjects"] == [
            {"kind": "ServiceAccount", "name": name, "namespace": "ml-platform"}]
    for h in keys[("MutatingWebhookConfiguration", "ftagent")]["webhooks"]:
        assert h["clientConfig"]["service"]["namespace"] == "ml-platform"
    # and the default (no overlay) is what it was
    default = index(kustomize("deploy"))
    assert default[("ClusterRoleBinding", "ftagent-node")]["subjects"][0]["namespace"] == \
        "ftagent-system"


@needs_kubectl
def test_overlays_of_overlays_and_extra_components_follow_too() -> None:
    """Two levels (a team's overlay of a platform overlay), and deploy/ with the optional
    components an overlay adds beside it."""
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build) as d:
        first, second = Path(d) / "platform", Path(d) / "team"
        first.mkdir()
        second.mkdir()
        (first / "kustomization.yaml").write_text(
            f"namespace: ml-platform\nresources: [{os.path.relpath(DEPLOY, first)}]\n")
        (second / "kustomization.yaml").write_text(
            "namespace: team-a\nresources: [../platform]\n")
        objs = _run_kustomize(second)
    assert dangling(objs) == [] and referenced_namespaces(objs) == {"team-a"}
    comps = "".join(f"  - {REMOTE}/components/{c}?ref=v0.1.0\n"
                    for c in ("network-policies", "image-pull-secret", "critical-priority",
                              "nvidia-gpu-operator"))
    objs = overlay(f"namespace: ml-platform\nresources:\n  - {REMOTE}?ref=v0.1.0\n"
                   f"components:\n{comps}")
    for o in objs:
        validate(o)
    assert dangling(objs) == [] and referenced_namespaces(objs) == {"ml-platform"}


@needs_kubectl
def test_the_cert_manager_exception_is_what_the_docs_say() -> None:
    """docs/deploy.md: with cert-manager, a copy of deploy/kustomization.yaml follows the
    namespace (tested in test_deploy.py); an overlay of deploy/ does not, for the
    component's strings only. Kept true here so the docs cannot go stale silently."""
    objs = overlay(f"namespace: ml-platform\nresources:\n  - {REMOTE}?ref=v0.1.0\n"
                   f"components:\n  - {REMOTE}/components/cert-manager?ref=v0.1.0\n")
    left = [s for s in referenced_namespaces(objs) if s != "ml-platform"]
    assert left == ["ftagent-system"]
    copy = render((*DEFAULT[:2], "cert-manager", *DEFAULT[2:]), "ml-platform")
    assert referenced_namespaces(copy) == {"ml-platform"}


# ------------------------------------------------------------------ platform settings


def _node(objs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = index(objs)[("DaemonSet", "ftagent-node")]["spec"]["template"]["spec"]
    return spec


@needs_kubectl
def test_the_default_hard_codes_no_platform() -> None:
    """Before: runtimeClassName nvidia (a RuntimeClass only the GPU Operator makes: the pods
    of a cluster without it are refused), the GPU Operator's node label (no node agent
    anywhere else) and system-node-critical (refused outside kube-system where critical
    classes need a quota, as on GKE)."""
    objs = kustomize("deploy")
    for w, spec in pod_templates(objs):
        where = w["metadata"]["name"]
        assert "runtimeClassName" not in spec, where
        assert "priorityClassName" not in spec, where
        assert not [k for k in spec.get("nodeSelector", {}) if "nvidia" in k], where
    node = _node(objs)
    assert node["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert node["tolerations"] == [{"operator": "Exists"}]  # ftagent.io/fault included
    assert not [o for o in objs if o["kind"] == "ResourceQuota"]


@needs_kubectl
def test_each_platform_component_sets_its_setting() -> None:
    gpu = _node(render(("arbiter", "node", "nvidia-gpu-operator")))
    assert gpu["runtimeClassName"] == "nvidia"
    assert gpu["nodeSelector"] == {"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true"}

    objs = render((*DEFAULT, "critical-priority"))
    for o in objs:
        validate(o)
    assert dangling(objs) == []
    keys = index(objs)
    assert _node(objs)["priorityClassName"] == "system-node-critical"
    for name in ("ftagent-arbiter", "ftagent-webhook"):
        spec = keys[("Deployment", name)]["spec"]["template"]["spec"]
        assert spec["priorityClassName"] == "system-cluster-critical", name
    quota = keys[("ResourceQuota", "ftagent-critical-pods")]
    assert quota["metadata"]["namespace"] == "ftagent-system"
    (scope,) = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert scope["scopeName"] == "PriorityClass" and scope["operator"] == "In"
    assert set(scope["values"]) == {"system-node-critical", "system-cluster-critical"}
    # the arbiter alone (no node agent, no webhook): the component still renders
    alone = index(render(("arbiter", "critical-priority")))
    assert alone[("Deployment", "ftagent-arbiter")]["spec"]["template"]["spec"][
        "priorityClassName"] == "system-cluster-critical"


def docs_overlay() -> str:
    """The overlay of docs/deploy.md's "Platform settings", as a reader copies it."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("## Platform settings"):text.index("## Ports")]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    return block


@needs_kubectl
def test_the_documented_overlay_renders_every_setting() -> None:
    objs = overlay(docs_overlay())
    for o in objs:
        validate(o)
    assert dangling(objs) == [] and no_probe(objs) == []
    assert referenced_namespaces(objs) == {"ml-platform"}
    keys = index(objs)
    node = _node(objs)
    assert node["nodeSelector"] == {"kubernetes.io/os": "linux",
                                    "example.com/accelerator": "nvidia"}
    assert node["runtimeClassName"] == "nvidia"
    assert node["priorityClassName"] == "system-node-critical"
    assert {t["key"] for t in node["tolerations"]} == {"nvidia.com/gpu", "ftagent.io/fault"}
    for name in ("ftagent-arbiter", "ftagent-webhook"):
        spec = keys[("Deployment", name)]["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"node-role.example.com/system": "true"}, name
        assert spec["tolerations"][0]["key"] == "node-role.example.com/system", name
        assert spec["priorityClassName"] == "system-cluster-critical", name
    images = {c["image"] for _, spec in pod_templates(objs) for c in spec["containers"]}
    assert images == {"registry.example.com/ml/ftagent:0.1.0"}


# ------------------------------------------------------------------ ports


def _rendered_own_ports(objs: list[dict[str, Any]]) -> set[int]:
    """Every port ftagent's own pods declare or are told to listen on."""
    ports: set[int] = set()
    for _, spec in pod_templates(objs):
        for c in spec["containers"]:
            for p in c.get("ports", []):
                ports.add(p["containerPort"])
                ports.add(p.get("hostPort", p["containerPort"]))
            for a in c.get("args", []):
                m = re.match(r"--(?:listen|metrics-port)=(?:.*:)?(\d+)$", a)
                if m:
                    ports.add(int(m.group(1)))
            for e in c.get("env", []):
                if e["name"] == "FTAGENT_METRICS_PORT":
                    ports.add(int(e["value"]))
    return ports


@needs_kubectl
@pytest.mark.parametrize("components", [DEFAULT, (*DEFAULT, "node-kmsg", "critical-priority")],
                         ids=["default", "more"])
def test_no_rank_port_is_a_port_of_ftagents_own_pods(components: tuple[str, ...]) -> None:
    from ftagent.cmd.webhook import parse
    from ftagent.kube.inject import MAX_PORT_SPAN

    objs = render(components)
    own = _rendered_own_ports(objs)
    assert {9400, 9431, 9432, 8443} <= own
    webhook = index(objs)[("Deployment", "ftagent-webhook")]["spec"]["template"]["spec"]
    cfg = parse(webhook["containers"][0]["args"][1:], {})
    span = min(cfg.metrics_port_span, MAX_PORT_SPAN)
    ranks = set(range(cfg.metrics_port, cfg.metrics_port + span))
    assert ranks.isdisjoint(own), sorted(ranks & own)
