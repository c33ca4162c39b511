"""Job membership from the job's controller (issue 33, item 2): the real
``ftagent arbiter --kube`` against the fake API server, agents with real pod-bound tokens.

On the code before, membership was the ``ftagent.io/job`` label: any pod creator in the
namespace labelled a pod ``ftagent.io/job=llm``, registered a rank of ``llm`` with its own
pod's token (and could then stop the job with its faults), and one pod whose annotations
said "world size 1" registered a Hello of world size 100,000, every rank of which was its
own (ranks per pod = Hello's world / labels' world)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

pytest.importorskip("kubernetes")

from tests.arbiter_helpers import ArbiterProcess  # noqa: E402
from tests.integration.test_arbiter_kube_identity import (  # noqa: E402
    ARBITER_NS,
    JOB,
    NS,
    SECRET,
    connect,
    token,
)
from tests.integration.test_arbiter_security import hello  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402


def _owner(obj: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
            "name": obj["metadata"]["name"], "uid": obj["metadata"]["uid"],
            "controller": True}


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        for n in ("n1", "n2"):
            fake.add_node(n)
        ptj = fake.create("pytorchjobs.kubeflow.org", {
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": "llm", "namespace": NS},
            "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1},
                                             "Worker": {"replicas": 1}}}})
        for i, (role, node) in enumerate((("master", "n1"), ("worker", "n2"))):
            fake.add_pod(NS, f"llm-{role}-0", node=node, owner=_owner(ptj), labels={
                JOB: "llm", "training.kubeflow.org/job-name": "llm",
                "training.kubeflow.org/replica-type": role,
                "training.kubeflow.org/replica-index": "0"},
                containers=[{"name": "pytorch", "image": "t", "env": [
                    {"name": "PET_NNODES", "value": "2"},
                    {"name": "PET_NODE_RANK", "value": str(i)}]}])
        # the intruders: pods of another creator in the same namespace, with llm's labels
        fake.add_pod(NS, "intruder-bare", node="n1", labels={JOB: "llm"})
        own_job = fake.create("jobs.batch", {"apiVersion": "batch/v1", "kind": "Job",
                                       "metadata": {"name": "llm", "namespace": NS},
                                       "spec": {"completions": 1}})
        fake.add_pod(NS, "intruder-job", node="n2", labels={JOB: "llm"}, owner=_owner(own_job))
        # a pod whose own labels say "1 pod" and whose container runs one rank
        fake.add_pod(NS, "solo-0", node="n1", labels={JOB: "solo"})
        fake.patch("pods", "solo-0", {"metadata": {"annotations": {
            "ftagent.io/rank": "0", "ftagent.io/world-size": "1"}}}, NS)
        fake.add_pod(ARBITER_NS, "node-agent-n1", node="n1")
        yield fake


@pytest.fixture(scope="module")
def arbiter(kube: FakeKube) -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--kube", "--kube-api", kube.url, "--token", SECRET,
                        "--metrics-port", "-1", env={"POD_NAMESPACE": ARBITER_NS}) as a:
        yield a


def test_the_jobs_own_pods_register(kube: FakeKube, arbiter: ArbiterProcess) -> None:
    msg = hello("llm", rank=0, world=2, namespace=NS, pod="llm-master-0", node="n1")
    code, details = connect(arbiter, token(kube, "llm-master-0"), msg)
    assert code == grpc.StatusCode.OK, details


@pytest.mark.parametrize(("pod", "node"), [("intruder-bare", "n1"), ("intruder-job", "n2")])
def test_a_foreign_pod_with_the_jobs_labels_cannot_join_it(
        kube: FakeKube, arbiter: ArbiterProcess, pod: str, node: str) -> None:
    msg = hello("llm", rank=1, world=2, namespace=NS, pod=pod, node=node)
    code, details = connect(arbiter, token(kube, pod), msg)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "no member of job 'llm'" in details and "PyTorchJob llm" in details
    # nor as a spare (which claims no rank): still no member
    msg = hello("llm", rank=0, world=2, namespace=NS, pod=pod, node=node, spare=True)
    code, details = connect(arbiter, token(kube, pod), msg)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details


def test_a_world_size_is_not_the_pods_to_raise(kube: FakeKube, arbiter: ArbiterProcess
                                               ) -> None:
    # the controller's spec says 2 pods of 1 rank: a Hello of 4 is refused
    msg = hello("llm", rank=1, world=4, namespace=NS, pod="llm-worker-0", node="n2")
    code, details = connect(arbiter, token(kube, "llm-worker-0"), msg)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "world size mismatch" in details


def test_one_pod_token_cannot_register_a_hundred_thousand_ranks(
        kube: FakeKube, arbiter: ArbiterProcess) -> None:
    tok = token(kube, "solo-0")
    for rank in (0, 99_999):
        msg = hello("solo", rank=rank, world=100_000, namespace=NS, pod="solo-0", node="n1")
        code, details = connect(arbiter, tok, msg)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert "world size mismatch" in details
    code, details = connect(arbiter, tok, hello("solo", rank=0, world=1, namespace=NS,
                                                pod="solo-0", node="n1"))
    assert code == grpc.StatusCode.OK, details
