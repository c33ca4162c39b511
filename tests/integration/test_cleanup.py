"""Uninstall leaves nothing on the nodes (issue 32): ``ftagent cleanup`` (the real command,
its own process, against the fake API server) takes off what the arbiter's cordon and the
node agent's conditions wrote -- written here by the shipped code paths themselves
(``Actuator.cordon``, ``KubeNodeStatus`` with ``NodeConditions``), not by hand -- and
nothing else: a node afterwards is the node before ftagent, but for a cordon kept on
purpose. Refuses while ftagent still runs; a dry run changes nothing; conflicts are read
again; a refusal by RBAC is one line."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ftagent.kube.actuator import Actuator
from ftagent.kube.cleanup import marks, without_marks
from ftagent.node.conditions import (
    GPU_CONDITION,
    NIC_CONDITION,
    Health,
    KubeNodeStatus,
    NodeConditions,
)
from tests.conftest import ROOT
from tests.kube_fake import FakeKube

CONDITIONS = (GPU_CONDITION, NIC_CONDITION)


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube() as f:
        yield f


def cleanup(fake: FakeKube, *flags: str) -> subprocess.CompletedProcess[str]:
    """``ftagent cleanup`` in its own process, as an operator runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.run([sys.executable, "-m", "ftagent", "cleanup", "--kube-api", fake.url,
                           *flags], capture_output=True, text=True, timeout=120, env=env)


def cleanup_here(fake: FakeKube, capsys: pytest.CaptureFixture[str], *flags: str
                 ) -> subprocess.CompletedProcess[str]:
    """The same command in this process (its imports cost seconds on a loaded machine)."""
    from ftagent.cmd import cleanup as cmd

    capsys.readouterr()
    code = cmd.main(["--kube-api", fake.url, *flags])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["ftagent", "cleanup", *flags], code, out, err)


def _user_node(fake: FakeKube, name: str) -> dict[str, Any]:
    """A GPU node as the cluster has it before ftagent: labels, annotations and a taint of
    its own, the kubelet's Ready condition."""
    fake.add_node(name, labels={"nvidia.com/gpu.present": "true", "team": "ml"})
    node = fake.get("nodes", name)
    assert node is not None
    node["metadata"]["annotations"] = {"example.com/rack": "r12"}
    node["spec"]["taints"] = [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    fake.update("nodes", node)
    got = fake.get("nodes", name)
    assert got is not None
    return got


def _ftagent_was_here(fake: FakeKube, name: str, cordon: bool = True) -> None:
    """What ftagent writes on a node, through its own code."""
    api = fake.client()
    if cordon:
        assert Actuator(api).cordon(name, "GPU", "Xid 79: GPU fell off the bus", "f-1",
                                    "ml/llama")
    states = [Health(GPU_CONDITION, False, "Xid79", "GPU 3: Xid 79"),
              Health(NIC_CONDITION, True, "LinksUp", "all links up")]
    planned = NodeConditions().plan(states, 1_700_000_000.0)
    assert planned is not None
    KubeNodeStatus(api).patch_conditions(name, planned, timeout=10)


def _comparable(node: dict[str, Any]) -> dict[str, Any]:
    meta = node["metadata"]
    return {"labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {},
            "taints": node["spec"].get("taints") or [],
            "unschedulable": node["spec"].get("unschedulable", False),
            "conditions": sorted(c["type"] for c in node["status"].get("conditions") or [])}


def test_cleanup_leaves_the_node_as_it_was_before_ftagent(fake: FakeKube) -> None:
    before = _comparable(_user_node(fake, "gpu-1"))
    _user_node(fake, "gpu-2")  # never touched by ftagent
    _ftagent_was_here(fake, "gpu-1")
    dirty = fake.get("nodes", "gpu-1")
    assert dirty is not None
    found = marks(dirty, CONDITIONS)
    assert found.taints == 1 and found.labels == ("ftagent.io/cordoned",)
    assert len(found.annotations) == 7 and set(found.conditions) == set(CONDITIONS)
    assert "ftagent.io/cordon-evidence" in found.annotations  # the breaker's (node_scope.py)
    assert found.cordoned_by_ftagent and "Xid 79" in found.why

    r = cleanup(fake)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("node gpu-1: taint ftagent.io/fault") and \
        "stays cordoned" in lines[0] and "Xid 79" in lines[0] and "ml/llama" in lines[0]
    assert lines[-1] == "1 of 2 nodes cleaned"
    after = fake.get("nodes", "gpu-1")
    assert after is not None
    # everything of the cluster's kept, everything of ftagent's gone, the cordon kept
    assert _comparable(after) == {**before, "unschedulable": True}
    assert marks(after, CONDITIONS).empty
    # a second run finds nothing; --uncordon then lifts the cordon ftagent made... which it
    # no longer can tell apart (its annotation is gone): the cordon stays, as it should
    again = cleanup(fake, "--uncordon")
    assert again.returncode == 0 and again.stdout.splitlines() == ["0 of 2 nodes cleaned"]
    still = fake.get("nodes", "gpu-1")
    assert still is not None and still["spec"]["unschedulable"] is True


def test_uncordon_lifts_only_ftagents_cordons(fake: FakeKube,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("gpu-1", "gpu-2"):
        _user_node(fake, name)
    _ftagent_was_here(fake, "gpu-1")
    # gpu-2: cordoned by an administrator, with ftagent's conditions only
    node = fake.get("nodes", "gpu-2")
    assert node is not None
    node["spec"]["unschedulable"] = True
    fake.update("nodes", node)
    _ftagent_was_here(fake, "gpu-2", cordon=False)

    r = cleanup_here(fake, capsys, "--uncordon")
    assert r.returncode == 0, r.stderr
    assert "gpu-1" in r.stdout and "uncordoned" in r.stdout
    one, two = fake.get("nodes", "gpu-1"), fake.get("nodes", "gpu-2")
    assert one is not None and two is not None
    assert "unschedulable" not in one["spec"]
    assert two["spec"]["unschedulable"] is True  # not ftagent's to lift
    assert marks(one, CONDITIONS).empty and marks(two, CONDITIONS).empty


def test_it_refuses_while_ftagent_runs_and_a_dry_run_changes_nothing(fake: FakeKube,
        capsys: pytest.CaptureFixture[str]) -> None:
    _user_node(fake, "gpu-1")
    _ftagent_was_here(fake, "gpu-1")
    fake.add_pod("ml-platform", "ftagent-node-x1", labels={
        "app.kubernetes.io/name": "ftagent-node"}, node="gpu-1")
    dirty = copy.deepcopy(fake.get("nodes", "gpu-1"))

    r = cleanup_here(fake, capsys)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "ftagent still runs (1 pods: " \
        "ml-platform/ftagent-node-x1)" in r.stderr and "kubectl delete -k" in r.stderr
    assert fake.get("nodes", "gpu-1") == dirty

    fake.delete("pods", "ftagent-node-x1", namespace="ml-platform")
    dry = cleanup_here(fake, capsys, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[0].startswith("would change node gpu-1: ")
    assert "dry run: nothing changed" in dry.stdout
    assert fake.get("nodes", "gpu-1") == dirty
    assert fake.count("update", "nodes") == 1 and fake.count("patch", "nodes/status") == 1

    # --force goes on with ftagent running
    fake.add_pod("ml-platform", "ftagent-arbiter-0", labels={
        "app.kubernetes.io/name": "ftagent-arbiter"})
    forced = cleanup_here(fake, capsys, "--force")
    assert forced.returncode == 0, forced.stderr
    after = fake.get("nodes", "gpu-1")
    assert after is not None and marks(after, CONDITIONS).empty


def test_a_conflict_is_read_again_and_rbac_is_one_line(fake: FakeKube,
        capsys: pytest.CaptureFixture[str]) -> None:
    _user_node(fake, "gpu-1")
    _ftagent_was_here(fake, "gpu-1")
    fake.fail("update", "nodes", code=409, times=1)
    r = cleanup_here(fake, capsys)
    assert r.returncode == 0, r.stderr
    after = fake.get("nodes", "gpu-1")
    assert after is not None and marks(after, CONDITIONS).empty
    assert fake.count("update", "nodes") == 3  # the cordon, the conflict, the cleanup

    _ftagent_was_here(fake, "gpu-1")
    fake.forbid("update", "nodes")
    denied = cleanup_here(fake, capsys)
    assert denied.returncode == 1
    (line,) = [x for x in denied.stderr.splitlines() if x]
    assert "node gpu-1: not cleaned: 403 Forbidden" in line and "update on nodes" in line
    assert denied.stdout.splitlines()[-1] == "0 of 1 nodes cleaned, 1 not (see above; run again)"


def test_without_marks_keeps_everything_else() -> None:
    """The pure part, on shapes a real node can have: taints of others in any order, no
    labels at all, a cordon without ftagent's annotation."""
    node = {"metadata": {"name": "n", "resourceVersion": "7",
                         "annotations": {"ftagent.io/fault": "x", "other.io/a": "1"}},
            "spec": {"unschedulable": True, "taints": [
                {"key": "a", "effect": "NoExecute"},
                {"key": "ftagent.io/fault", "value": "GPU", "effect": "NoSchedule"},
                {"key": "b", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    out = without_marks(node, uncordon=True)
    assert out["metadata"] == {"name": "n", "resourceVersion": "7",
                               "annotations": {"other.io/a": "1"}}
    assert [t["key"] for t in out["spec"]["taints"]] == ["a", "b"]
    assert out["spec"]["unschedulable"] is True  # not cordoned by ftagent (no cordoned-by)
    assert out["status"] == node["status"]
    only = {"metadata": {"name": "n"}, "spec": {"taints": [{"key": "ftagent.io/fault"}]}}
    assert "taints" not in without_marks(only, uncordon=False)["spec"]
    assert marks({"metadata": "garbage", "spec": None}, CONDITIONS).empty
