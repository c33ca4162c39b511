"""The uninjected-pods gauge lists only what it needs (issue 33, item 4): on the code
before, its informer listed every pod of the cluster (``GET /api/v1/pods``, no selector)
and held the whole list as Python objects before projecting it, so other tenants' pods set
the arbiter's memory. Now: Running pods of opted-in namespaces, per namespace, per page."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("kubernetes")

from prometheus_client import CollectorRegistry  # noqa: E402

from ftagent.kube.client import api_client  # noqa: E402
from ftagent.kube.informer import pod_informer  # noqa: E402
from ftagent.kube.uninjected import METRIC, view, watch_uninjected  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402

KF = {"training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-type": "worker"}


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval=60.0) as f:
        yield f


def test_pods_outside_opted_in_namespaces_are_never_listed(fake: FakeKube) -> None:
    fake.create("namespaces", {"metadata": {"name": "ml", "labels": {"ftagent.io/inject":
                                                                       "true"}}})
    fake.create("namespaces", {"metadata": {"name": "tenant"}})
    for i in range(50):  # another tenant's pods, training pods among them
        fake.add_pod("tenant", f"t-{i}", dict(KF))
    fake.add_pod("ml", "missed", dict(KF))
    fake.add_pod("ml", "done", dict(KF), phase="Succeeded")
    registry = CollectorRegistry()
    stoppable = watch_uninjected(api_client(fake.url), None, registry)
    try:
        wait_for(lambda: registry.get_sample_value(
            METRIC, {"namespace": "ml", "reason": "not reviewed"}) == 1, what="the gauge")
        pods = [r for r in fake.requests if r.resource == "pods"]
        assert pods and all(r.namespace == "ml" for r in pods), \
            {(r.namespace, r.verb) for r in pods}
        assert all(r.query.get("fieldSelector") == "status.phase=Running" for r in pods)
        assert len(stoppable[1]) == 1  # one Running pod of ml held, nothing of tenant's
        # opting out stops the namespace's informer; its pods leave the gauge
        fake.patch("namespaces", "ml", {"metadata": {"labels": {"ftagent.io/inject":
                                                                  "false"}}})
        wait_for(lambda: len(stoppable[1]) == 0, what="ml's informer stopped")
    finally:
        for s in stoppable:
            s.stop()


def test_a_list_is_projected_page_by_page(fake: FakeKube) -> None:
    """The projection sees each object while its page is alive; the cache holds only
    projections, and an unchanged object is not projected again on a relist."""
    for i in range(25):
        fake.add_pod("ml", f"p-{i}", dict(KF))
    seen: list[str] = []

    def project(obj: dict[str, object]) -> object:
        seen.append(obj["metadata"]["name"])  # type: ignore[index]
        return view(obj)

    inf = pod_informer(api_client(fake.url), namespace="ml", project=project, page_size=10)
    inf.start()
    try:
        assert inf.wait_synced(20)
        assert inf.stats.list_pages == 3 and len(seen) == 25 and len(inf) == 25
        assert all(v is None or v.namespace == "ml" for _, v in inf.items())
        with fake.atomically():
            fake.drop_watches()
            fake.add_pod("ml", "p-new", dict(KF))
            fake.compact()  # the informer's version is now older than the history: 410
        wait_for(lambda: inf.stats.relists >= 1 and len(inf) == 26, what="a relist")
        assert sorted(seen[25:]) == ["p-new"]  # the unchanged 25 were not projected again
    finally:
        inf.stop()
