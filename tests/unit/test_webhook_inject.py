"""The pod mutation (ftagent/kube/inject.py), applied with a real JSONPatch library, for
every example's pods and for each way a pod can be unusual."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from ftagent.kube.inject import PORT_NAME, Settings, metrics_port_for, mutate
from tests.webhook_pods import ExamplePod, example_pods

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
SETTINGS = Settings(image="ghcr.io/ftagent/ftagent:test", arbiter="arbiter.ftagent:9400",
                    arbiter_ca=lambda: CA)
PODS = example_pods()
ENTRY = ["/opt/ftagent/busybox", "sh", "/opt/ftagent/ftagent-entry", "--"]
TOKEN_VOLUME = {"name": "ftagent-token", "projected": {"sources": [{"serviceAccountToken": {
    "audience": "ftagent", "expirationSeconds": 3600, "path": "token"}}]}}
TOKEN_MOUNT = {"name": "ftagent-token", "mountPath": "/var/run/secrets/ftagent",
               "readOnly": True}


def apply(pod: dict[str, Any], settings: Settings = SETTINGS,
          namespace: str = "ml") -> tuple[dict[str, Any], Any]:
    m = mutate(copy.deepcopy(pod), namespace, settings)
    return jsonpatch.apply_patch(pod, m.patch), m


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def trainer(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def test_every_example_kind_has_pods() -> None:
    assert {p.example for p in PODS} == {
        "indexed-job.yaml", "jobset.yaml", "mpijob.yaml", "mxjob.yaml", "paddlejob.yaml",
        "pytorchjob.yaml", "tfjob.yaml", "trainjob.yaml", "volcano-job.yaml"}


@pytest.mark.parametrize("ex", PODS, ids=[p.pod["metadata"]["name"] for p in PODS])
def test_example_pod_is_injected(ex: ExamplePod) -> None:
    before = copy.deepcopy(ex.pod)
    pod, m = apply(ex.pod)
    assert ex.pod == before  # mutate() never changes its input
    c = trainer(pod, ex.container)
    original = trainer(before, ex.container)
    assert c["command"] == [*ENTRY, *original["command"]]
    assert c.get("args") == original.get("args")
    env = env_of(c)
    assert env["FTAGENT_JOB"] == ex.job
    # the arbiter's pod watch (--kube) selects on this label; the others are kept
    assert pod["metadata"]["labels"] == {**before["metadata"].get("labels", {}),
                                         "ftagent.io/job": ex.job}
    assert pod["metadata"]["annotations"]["ftagent.io/job-name"] == ex.job
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env.get("FTAGENT_RANK") == (None if ex.rank is None else str(ex.rank))
    assert env.get("FTAGENT_WORLD_SIZE") == (None if ex.world_size is None
                                             else str(ex.world_size))
    assert (env.get("FTAGENT_PROGRESS") == "none") == ex.crash_only
    assert "FTAGENT_TOKEN" not in env  # the webhook mints nothing
    if ex.arbitrated:
        assert env["FTAGENT_ARBITER"] == "arbiter.ftagent:9400"
        assert env["FTAGENT_TOKEN_FILE"] == "/var/run/secrets/ftagent/token"
        assert env["FTAGENT_TLS_CA"] == "/opt/ftagent/ca.crt"
        assert TOKEN_VOLUME in pod["spec"]["volumes"] and TOKEN_MOUNT in c["volumeMounts"]
    else:
        assert "FTAGENT_ARBITER" not in env and "FTAGENT_TOKEN_FILE" not in env
        assert TOKEN_VOLUME not in pod["spec"]["volumes"]
    # the agent: copied by the init container into the shared emptyDir
    init = pod["spec"]["initContainers"][0]
    assert init["name"] == "ftagent-install" and init["image"] == SETTINGS.image
    assert {"name": "ftagent", "mountPath": "/opt/ftagent", "readOnly": True} in \
        c["volumeMounts"]
    assert {"name": "ftagent", "emptyDir": {"sizeLimit": "512Mi"}} in pod["spec"]["volumes"]
    # metrics: a named port and the scrape annotations agree with the agent's port
    port = next(p for p in c["ports"] if p["name"] == PORT_NAME)
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(port["containerPort"]) == env[
        "FTAGENT_METRICS_PORT"]
    assert (port.get("hostPort") == port["containerPort"]) == bool(
        pod["spec"].get("hostNetwork"))
    assert notes["ftagent.io/injected"].startswith("true")
    # the other containers are untouched
    others = [x for x in pod["spec"]["containers"] if x["name"] != ex.container]
    assert others == [x for x in before["spec"]["containers"] if x["name"] != ex.container]
    # idempotent: a second review of the injected pod changes nothing
    assert mutate(copy.deepcopy(pod), "ml", SETTINGS).patch == []


def _simple(**container: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labels": {"ftagent.io/inject": "true"}},
            "spec": {"containers": [{"name": "main", "image": "x", **container}]}}


@pytest.mark.parametrize("container,expected", [
    ({"command": ["python", "t.py"]}, ([*ENTRY, "python", "t.py"], None)),
    ({"command": ["python"], "args": ["t.py", "--x"]},
     ([*ENTRY, "python"], ["t.py", "--x"])),
])
def test_command_and_args_combinations(container: dict[str, Any], expected: Any) -> None:
    pod, m = apply(_simple(**container))
    c = pod["spec"]["containers"][0]
    assert (c["command"], c.get("args")) == expected and not m.warnings


@pytest.mark.parametrize("container,status", [
    ({}, "skipped: no command"),
    ({"args": ["t.py"]}, "skipped: args but no command"),
])
def test_no_command_is_left_alone_with_a_warning(container: dict[str, Any], status: str) -> None:
    pod, m = apply(_simple(**container))
    assert pod["spec"] == _simple(**container)["spec"]  # untouched, never denied
    assert pod["metadata"]["annotations"]["ftagent.io/injected"] == status
    assert m.warnings and "entrypoint" in m.warnings[0] and len(m.warnings[0]) <= 160


def test_image_entrypoint_from_the_annotation() -> None:
    raw = _simple(args=["t.py"])
    raw["metadata"]["annotations"] = {"ftagent.io/command": '["/entrypoint.sh"]'}
    pod, _ = apply(raw)
    c = pod["spec"]["containers"][0]
    assert c["command"] == [*ENTRY, "/entrypoint.sh"]
    assert c["args"] == ["t.py"]


def test_agent_from_the_image_copies_nothing() -> None:
    raw = _simple(command=["python", "t.py"])
    raw["metadata"]["annotations"] = {"ftagent.io/agent": "image"}
    pod, _ = apply(raw, Settings(arbiter="a:1"))
    assert pod["spec"]["containers"][0]["command"][:3] == ["ftagent", "run", "--"]
    assert "initContainers" not in pod["spec"]
    assert pod["spec"]["volumes"] == [TOKEN_VOLUME]  # no bundle, but the pod's own token
    # with a CA to hand over, a small init container writes only the CA
    pod, _ = apply(raw)
    init = pod["spec"]["initContainers"][0]
    assert "cp " not in init["command"][2] and "ca.crt" in init["command"][2]


def test_trainer_container_choice() -> None:
    raw = _simple(command=["python", "t.py"])
    raw["spec"]["containers"].insert(0, {"name": "sidecar", "image": "y", "command": ["s"]})
    raw["spec"]["containers"][1]["name"] = "pytorch"
    pod, _ = apply(raw)
    assert pod["spec"]["containers"][0]["command"] == ["s"]
    assert pod["spec"]["containers"][1]["command"][:len(ENTRY)] == ENTRY
    # two containers, no conventional name: not guessed
    raw["spec"]["containers"][1]["name"] = "main"
    pod, m = apply(raw)
    assert "several containers" in pod["metadata"]["annotations"]["ftagent.io/injected"]
    assert m.warnings
    # the annotation decides
    raw["metadata"]["annotations"] = {"ftagent.io/container": "sidecar"}
    pod, _ = apply(raw)
    assert pod["spec"]["containers"][0]["command"][:len(ENTRY)] == ENTRY


def test_fault_tolerance_off_monitors_only() -> None:
    raw = next(p for p in PODS if p.example == "pytorchjob.yaml").pod
    raw = copy.deepcopy(raw)
    raw["metadata"]["labels"]["ftagent.io/fault-tolerance"] = "false"
    pod, _ = apply(raw)
    env = env_of(pod["spec"]["containers"][0])
    assert env["FTAGENT_HANG_ACTION"] == "alert" and env["FTAGENT_MAX_RESTARTS"] == "0"
    assert "FTAGENT_ARBITER" not in env and "FTAGENT_TOKEN_FILE" not in env
    assert not any(v.get("name") == "ftagent-token" for v in pod["spec"]["volumes"])
    assert "monitor only" in pod["metadata"]["annotations"]["ftagent.io/injected"]


def test_container_settings_win() -> None:
    raw = _simple(command=["t"], env=[{"name": "FTAGENT_METRICS_PORT", "value": "9999"},
                                      {"name": "FTAGENT_JOB", "value": "mine"}])
    pod, _ = apply(raw)
    env = env_of(pod["spec"]["containers"][0])
    assert env["FTAGENT_METRICS_PORT"] == "9999" and env["FTAGENT_JOB"] == "mine"
    assert pod["metadata"]["labels"]["ftagent.io/job"] == "mine"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9999"


def test_port_taken_by_the_trainer_moves_on() -> None:
    raw = _simple(command=["t"], ports=[{"containerPort": 9440}])
    pod, _ = apply(raw)
    ports = pod["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in ports] == [9440, 9441]


def test_no_containers_and_not_a_pod() -> None:
    m = mutate({"metadata": {}, "spec": {"containers": []}}, "ml", SETTINGS)
    assert m.reason == "no containers" and m.warnings and m.status == "skipped: no containers"
    assert mutate({"kind": "Secret", "data": {}}, "ml", SETTINGS).patch == []
    assert mutate("not an object", "ml", SETTINGS).patch == []


def test_pod_of_no_job_in_a_labelled_namespace_is_skipped() -> None:
    raw = _simple(command=["t"])
    del raw["metadata"]["labels"]["ftagent.io/inject"]
    pod, m = apply(raw)
    assert pod["spec"] == raw["spec"] and not m.warnings and m.reason == "not a training pod"


def test_opt_out_label() -> None:
    raw = _simple(command=["t"])
    raw["metadata"]["labels"]["ftagent.io/inject"] = "false"
    assert mutate(raw, "ml", SETTINGS).patch == []


def test_host_network_ports_never_collide_within_a_job() -> None:
    """8 ranks per node, hostNetwork: every rank of a job up to the span has its own port,
    declared as a host port (the scheduler keeps equal ports off one node)."""
    ports = [metrics_port_for("ml", "rdma-train", r, SETTINGS) for r in range(100)]
    assert len(set(ports)) == 100 and min(ports) >= 9440 and max(ports) <= 9539
    pods = [p for p in PODS if p.example == "indexed-job.yaml"]
    seen = set()
    for ex in pods:
        pod, _ = apply(ex.pod)
        port = next(p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == PORT_NAME)
        assert port["hostPort"] == port["containerPort"]
        seen.add(port["containerPort"])
    assert len(seen) == len(pods) == 16
    # jobs do not all start at the same port
    assert len({metrics_port_for("ml", f"job-{i}", 0, SETTINGS) for i in range(20)}) > 10
