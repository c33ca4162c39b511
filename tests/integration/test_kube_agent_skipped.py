"""The image cannot skip the agent silently (issue 33 item 7, issue 32 "Bad input"): the
real ``ftagent arbiter --kube --agent-connect-grace 7`` against the fake API server.

A PyTorchJob of two injected pods in an opted-in namespace: the master's agent connects
(a real pod-bound token, a stream held open), the worker's never does (its image could not
start the agent and the entry shim ran the trainer alone). The worker gets exactly one
Warning Event ``FtagentAgentNotRunning`` and the gauge counts it; the master gets none.
Thirty such pods of another tenant's namespace get at most ten Events (the per-namespace
bound), all thirty counted. On the code before, no Event was written for any of them."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

pytest.importorskip("kubernetes")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ftagent.v1 import ftagent_pb2 as pb  # noqa: E402
from ftagent.wire.credentials import bearer  # noqa: E402
from tests.arbiter_helpers import ArbiterProcess  # noqa: E402
from tests.conftest import free_port, wait_for  # noqa: E402
from tests.integration.test_arbiter_kube_identity import (  # noqa: E402
    ARBITER_NS,
    JOB,
    NS,
    SECRET,
    token,
)
from tests.integration.test_arbiter_security import CONNECT, hello  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402

CROWD = "crowd"
INJECTED = {"ftagent.io/injected": "true (kubeflow, container pytorch, named 'pytorch')"}
ENV = [{"name": "FTAGENT_ARBITER", "value": "ftagent-arbiter.ftagent:9400"}]
REASON = "FtagentAgentNotRunning"


def _owner(obj: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
            "name": obj["metadata"]["name"], "uid": obj["metadata"]["uid"],
            "controller": True}


def _injected(fake: FakeKube, ns: str, name: str, **kw: Any) -> None:
    """As the webhook leaves a pod and the kubelet reports it: injected, Running, started."""
    fake.add_pod(ns, name, **kw)
    fake.patch("pods", name, {"metadata": {"annotations": dict(INJECTED)}}, ns)
    got = fake.get("pods", name, ns)
    assert got is not None
    fake.patch("pods", name, {"status": {"startTime": got["metadata"]["creationTimestamp"]}},
               ns, subresource="status")


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        for ns in (NS, CROWD):
            fake.create("namespaces", {"metadata": {"name": ns, "labels": {
                "ftagent.io/inject": "true"}}})
        for n in ("n1", "n2"):
            fake.add_node(n)
        ptj = fake.create("pytorchjobs.kubeflow.org", {
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": "llm", "namespace": NS},
            "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1},
                                             "Worker": {"replicas": 1}}}})
        for i, (role, node) in enumerate((("master", "n1"), ("worker", "n2"))):
            _injected(fake, NS, f"llm-{role}-0", node=node, owner=_owner(ptj), labels={
                JOB: "llm", "training.kubeflow.org/job-name": "llm",
                "training.kubeflow.org/replica-type": role,
                "training.kubeflow.org/replica-index": "0"},
                containers=[{"name": "pytorch", "image": "t", "env": [
                    *ENV, {"name": "PET_NNODES", "value": "2"},
                    {"name": "PET_NODE_RANK", "value": str(i)}]}])
        for i in range(30):  # another tenant's pods, none of whose agents ever connects
            _injected(fake, CROWD, f"skip-{i}", node="n1",
                      labels={"ftagent.io/inject": "true"},
                      containers=[{"name": "pytorch", "image": "t", "env": list(ENV)}])
        yield fake


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def arbiter(kube: FakeKube, metrics_port: int) -> Iterator[ArbiterProcess]:
    # the grace: the master's agent must connect within it of its pod's start (the kube
    # fixture's, in whole seconds): welcomed 1.2-2.9 s after it with a CPU hog at load 12;
    # it also sets the pass period (a quarter of it) the "three more passes" waits take
    with ArbiterProcess("--kube", "--kube-api", kube.url, "--token", SECRET,
                        "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1",
                        "--agent-connect-grace", "7", env={"POD_NAMESPACE": ARBITER_NS}) as a:
        yield a


@pytest.fixture(scope="module")
def master_agent(kube: FakeKube, arbiter: ArbiterProcess) -> Iterator[None]:
    """The master's agent: connected (Hello, Welcome) and its stream held open."""
    done = threading.Event()
    msg = hello("llm", rank=0, world=2, namespace=NS, pod="llm-master-0", node="n1")

    def says() -> Iterator[bytes]:
        yield msg.SerializeToString()
        done.wait(120)

    with grpc.insecure_channel(arbiter.address) as ch:
        def welcomed() -> Any:
            call = ch.stream_stream(CONNECT)(
                says(), metadata=bearer(token(kube, "llm-master-0")), timeout=120)
            try:
                first = pb.ArbiterMessage.FromString(next(call))
            except grpc.RpcError as e:  # the pod watch has not seen the pod yet
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                return None
            assert first.WhichOneof("body") == "welcome", first
            return call

        call = wait_for(welcomed, timeout=30, what="the master's agent welcomed",
                        interval=0.1)
        yield
        done.set()
        call.cancel()


def _gauge(port: int, namespace: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "ftagent_training_pods_without_agent" and \
                    s.labels == {"namespace": namespace, "reason": "agent not connected"}:
                return float(s.value)
    return None


def _ours(kube: FakeKube, ns: str, pod: str | None = None) -> list[dict[str, Any]]:
    return [e for e in kube.events(ns, pod) if e.get("reason") == REASON]


def test_the_pod_whose_agent_never_connects_gets_one_event_and_is_counted(
        kube: FakeKube, arbiter: ArbiterProcess, master_agent: None,
        metrics_port: int) -> None:
    wait_for(lambda: _ours(kube, NS, "llm-worker-0"), timeout=60,
             what="the worker's FtagentAgentNotRunning Event")
    wait_for(lambda: _gauge(metrics_port, NS) == 1, timeout=30,
             what="the gauge counting the worker only")
    # later passes (each logs the crowd pods it holds back) add nothing for the worker
    wait_for(lambda: arbiter.log_text().count("not announced by an Event yet") >= 3,
             timeout=60, what="three more passes")
    (ev,) = _ours(kube, NS, "llm-worker-0")
    worker = kube.get("pods", "llm-worker-0", NS)
    assert worker is not None
    assert ev["type"] == "Warning" and ev["count"] == 1
    assert ev["involvedObject"]["uid"] == worker["metadata"]["uid"]
    assert "ftagent: not started" in ev["message"]
    assert _ours(kube, NS, "llm-master-0") == []  # its agent holds a stream
    assert _gauge(metrics_port, NS) == 1


def test_many_such_pods_in_one_namespace_are_bounded(
        kube: FakeKube, arbiter: ArbiterProcess, metrics_port: int) -> None:
    wait_for(lambda: _gauge(metrics_port, CROWD) == 30, timeout=60,
             what="all thirty counted")
    wait_for(lambda: len(_ours(kube, CROWD)) >= 10, timeout=60, what="the crowd's Events")
    wait_for(lambda: arbiter.log_text().count("not announced by an Event yet") >= 3,
             timeout=60, what="three more passes")
    evs = _ours(kube, CROWD)
    assert len(evs) == 10  # the per-namespace bound per hour
    assert len({e["involvedObject"]["name"] for e in evs}) == 10  # one per pod
