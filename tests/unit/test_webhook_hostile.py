"""Injection never breaks a pod and mints nothing (issues 20 and 21): the webhook's review
of attacks, valid-but-unusual job names, malformed and hostile AdmissionReviews, the plain
Job opt-in scope, and Pod Security "restricted" for what it injects."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from typing import Any

import jsonpatch
import pytest

from ftagent.kube.inject import SKIP_REASONS, Settings, metrics_port_for, mutate
from ftagent.kube.webhook import Counters, review
from tests.webhook_pods import admission_review, example_pods, pods_named

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
SETTINGS = Settings(image="ftagent:test", arbiter="arbiter.ftagent:9400",
                    arbiter_ca=lambda: CA)
PODS = example_pods()
# Kubernetes' label value rule (apimachinery validation.IsValidLabelValue), written out
# here independently of ftagent/kube/identity.py.
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def answer(doc: Any, counters: Counters | None = None) -> tuple[int, dict[str, Any]]:
    status, body = review(json.dumps(doc).encode(), SETTINGS, counters)
    return status, json.loads(body)


def patched(pod: dict[str, Any], namespace: str = "ml") -> tuple[dict[str, Any], Any]:
    status, out = answer(admission_review(pod, namespace=namespace))
    resp = out["response"]
    assert status == 200 and resp["allowed"] is True
    patch = json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else []
    return jsonpatch.apply_patch(pod, patch), resp


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# ------------------------------------------------------------------ the webhook mints nothing


def test_a_pod_claiming_another_namespace_and_job_gets_no_credential() -> None:
    """Issue 20: a pod in namespace ``attacker`` whose env claimed ``kube-system/victim``
    got a valid token for that job. Now no credential is in the patch at all: the pod gets
    its own projected ServiceAccount token (the kubelet's, bound to the pod), and nothing
    derived from a namespace the pod names."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "evil", "labels": {"ftagent.io/inject": "true"}},
           "spec": {"hostNetwork": True, "containers": [{
               "name": "main", "image": "x", "command": ["sh"],
               "env": [{"name": "FTAGENT_NAMESPACE", "value": "kube-system"},
                       {"name": "FTAGENT_JOB", "value": "victim"}]}]}}
    new, resp = patched(pod, namespace="attacker")
    env = env_of(new["spec"]["containers"][0])
    assert "FTAGENT_TOKEN" not in env
    assert env["FTAGENT_TOKEN_FILE"] == "/var/run/secrets/ftagent/token"
    token_volume = next(v for v in new["spec"]["volumes"] if v["name"] == "ftagent-token")
    assert token_volume["projected"]["sources"][0]["serviceAccountToken"]["audience"] == \
        "ftagent"
    # the only value derived from a namespace comes from request.namespace
    rank = int.from_bytes(hashlib.sha256(b"evil").digest()[:4], "big")
    port = metrics_port_for("attacker", "evil", rank, SETTINGS)
    assert port != metrics_port_for("kube-system", "evil", rank, SETTINGS)
    assert env["FTAGENT_METRICS_PORT"] == str(port)
    patch = base64.b64decode(resp["patch"]).decode()
    assert "kube-system" not in patch.replace('"value":"kube-system"', "")


def test_settings_take_no_token_deriver() -> None:
    with pytest.raises(TypeError):
        Settings(token_for=lambda ns, job: "t")  # type: ignore[call-arg]


# ------------------------------------------------------------------ never deny a valid job


@pytest.mark.parametrize("example,name", [
    ("pytorchjob.yaml", "a" * 55),
    ("pytorchjob.yaml", "llm-pretrain-70b-" + "x" * 38),
    ("indexed-job.yaml", "2024-sweep"),
    ("jobset.yaml", "9" * 50),
    ("volcano-job.yaml", "0-start-with-digit"),
])
def test_valid_job_names_are_injected_never_denied(example: str, name: str) -> None:
    """A 55-character PyTorchJob and a Job called ``2024-sweep`` were denied: their jobs
    could never start."""
    for ex in pods_named(example, name):
        pod, resp = patched(ex.pod)
        assert resp["allowed"] is True and "status" not in resp
        c = next(x for x in pod["spec"]["containers"] if x["name"] == ex.container)
        assert env_of(c)["FTAGENT_JOB"] == name
        label = pod["metadata"]["labels"]["ftagent.io/job"]
        assert LABEL_VALUE.fullmatch(label) and len(label) <= 63
        assert pod["metadata"]["annotations"]["ftagent.io/job-name"] == name


@pytest.mark.parametrize("job", ["x" * 253, "a.b.c-" * 20, "weird name/with:chars", "-a-"])
def test_a_job_name_that_is_no_label_value_is_hashed(job: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "labels": {"ftagent.io/inject": "true"}},
           "spec": {"containers": [{"name": "main", "image": "x", "command": ["t"],
                                    "env": [{"name": "FTAGENT_JOB", "value": job}]}]}}
    new, resp = patched(pod)
    label = new["metadata"]["labels"]["ftagent.io/job"]
    assert LABEL_VALUE.fullmatch(label) and 0 < len(label) <= 63, label
    assert new["metadata"]["annotations"]["ftagent.io/job-name"] == job
    other = copy.deepcopy(pod)
    other["spec"]["containers"][0]["env"][0]["value"] = job + "2"
    assert patched(other)[0]["metadata"]["labels"]["ftagent.io/job"] != label


def test_pod_named_by_generate_name_with_dots() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "my.service.v2-" + "z" * 200 + "-",
                        "labels": {"ftagent.io/inject": "true"}},
           "spec": {"containers": [{"name": "main", "image": "x", "command": ["t"]}]}}
    new, _ = patched(pod)
    label = new["metadata"]["labels"]["ftagent.io/job"]
    assert LABEL_VALUE.fullmatch(label) and len(label) <= 63


# ------------------------------------------------------------------ hostile reviews


def _review_with(obj: Any) -> dict[str, Any]:
    return admission_review(obj)


HOSTILE: dict[str, Any] = {
    "no containers": {"metadata": {"labels": {"ftagent.io/inject": "true"}},
                      "spec": {"containers": []}},
    "containers missing": {"metadata": {"labels": {"ftagent.io/inject": "true"}}, "spec": {}},
    "containers not a list": {"metadata": {"labels": {"ftagent.io/inject": "true"}},
                              "spec": {"containers": {"a": 1}}},
    "container not an object": {"metadata": {"labels": {"ftagent.io/inject": "true"}},
                                "spec": {"containers": ["x", 1]}},
    "metadata null": {"metadata": None, "spec": {"containers": [
        {"name": "main", "image": "x", "command": ["t"]}]}},
    "metadata null, labelled job kind": {"metadata": None, "spec": {"containers": [
        {"name": "pytorch", "image": "x", "command": ["t"]}]}},
    "spec null": {"metadata": {"name": "p"}, "spec": None},
    "labels null": {"metadata": {"labels": None, "annotations": None},
                    "spec": {"containers": [{"name": "main", "command": ["t"]}]}},
    "deep command annotation": {
        "metadata": {"labels": {"ftagent.io/inject": "true"},
                     "annotations": {"ftagent.io/command": "[" * 100_000}},
        "spec": {"containers": [{"name": "main", "image": "x", "args": ["t"]}]}},
    "deep command annotation, nearly closed": {
        "metadata": {"labels": {"ftagent.io/inject": "true"},
                     "annotations": {"ftagent.io/command": "[" * 5000 + "]" * 5000}},
        "spec": {"containers": [{"name": "main", "image": "x", "args": ["t"]}]}},
    "ports and env of the wrong types": {
        "metadata": {"labels": {"ftagent.io/inject": "true"}},
        "spec": {"containers": [{"name": "main", "command": ["t"], "ports": "x",
                                 "env": {"a": 1}, "volumeMounts": 3}],
                 "initContainers": "x", "volumes": {"x": 1}, "hostNetwork": True}},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_pod_gets_a_well_formed_answer(name: str) -> None:
    counters = Counters()
    status, out = answer(_review_with(HOSTILE[name]), counters)
    assert status == 200 and out["kind"] == "AdmissionReview"
    resp = out["response"]
    assert resp["allowed"] is True
    assert [r for r, _ in counters.reviews] != ["error"], resp
    if "patch" in resp:  # whatever it patched applies to the pod as given
        jsonpatch.apply_patch(HOSTILE[name], json.loads(base64.b64decode(resp["patch"])))


def test_deeply_nested_pod_fields_are_answered() -> None:
    deep: Any = "x"
    for _ in range(900):  # json.loads takes it; copying and encoding it must not crash
        deep = [deep]
    pod = {"metadata": {"labels": {"ftagent.io/inject": "true"}},
           "spec": {"containers": [{"name": "main", "command": ["t"], "x": deep}]}}
    counters = Counters()
    status, out = answer(_review_with(pod), counters)
    assert status == 200 and out["response"]["allowed"] is True
    assert all(r != "error" for r, _ in counters.reviews)


def test_a_large_review_is_answered() -> None:
    """3 MiB of env (under the 4 MiB default body limit): answered, patch applies."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "big", "labels": {"ftagent.io/inject": "true"}},
           "spec": {"containers": [{"name": "main", "image": "x", "command": ["t"], "env": [
               {"name": f"V{i}", "value": "v" * 1000} for i in range(3000)]}]}}
    new, resp = patched(pod)
    assert new["spec"]["containers"][0]["command"][:3] == ["/opt/ftagent/busybox", "sh",
                                                            "/opt/ftagent/ftagent-entry"]


def test_metrics_count_results_and_reasons() -> None:
    counters = Counters()
    answer(admission_review(PODS[0].pod), counters)
    answer(_review_with(HOSTILE["no containers"]), counters)
    answer(admission_review({"kind": "Secret"}, kind="Secret"), counters)
    review(b"nope", SETTINGS, counters)
    assert counters.reviews == {("injected", ""): 1, ("skipped", "no containers"): 1,
                                ("skipped", "not a pod"): 1, ("malformed", ""): 1}
    assert all(why in SKIP_REASONS for r, why in counters.reviews if r == "skipped")


# ------------------------------------------------------------------ opt-in scope


def _plain_job_pod(**labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "backup-x", "labels": {
                "batch.kubernetes.io/job-name": "backup", "job-name": "backup",
                "batch.kubernetes.io/controller-uid": "u", **labels}},
            "spec": {"containers": [{"name": "main", "image": "x", "command": ["b"]}]}}


def test_plain_batch_job_in_an_opted_in_namespace_is_not_injected() -> None:
    pod, resp = patched(_plain_job_pod())
    assert pod["spec"] == _plain_job_pod()["spec"]
    assert resp["auditAnnotations"]["injected"].startswith("skipped: plain Job")
    # labelled for it: injected
    pod, _ = patched(_plain_job_pod(**{"ftagent.io/inject": "true"}))
    assert pod["spec"]["containers"][0]["command"][0] == "/opt/ftagent/busybox"


# ------------------------------------------------------------------ Pod Security "restricted"

# From the Pod Security Standards page (kubernetes.io/docs/concepts/security/
# pod-security-standards, "Restricted"), plus the Baseline controls it includes that a
# mutation could break.
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                   "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    spec = pod["spec"]
    psc = spec.get("securityContext") or {}
    out = []
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {v['name']}: {kinds - ALLOWED_VOLUMES}")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc, n = c.get("securityContext") or {}, c["name"]
        if sc.get("privileged"):
            out.append(f"{n}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{n}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{n}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{n}: adds capabilities")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{n}: runAsNonRoot not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{n}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{n}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{n}: hostPort")
    return out


def _restricted(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as a restricted namespace admits it (the user's part of the bargain)."""
    pod = copy.deepcopy(pod)
    pod["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
        c["securityContext"] = {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}}
    return pod


RESTRICTABLE = [p for p in PODS if not p.pod["spec"].get("hostNetwork")]


@pytest.mark.parametrize("ex", RESTRICTABLE, ids=[p.pod["metadata"]["name"]
                                                  for p in RESTRICTABLE])
def test_a_restricted_pod_stays_restricted_after_injection(ex: Any) -> None:
    before = _restricted(ex.pod)
    assert restricted_violations(before) == []
    pod, _ = patched(before)
    assert "ftagent.io/injected" in pod["metadata"]["annotations"]
    assert pod["spec"]["initContainers"][0]["name"] == "ftagent-install"
    assert restricted_violations(pod) == []


def test_the_init_container_is_restricted_on_its_own() -> None:
    """Without any pod-level securityContext, the injected init container still meets
    every container-level rule (runAsNonRoot and seccomp set on it, not inherited)."""
    pod, _ = patched(PODS[0].pod)
    init = pod["spec"]["initContainers"][0]
    alone = {"spec": {"containers": [init], "volumes": [
        v for v in pod["spec"]["volumes"] if v["name"] in ("ftagent", "ftagent-token")]}}
    assert restricted_violations(alone) == []
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert "runAsUser" not in init["securityContext"]  # the image's numeric USER


def test_image_pull_secrets_for_the_init_image() -> None:
    s = Settings(image="registry.example/ftagent:1", image_pull_secrets=("regcred",))
    pod = copy.deepcopy(PODS[0].pod)
    pod["spec"]["imagePullSecrets"] = [{"name": "mine"}]
    m = mutate(copy.deepcopy(pod), "ml", s)
    new = jsonpatch.apply_patch(pod, m.patch)
    assert new["spec"]["imagePullSecrets"] == [{"name": "mine"}, {"name": "regcred"}]
    assert mutate(copy.deepcopy(new), "ml", s).patch == []


def test_image_pull_secret_flag_repeats_and_splits() -> None:
    from ftagent.cmd.webhook import _server, parse

    cfg = parse(["--self-signed", "--image-pull-secret", "a,b", "--image-pull-secret", "c"],
                {})
    assert _server(cfg).settings.image_pull_secrets == ("a", "b", "c")
    cfg = parse(["--self-signed"], {"FTAGENT_IMAGE_PULL_SECRET": "x, y"})
    assert _server(cfg).settings.image_pull_secrets == ("x", "y")
