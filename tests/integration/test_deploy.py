"""deploy/: the alert rules are valid and behave as their unit tests say (promtool); the
kustomize components compose (real kubectl kustomize) in every combination their
dependencies allow, also in another namespace, and every render validates against the
Kubernetes schemas offline, has no reference to a name or namespace it does not render,
probes on every container; the arbiter's and the webhook's pods meet the restricted Pod
Security profile; RBAC without wildcards; the examples validate."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
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

DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.32"
# Custom resources with no schema in the Kubernetes release: checked for shape (and their
# references, below).
CUSTOM_KINDS = {"Certificate", "Issuer", "PodMonitor", "ServiceMonitor", "PrometheusRule"}
DEFAULT = ("arbiter", "webhook", "node", "monitoring")
# What a component needs rendered beside it: the webhook and the node agent dial the
# arbiter's Service, cert-manager patches the webhook and certifies both, node-kmsg patches
# the node agent, monitoring's ServiceMonitor selects the arbiter's Service.
NEEDS = {"webhook": {"arbiter"}, "node": {"arbiter"}, "cert-manager": {"webhook", "arbiter"},
         "node-kmsg": {"node"}, "monitoring": {"arbiter"}}
EXTRAS = ("monitoring", "network-policies", "image-pull-secret")
ORDER = ("arbiter", "webhook", "cert-manager", "node", "node-kmsg", *EXTRAS)
# Every combination of the components that depend on each other (the arbiter with no, a
# self-signed or a cert-manager webhook, with no node agent, one, or one reading
# /dev/kmsg), each with all the extras (which only add objects or patch what is there);
# the default; the arbiter alone, each extra alone or with the arbiter.
CORE = [("arbiter", *w, *n) for w in ((), ("webhook",), ("webhook", "cert-manager"))
        for n in ((), ("node",), ("node", "node-kmsg"))]
COMBOS = [c + EXTRAS for c in CORE] + [DEFAULT, ("arbiter",), ("arbiter", "monitoring"),
                                        ("network-policies",), ("image-pull-secret",)]
# Referenced, not rendered, on purpose: the registry credential a user creates
# (components/image-pull-secret).
EXTERNAL_SECRETS = {"ftagent-registry"}

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl (with kustomize) missing")


def _run_kustomize(path: Path) -> list[dict[str, Any]]:
    r = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def kustomize(path: str) -> list[dict[str, Any]]:
    return _render_dir(str(ROOT / path))


@functools.cache
def _render_dir(path: str) -> list[dict[str, Any]]:
    return _run_kustomize(Path(path))


@functools.cache
def render(components: tuple[str, ...], namespace: str = "ftagent-system",
           overlay: str = "") -> list[dict[str, Any]]:
    """deploy/kustomization.yaml with these components and this namespace (what a user's
    copy of it would be), built from a directory beside deploy/; ``overlay`` is YAML
    appended to it."""
    base = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build) as d:
        rel = os.path.relpath(DEPLOY, d)
        k = {**base, "namespace": namespace,
             "resources": [f"{rel}/{r}" for r in base["resources"]],
             "components": [f"{rel}/components/{c}" for c in components]}
        (Path(d) / "kustomization.yaml").write_text(yaml.safe_dump(k) + overlay)
        return _run_kustomize(Path(d))


def validate(obj: dict[str, Any]) -> None:
    if obj["kind"] in CUSTOM_KINDS:
        assert obj["apiVersion"].count("/") == 1 and obj["metadata"]["name"]
        return
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def index(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def pod_templates(objs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod spec) for every Deployment/DaemonSet."""
    for o in objs:
        if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            yield o, o["spec"]["template"]["spec"]


CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding",
                  "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
SERVICE_ADDRESS = re.compile(r"\b([a-z0-9-]+)\.([a-z0-9-]+|\$\(POD_NAMESPACE\))\.svc"
                             r"(?:\.cluster\.local)?:(\d+)\b")


def dangling(objs: list[dict[str, Any]]) -> list[str]:
    """Every reference in the render to a name or namespace the render does not hold."""
    bad: list[str] = []
    [ns] = [o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"]
    have = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
            for o in objs}

    def need(kind: str, namespace: str, name: str, why: str) -> dict[str, Any] | None:
        found = have.get((kind, namespace, name))
        if found is None:
            bad.append(f"{why}: no {kind} {namespace}/{name}")
        return found

    # Secrets a component makes or has made: cert-manager's, the arbiter's --tls-secret
    secrets = {o["spec"]["secretName"] for o in objs if o["kind"] == "Certificate"}
    secrets |= {o["metadata"]["name"] for o in objs if o["kind"] == "Secret"}
    for o in objs:
        kind, meta = o["kind"], o["metadata"]
        where = f"{kind} {meta['name']}"
        if kind not in CLUSTER_SCOPED and meta.get("namespace") != ns:
            bad.append(f"{where} is in namespace {meta.get('namespace')!r}, not {ns}")
        if kind in ("RoleBinding", "ClusterRoleBinding"):
            role_kind = o["roleRef"]["kind"]
            need(role_kind, ns if role_kind == "Role" else "", o["roleRef"]["name"], where)
            for s in o["subjects"]:
                need(s["kind"], s["namespace"], s["name"], where)
        if kind == "MutatingWebhookConfiguration":
            for h in o["webhooks"]:
                svc = h["clientConfig"]["service"]
                found = need("Service", svc["namespace"], svc["name"], where)
                if found and svc["port"] not in [p["port"] for p in found["spec"]["ports"]]:
                    bad.append(f"{where}: Service {svc['name']} has no port {svc['port']}")
            ca_from = meta.get("annotations", {}).get("cert-manager.io/inject-ca-from")
            if ca_from:
                need("Certificate", *ca_from.split("/"), where)
        if kind == "Certificate":
            need("Issuer", ns, o["spec"]["issuerRef"]["name"], where)
            for dns in o["spec"].get("dnsNames", []):
                if dns == "localhost":  # kubectl port-forward (docs/runbooks.md)
                    continue
                name, svc_ns = dns.split(".")[:2]
                need("Service", svc_ns, name, f"{where} DNS name {dns}")
        if kind == "Issuer" and "ca" in o["spec"] and o["spec"]["ca"]["secretName"] not in secrets:
            bad.append(f"{where}: no Secret {o['spec']['ca']['secretName']}")
        if kind == "Service":
            # the leader puts ftagent.io/arbiter-leader on its own pod at run time
            static = {k: v for k, v in o["spec"]["selector"].items() if k not in RUNTIME_LABELS}
            selected = [w for w, _ in pod_templates(objs) if w["metadata"].get("namespace") == ns
                        and static.items()
                        <= w["spec"]["template"]["metadata"]["labels"].items()]
            if not selected:
                bad.append(f"{where} selects no pods")
        if kind == "PodMonitor":  # a scrape that reaches nothing is a silent alert
            sel = o["spec"]["selector"].get("matchLabels", {}).items()
            ports = {e["port"] for e in o["spec"]["podMetricsEndpoints"]}
            # (one that selects no pod is harmless: that component is not rendered)
            for w, spec in pod_templates(objs):
                named = {p.get("name") for c in spec["containers"] for p in c.get("ports", [])}
                if sel and sel <= w["spec"]["template"]["metadata"]["labels"].items() \
                        and not ports <= named:
                    bad.append(f"{where}: {w['metadata']['name']} has no port {sorted(ports)}")
        if kind == "ServiceMonitor":
            labels = o["spec"]["selector"]["matchLabels"].items()
            if not [s for s in objs if s["kind"] == "Service"
                    and labels <= s["metadata"].get("labels", {}).items()]:
                bad.append(f"{where} selects no Service")
    for w, spec in pod_templates(objs):
        where = f"{w['kind']} {w['metadata']['name']}"
        sa = spec.get("serviceAccountName")
        if sa:
            need("ServiceAccount", ns, sa, where)
        for ref in spec.get("imagePullSecrets", []):
            if ref["name"] not in EXTERNAL_SECRETS | secrets:
                bad.append(f"{where}: pull secret {ref['name']} is nowhere")
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for a in c.get("args", []):
                if a.startswith("--tls-secret="):
                    secrets.add(a.split("=", 1)[1])
        for v in spec.get("volumes", []):
            if "secret" in v and v["secret"]["secretName"] not in secrets:
                bad.append(f"{where}: volume {v['name']}: Secret {v['secret']['secretName']} "
                           "is neither rendered nor made by a component rendered")
            if "configMap" in v:
                need("ConfigMap", ns, v["configMap"]["name"], where)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            env = {e["name"]: e for e in c.get("env", [])}
            for e in env.values():
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] not in secrets:
                    bad.append(f"{where}: env {e['name']}: no Secret {ref['name']}")
            texts = [*c.get("args", []), *[e["value"] for e in env.values() if "value" in e]]
            for text in texts:
                for name, svc_ns, port in SERVICE_ADDRESS.findall(text):
                    if svc_ns == "$(POD_NAMESPACE)":
                        assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == \
                            "metadata.namespace"
                        svc_ns = w["metadata"]["namespace"]
                    found = need("Service", svc_ns, name, f"{where}: {text}")
                    if found and int(port) not in [p["port"] for p in found["spec"]["ports"]]:
                        bad.append(f"{where}: {text}: Service {name} has no port {port}")
    for o in objs:
        if o["kind"] == "NetworkPolicy":
            sel = o["spec"]["podSelector"].get("matchLabels", {}).items()
            pods = [spec for w, spec in pod_templates(objs)
                    if sel <= w["spec"]["template"]["metadata"]["labels"].items()]
            # (one that selects no pods is harmless: the component covers the arbiter and
            # the webhook whether or not both are rendered)
            named = {p["name"] for spec in pods for c in spec["containers"]
                     for p in c.get("ports", [])}
            for rule in o["spec"].get("ingress", []):
                for p in rule.get("ports", []):
                    if pods and isinstance(p["port"], str) and p["port"] not in named:
                        bad.append(f"NetworkPolicy {o['metadata']['name']}: no port {p['port']}")
    return bad


RUNTIME_LABELS = {"ftagent.io/arbiter-leader"}  # written by the pod itself (leader_label.py)


def no_probe(objs: list[dict[str, Any]]) -> list[str]:
    return [f"{w['metadata']['name']}/{c['name']}" for w, spec in pod_templates(objs)
            for c in spec["containers"]
            if "livenessProbe" not in c or not ({"readinessProbe", "startupProbe"} & c.keys())]


@needs_kubectl
@pytest.mark.parametrize("components", COMBOS, ids=["+".join(c) for c in COMBOS])
def test_components_compose_in_another_namespace(components: tuple[str, ...]) -> None:
    for c in components:
        assert NEEDS.get(c, set()) <= set(components)
    objs = render(tuple(c for c in ORDER if c in components), "ml-infra")
    for obj in objs:
        validate(obj)
    assert dangling(objs) == []
    assert no_probe(objs) == []
    text = yaml.safe_dump_all(objs)
    assert "ftagent-system" not in text  # every reference followed the namespace
    keys = index(objs)
    if "arbiter" in components:
        assert ("Service", "ftagent-arbiter") in keys


@needs_kubectl
def test_default_installs_everything_a_user_needs() -> None:
    objs = kustomize("deploy")
    assert render(DEFAULT) == objs  # the default is the components DEFAULT
    for obj in objs:
        validate(obj)
    assert dangling(objs) == [] and no_probe(objs) == []
    keys = index(objs)
    for workload in (("Deployment", "ftagent-arbiter"), ("Deployment", "ftagent-webhook"),
                     ("DaemonSet", "ftagent-node"), ("PodMonitor", "ftagent-agents"),
                     ("PodMonitor", "ftagent-arbiter"), ("PodMonitor", "ftagent-webhook"),
                     ("PrometheusRule", "ftagent"),
                     ("MutatingWebhookConfiguration", "ftagent"), ("Namespace", "ftagent-system")):
        assert workload in keys
    # no Secret to create by hand: nothing references one that no component makes
    assert not [o for o in objs if o["kind"] == "Secret"]
    assert keys[("Namespace", "ftagent-system")]["metadata"]["labels"][
        "ftagent.io/inject"] == "false"  # ftagent's own pods are never injected


def test_dangling_finds_what_it_should() -> None:
    """The checker itself: a subject in the old namespace, an address naming a Service that
    does not exist, a Secret nothing makes are all found."""
    base = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}},
            {"kind": "ServiceAccount", "metadata": {"name": "sa", "namespace": "ns"}},
            {"kind": "ClusterRole", "metadata": {"name": "r"}},
            {"kind": "ClusterRoleBinding", "metadata": {"name": "b"},
             "roleRef": {"kind": "ClusterRole", "name": "r"},
             "subjects": [{"kind": "ServiceAccount", "name": "sa", "namespace": "old"}]},
            {"kind": "DaemonSet", "metadata": {"name": "d", "namespace": "ns"},
             "spec": {"template": {"metadata": {"labels": {"a": "b"}}, "spec": {
                 "serviceAccountName": "sa",
                 "volumes": [{"name": "v", "secret": {"secretName": "nowhere"}}],
                 "containers": [{"name": "c", "args": ["--arbiter=arb.ns.svc:9400"]}]}}}}]
    found = dangling(base)
    assert any("ServiceAccount old/sa" in f for f in found)
    assert any("Service ns/arb" in f for f in found)
    assert any("Secret nowhere" in f for f in found)


@needs_kubectl
def test_image_override_reaches_the_injected_init_container() -> None:
    objs = render(DEFAULT, overlay="images:\n- name: ghcr.io/ftagent/ftagent\n"
                  "  newName: registry.example.com/ml/ftagent\n  newTag: '9.9'\n")
    images = {c["image"] for _, spec in pod_templates(objs) for c in spec["containers"]}
    assert images == {"registry.example.com/ml/ftagent:9.9"}
    webhook = index(objs)[("Deployment", "ftagent-webhook")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in webhook["containers"][0]["env"]}
    assert env["FTAGENT_IMAGE"] == "registry.example.com/ml/ftagent:9.9"
    # also from an overlay of deploy/ (the images transformer's config travels with it)
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build) as d:
        (Path(d) / "kustomization.yaml").write_text(
            f"resources: [{os.path.relpath(DEPLOY, d)}]\nimages:\n"
            "- name: ghcr.io/ftagent/ftagent\n  digest: sha256:" + "a" * 64 + "\n")
        over = _run_kustomize(Path(d))
    webhook = index(over)[("Deployment", "ftagent-webhook")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in webhook["containers"][0]["env"]}
    assert env["FTAGENT_IMAGE"] == webhook["containers"][0]["image"] == \
        "ghcr.io/ftagent/ftagent@sha256:" + "a" * 64


@needs_kubectl
def test_image_pull_secret_on_every_ftagent_pod() -> None:
    objs = render((*DEFAULT, "image-pull-secret"))
    for w, spec in pod_templates(objs):
        assert spec["imagePullSecrets"] == [{"name": "ftagent-registry"}], w["metadata"]["name"]
    webhook = index(objs)[("Deployment", "ftagent-webhook")]["spec"]["template"]["spec"]
    # and the init container injected into training pods pulls with it
    assert "--image-pull-secret=ftagent-registry" in webhook["containers"][0]["args"]


# ------------------------------------------------------------------ Pod Security

# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline and
# restricted, as of v1.32)
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                 "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Every rule of the baseline and restricted profiles this pod spec breaks."""
    bad: list[str] = []
    psc = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(key)
    for s in psc.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {s['name']}")
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {sorted(kinds)}")
    containers = [*spec.get("initContainers", []), *spec["containers"],
                  *spec.get("ephemeralContainers", [])]
    for c in containers:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("windowsOptions", {}).get("hostProcess") or \
                psc.get("windowsOptions", {}).get("hostProcess"):
            bad.append(f"{name}: hostProcess")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        for ctx in (psc, sc):
            if ctx.get("seLinuxOptions", {}).get("type", "") not in SELINUX_TYPES:
                bad.append(f"{name}: seLinuxOptions.type")
            if ctx.get("seLinuxOptions", {}).get("user") or \
                    ctx.get("seLinuxOptions", {}).get("role"):
                bad.append(f"{name}: seLinuxOptions user/role")
            if ctx.get("appArmorProfile", {}).get("type") == "Unconfined":
                bad.append(f"{name}: AppArmor Unconfined")
        caps = sc.get("capabilities", {})
        if not set(caps.get("add", [])) <= BASELINE_CAPS & {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities.add {caps.get('add')}")
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities.drop lacks ALL")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
    if psc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    return bad


@needs_kubectl
@pytest.mark.parametrize("components", [DEFAULT, (*DEFAULT[:2], "cert-manager", *DEFAULT[2:])],
                         ids=["self-signed", "cert-manager"])
def test_arbiter_and_webhook_pods_meet_the_restricted_profile(components: tuple[str, ...]
                                                              ) -> None:
    keys = index(render(components))
    for name in ("ftagent-arbiter", "ftagent-webhook"):
        spec = keys[("Deployment", name)]["spec"]["template"]["spec"]
        assert restricted_violations(spec) == [], name
    # the checker finds what the node agent needs (and node-kmsg adds): it can fail
    node = keys[("DaemonSet", "ftagent-node")]["spec"]["template"]["spec"]
    assert set(restricted_violations(node)) == {"hostNetwork", "volume sys-infiniband: "
                                                "['hostPath']", "node: hostPort"}
    kmsg = index(render((*DEFAULT, "node-kmsg")))[("DaemonSet", "ftagent-node")]
    found = restricted_violations(kmsg["spec"]["template"]["spec"])
    assert "node: privileged" in found and "node: runAsNonRoot not true" in found


# ------------------------------------------------------------------ each component


@needs_kubectl
def test_rbac_is_least_privilege() -> None:
    for components in COMBOS:
        for obj in render(tuple(c for c in ORDER if c in components), "ml-infra"):
            for rule in obj.get("rules", []) if obj["kind"] in ("Role", "ClusterRole") else []:
                for key in ("verbs", "resources", "apiGroups"):
                    assert "*" not in rule.get(key, []), (components, obj["metadata"]["name"])
                assert set(rule["verbs"]) <= {"get", "list", "watch", "create", "update",
                                              "patch", "delete"}
    objs = index(kustomize("deploy"))
    mwc_rule = objs[("ClusterRole", "ftagent-webhook")]["rules"][0]
    assert mwc_rule["resourceNames"] == ["ftagent"]  # its own configuration only
    cert_manager = index(render((*DEFAULT[:2], "cert-manager", *DEFAULT[2:])))
    assert not {k for k in cert_manager if k[0] in ("Role", "ClusterRole")
                and k[1] == "ftagent-webhook"}  # cert-manager writes the webhook's certificate


@needs_kubectl
def test_webhook_configuration() -> None:
    objs = index(kustomize("deploy"))
    hooks = objs[("MutatingWebhookConfiguration", "ftagent")]["webhooks"]
    assert len(hooks) == 2
    for h in hooks:
        assert h["failurePolicy"] == "Ignore" and h["timeoutSeconds"] <= 5
        assert h["reinvocationPolicy"] == "IfNeeded" and h["sideEffects"] == "None"
        assert h["clientConfig"]["service"]["path"] == "/mutate"
        # ftagent's namespace, whatever its name, by its label
        labels = {e["key"]: e for e in h["namespaceSelector"]["matchExpressions"]}
        assert "false" not in labels["ftagent.io/inject"].get("values", []) or \
            labels["ftagent.io/inject"]["operator"] == "NotIn"
    webhook = objs[("Deployment", "ftagent-webhook")]["spec"]["template"]["spec"]
    c = webhook["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["FTAGENT_IMAGE"]["value"] == c["image"]  # the init container = this image
    assert "FTAGENT_TOKEN" not in env  # agents get projected tokens (C2), no secret
    args = dict(a.split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)
    # every agent dials the one Service, whose Ready endpoint is the leader
    assert args["--arbiter"] == "ftagent-arbiter.$(POD_NAMESPACE).svc:9400"
    # the arbiter's CA for the agents (C4): ca.crt of its Secret, optional
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    ca_dir, ca_file = args["--arbiter-ca"].rsplit("/", 1)
    vol = next(v for v in webhook["volumes"] if v["name"] == mounts[ca_dir]["name"])
    assert vol["secret"] == {"secretName": "ftagent-arbiter-tls", "optional": True,
                             "items": [{"key": "ca.crt", "path": ca_file}]}


@needs_kubectl
def test_the_arbiter_is_an_active_passive_pair() -> None:
    objs = index(kustomize("deploy"))
    assert ("StatefulSet", "ftagent-arbiter") not in objs
    arbiter = objs[("Deployment", "ftagent-arbiter")]
    assert arbiter["spec"]["replicas"] == 2
    assert arbiter["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = arbiter["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "--leader-elect" in c["args"] and "--leader-elect-lease=ftagent-arbiter" in c["args"]
    assert "--history-namespace=$(POD_NAMESPACE)" in c["args"]
    assert "--kube" in c["args"] and "--tls-secret=ftagent-arbiter-tls" in c["args"]  # C3, C4
    env = {e["name"]: e for e in c["env"]}
    assert "FTAGENT_TOKEN" not in env  # TokenReview, no shared secret
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # the probes have their own listener (issue 33.3): no flood on /metrics fails them
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert f"--metrics-port={ports['metrics']}" in c["args"]
    assert f"--health-port={ports['health']}" in c["args"]
    assert pod["serviceAccountName"] == "ftagent-arbiter"
    assert pod.get("automountServiceAccountToken", True)  # it calls the API now
    svc = objs[("Service", "ftagent-arbiter")]["spec"]
    assert svc.get("clusterIP") != "None" and not svc.get("publishNotReadyAddresses")
    # every replica is Ready; the leader's own label sends agents to it (issue 32.3)
    assert svc["selector"]["ftagent.io/arbiter-leader"] == "true"
    pdb = objs[("PodDisruptionBudget", "ftagent-arbiter")]["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def _rules(obj: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in obj["rules"] for g in rule.get("apiGroups", ["(url)"])
            for r in rule.get("resources", rule.get("nonResourceURLs", []))
            for v in rule["verbs"]}


@needs_kubectl
def test_the_arbiter_may_do_exactly_what_it_calls() -> None:
    """The verbs of kube/lease.py, kube/job_record.py, the TLS Secret (namespaced) and of the
    cluster actions (kube/actuator.py, recorder.py, cluster.py's watches, TokenReviews,
    uninjected.py's namespace watch, trainjob_status.py), nothing more."""
    objs = index(kustomize("deploy"))
    role = objs[("Role", "ftagent-arbiter")]
    assert role["metadata"]["namespace"] == "ftagent-system"
    assert _rules(role) == {
        ("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")} | {
        ("", "configmaps", v) for v in ("get", "list", "create", "update", "delete")} | {
        ("", "secrets", "get"), ("", "secrets", "create")} | {
        ("", "pods", v) for v in ("list", "patch")}  # the leader's label (leader_label.py)
    secret_get = next(r for r in role["rules"] if r["resources"] == ["secrets"]
                      and r["verbs"] == ["get"])
    assert secret_get["resourceNames"] == ["ftagent-arbiter-tls"]
    assert _rules(objs[("ClusterRole", "ftagent-arbiter")]) == {
        ("", "pods", v) for v in ("list", "watch", "delete", "patch")} | {
        ("", "nodes", v) for v in ("get", "list", "watch", "update")} | {
        ("", "events", v) for v in ("create", "patch")} | {
        ("", "namespaces", v) for v in ("list", "watch")} | {
        ("batch", "jobs", "get"), ("jobset.x-k8s.io", "jobsets", "get"),
        ("trainer.kubeflow.org", "trainjobs/status", "patch"),  # kube/trainjob_status.py
        ("authentication.k8s.io", "tokenreviews", "create"),
        ("authorization.k8s.io", "subjectaccessreviews", "create"),  # operators (auth.py)
        ("(url)", "/.well-known/openid-configuration", "get"),  # kube/projected.py
        ("(url)", "/openid/v1/jwks", "get")} | {
        ("resource.k8s.io", "devicetaintrules", v)  # kube/device_taint.py, dra_watch.py
        for v in ("create", "get", "update", "list", "watch")} | {
        ("resource.k8s.io", r, v) for r in ("resourceslices", "resourceclaims")
        for v in ("list", "watch")}  # kube/dra.py
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        b = objs[(kind, "ftagent-arbiter")]
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "ftagent-arbiter",
                                  "namespace": "ftagent-system"}]


@needs_kubectl
def test_cert_manager_issues_the_secrets_the_contracts_name() -> None:
    objs = index(render((*DEFAULT[:2], "cert-manager", *DEFAULT[2:]), "ml-infra"))
    arbiter = objs[("Certificate", "ftagent-arbiter")]["spec"]
    assert arbiter["secretName"] == "ftagent-arbiter-tls"  # C4; a CA issuer writes ca.crt
    assert arbiter["issuerRef"]["name"] == "ftagent-ca"
    assert objs[("Issuer", "ftagent-ca")]["spec"]["ca"]["secretName"] == "ftagent-ca"
    assert "ftagent-arbiter.ml-infra.svc" in arbiter["dnsNames"]
    mwc = objs[("MutatingWebhookConfiguration", "ftagent")]
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        "ml-infra/ftagent-webhook"


@needs_kubectl
def test_prometheus_rule_matches_the_tested_rules() -> None:
    objs = render(("monitoring",))
    rule = next(o for o in objs if o["kind"] == "PrometheusRule")
    tested = yaml.safe_load((RULES / "ftagent-rules.yaml").read_text())
    assert rule["spec"]["groups"] == tested["groups"]
    monitor = next(o for o in objs if o["kind"] == "PodMonitor")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "ftagent-metrics" and endpoint["honorLabels"] is True
    for o in objs:  # kube-prometheus-stack's selector
        if o["kind"] in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
            assert o["metadata"]["labels"]["release"] == "kube-prometheus-stack"


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
    """The Dockerfile (for builders with a registry) and `make image` build the same layout:
    the bundle where the webhook's init container copies it from, the virtualenv, the
    numeric user; and what the Dockerfile COPYs exists."""
    import sys

    from ftagent.kube.inject import Settings

    sys.path.insert(0, str(ROOT / "packaging"))
    import build_image

    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert build_image.BUNDLE == Settings().bundle_dir
    assert f"/src/build/bundle/ftagent {build_image.BUNDLE}" in text
    assert f"python -m venv {build_image.VENV}" in text
    assert f"USER {build_image.UID}:{build_image.UID}" in text
    assert f"ENV PATH={build_image.PATH}" in text
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    assert "packaging/build_bundle.py" in text and "[kube]" in text


@needs_kubectl
def test_node_daemonset_reaches_the_arbiter_service_unprivileged() -> None:
    from ftagent.cmd.node import parse

    objs = render(("arbiter", "node"), "ml-infra")
    keys = index(objs)
    spec = keys[("DaemonSet", "ftagent-node")]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert spec["hostNetwork"] and c["args"][0] == "node"
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    # C5: the arbiter's Service (resolved by dangling() to a rendered Service and port)
    assert env["FTAGENT_ARBITER"]["value"] == "ftagent-arbiter.$(POD_NAMESPACE).svc:9400"
    assert dangling(objs) == []
    # C5: ServiceAccount ftagent-node, its projected token re-read at every connect
    assert spec["serviceAccountName"] == "ftagent-node"
    assert "FTAGENT_TOKEN" not in env and "--token-file=/var/run/secrets/ftagent/token" in c["args"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    token = vols[mounts["/var/run/secrets/ftagent"]["name"]]
    assert token["projected"]["sources"] == [{"serviceAccountToken": {
        "audience": "ftagent", "expirationSeconds": 3600, "path": "token"}}]
    assert mounts["/var/run/secrets/ftagent"]["readOnly"]
    ca = vols[mounts["/var/run/secrets/ftagent-arbiter"]["name"]]["secret"]
    assert ca["secretName"] == "ftagent-arbiter-tls" and ca["optional"]
    assert "--tls-ca=/var/run/secrets/ftagent-arbiter/ca.crt" in c["args"]
    # C5: no privilege, no capability; /dev/kmsg only with node-kmsg
    sc = c["securityContext"]
    assert not sc.get("privileged") and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"]
    assert "/dev/kmsg" not in mounts and "--kmsg=none" in c["args"]
    kmsg = index(render(("arbiter", "node", "node-kmsg")))[("DaemonSet", "ftagent-node")]
    kc = kmsg["spec"]["template"]["spec"]["containers"][0]
    assert "--kmsg=/dev/kmsg" in kc["args"] and kc["securityContext"]["privileged"]
    assert {m["mountPath"]: m for m in kc["volumeMounts"]}["/dev/kmsg"]["readOnly"]
    # the flags parse, --token-file included
    plain = {k: v["value"] for k, v in env.items() if "value" in v}
    s = parse(c["args"][1:], {**plain, "NODE_NAME": "gpu-1",
                              "FTAGENT_ARBITER": "ftagent-arbiter.ml-infra.svc:9400"})
    assert s.node.kube_api == "in-cluster" and s.node.metrics_port == 9432
    # RBAC cannot narrow patch nodes/status to one node: a ValidatingAdmissionPolicy pins
    # each node agent to the node its token is bound to (issue 20), in any namespace
    vap = keys[("ValidatingAdmissionPolicy", "ftagent-node-own-node")]["spec"]
    assert vap["failurePolicy"] == "Fail"
    assert vap["matchConstraints"]["resourceRules"][0]["resources"] == ["nodes/status"]
    (cond,) = vap["matchConditions"]
    assert ":ftagent-node'" in cond["expression"] and "ftagent-system" not in cond["expression"]
    (rule,) = vap["validations"]
    assert "authentication.kubernetes.io/node-name" in rule["expression"] and \
        "object.metadata.name" in rule["expression"]
    vapb = keys[("ValidatingAdmissionPolicyBinding", "ftagent-node-own-node")]["spec"]
    assert vapb == {"policyName": "ftagent-node-own-node", "validationActions": ["Deny"]}
    binding = keys[("ClusterRoleBinding", "ftagent-node")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ftagent-node",
                                    "namespace": "ml-infra"}]
    rules = keys[("ClusterRole", binding["roleRef"]["name"])]["rules"]
    assert {"resources": ["nodes/status"], "verbs": ["patch"], "apiGroups": [""]} in rules


@needs_kubectl
def test_metrics_ports_admit_only_the_monitoring_namespace() -> None:
    """Issue 33.3: /metrics is unauthenticated, and the NetworkPolicy admitted any source
    to it. Now every rule that opens a port named metrics names its sources: the
    monitoring namespace; the probe ports are open (the kubelet), the metrics ports not."""
    objs = render(("arbiter", "webhook", "network-policies"))
    rules = [(o["metadata"]["name"], r) for o in objs if o["kind"] == "NetworkPolicy"
             for r in o["spec"].get("ingress", [])]
    metrics = [(n, r) for n, r in rules if "metrics" in {p["port"] for p in r["ports"]}]
    assert {n for n, _ in metrics} == {"ftagent-arbiter-metrics", "ftagent-webhook-metrics"}
    for _, r in metrics:
        assert r["from"] == [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]
    opened = {p["port"] for _, r in rules if "from" not in r for p in r["ports"]}
    assert "metrics" not in opened and {"grpc", "https", "health"} <= opened
