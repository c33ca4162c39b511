"""Visible fail-open: the arbiter's gauge of training pods in opted-in namespaces running
without the agent (ftagent/kube/uninjected.py), pure and through real informers against
the project's fake API server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from prometheus_client import CollectorRegistry  # noqa: E402

from ftagent.kube.client import api_client  # noqa: E402
from ftagent.kube.uninjected import (  # noqa: E402
    METRIC,
    PodView,
    count,
    view,
    watch_uninjected,
    without_agent,
)
from tests.conftest import wait_for  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402

KF = {"training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-type": "worker"}


def pod(ns: str = "ml", labels: dict[str, str] | None = None, injected: str | None = None,
        phase: str = "Running") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": ns, "labels": labels or dict(KF)}
    if injected is not None:
        meta["annotations"] = {"ftagent.io/injected": injected}
    return {"metadata": meta, "spec": {"containers": [{"name": "pytorch"}]},
            "status": {"phase": phase}}


@pytest.mark.parametrize("p,expected", [
    (pod(), ("ml", "not reviewed")),
    (pod(injected="true (kubeflow, container pytorch, named 'pytorch')"), None),
    (pod(injected="skipped: no command"), ("ml", "skipped")),
    (pod(phase="Pending"), None),
    (pod(labels={"app": "web"}), None),  # no training pod
    (pod(labels={"batch.kubernetes.io/job-name": "backup"}), None),  # a plain Job
    (pod(labels={"app": "x", "ftagent.io/inject": "true"}), ("ml", "not reviewed")),
    (pod(labels={**KF, "ftagent.io/inject": "false"}), None),  # opted out
    ({"metadata": None, "status": {"phase": "Running"}}, None),
    ({"status": None}, None),
])
def test_which_pods_run_without_the_agent(p: dict[str, Any], expected: Any) -> None:
    assert without_agent(p) == expected


def injected(name: str, arbiter: bool = True, start: str = "2026-01-01T00:00:00Z"
             ) -> dict[str, Any]:
    p = pod(injected="true (kubeflow)")
    p["metadata"]["name"] = name
    p["status"]["startTime"] = start
    if arbiter:
        p["spec"]["containers"][0]["env"] = [{"name": "FTAGENT_ARBITER", "value": "a:9400"}]
    return p


T0 = 1767225600.0  # 2026-01-01T00:00:00Z


def test_an_injected_pod_whose_agent_never_connects() -> None:
    """Injected with an arbiter (the agent fell back in its image, or cannot reach the
    arbiter): counted once it has run past the grace, with no stream of its pod, while
    this arbiter leads; pods without an arbiter to report to are never counted."""
    assert view(injected("a")) == PodView("ml", "a", "", T0)
    assert view(injected("b", arbiter=False)) is None
    assert view(injected("c", start="garbage")) == PodView("ml", "c", "", None)
    pods = [("ml/a", view(injected("a"))), ("ml/b", view(injected("b", arbiter=False))),
            ("ml/m", view(pod())), ("x/a", PodView("x", "a", "", T0))]
    opted = {"ml"}
    assert count(pods, opted, set(), T0 + 121) == {("ml", "agent not connected"): 1,
                                                   ("ml", "not reviewed"): 1}
    assert count(pods, opted, {("ml", "a")}, T0 + 121) == {("ml", "not reviewed"): 1}
    assert count(pods, opted, set(), T0 + 60) == {("ml", "not reviewed"): 1}  # in grace
    assert count(pods, opted, None, T0 + 121) == {("ml", "not reviewed"): 1}  # follower


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval=60.0) as f:
        yield f


def test_gauge_from_the_watches(fake: FakeKube) -> None:
    """Opted-in namespace ``ml``: one pod the webhook never saw, one it skipped, one
    injected, a plain Job's pod; namespace ``other`` (not opted in) has an uninjected
    training pod that is not counted. Changes reach the gauge through the watches."""
    fake.create("namespaces", {"metadata": {"name": "ml", "labels": {"ftagent.io/inject":
                                                                       "true"}}})
    fake.create("namespaces", {"metadata": {"name": "other"}})
    fake.add_pod("ml", "missed", dict(KF))
    fake.add_pod("ml", "no-command", dict(KF))
    fake.patch("pods", "no-command", {"metadata": {"annotations": {
        "ftagent.io/injected": "skipped: no command"}}}, "ml")
    fake.add_pod("ml", "fine", dict(KF))
    fake.patch("pods", "fine", {"metadata": {"annotations": {
        "ftagent.io/injected": "true (kubeflow)"}}}, "ml")
    fake.add_pod("ml", "backup", {"batch.kubernetes.io/job-name": "backup"})
    fake.add_pod("other", "missed", dict(KF))
    registry = CollectorRegistry()
    informers = watch_uninjected(api_client(fake.url), None, registry)
    try:
        def value(ns: str, reason: str) -> float | None:
            return registry.get_sample_value(METRIC, {"namespace": ns, "reason": reason})

        wait_for(lambda: value("ml", "not reviewed") == 1, what="the missed pod")
        assert value("ml", "skipped") == 1
        assert value("other", "not reviewed") is None
        fake.add_pod("ml", "missed-2", dict(KF))
        wait_for(lambda: value("ml", "not reviewed") == 2, what="a second missed pod")
        fake.delete("pods", "missed", "ml")
        fake.delete("pods", "missed-2", "ml")
        wait_for(lambda: value("ml", "not reviewed") == 0, what="the missed pods gone")
        fake.patch("namespaces", "other", {"metadata": {"labels": {"ftagent.io/inject":
                                                                    "true"}}})
        wait_for(lambda: value("other", "not reviewed") == 1, what="namespace opted in")
    finally:
        for inf in informers:
            inf.stop()
