"""Uncordon on the node agent's word (issue 33, item 1), end to end: the real
``ftagent arbiter --kube --uncordon-after 1`` against the fake API server; the node agent's
real projected token (ServiceAccount ftagent-node, bound to a pod on its node) says
``NodeReport.healthy``. On the code before there was no uncordon path: a node ftagent
cordoned stayed cordoned, and counted, until an operator acted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

pytest.importorskip("kubernetes")

from ftagent.v1 import ftagent_pb2 as pb  # noqa: E402
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc  # noqa: E402
from ftagent.wire.credentials import bearer  # noqa: E402
from tests.arbiter_helpers import ArbiterProcess  # noqa: E402
from tests.integration.test_arbiter_kube_identity import ARBITER_NS, SECRET  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402

CORDON = {"ftagent.io/cordoned-by": "ftagent-arbiter",
          "ftagent.io/cordoned-at": "2026-01-01T00:00:00Z", "ftagent.io/fault-job": "t/llm",
          "ftagent.io/fault-kind": "gpu", "ftagent.io/cordon-evidence": "node-agent"}


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        for name, notes, taints in (
                ("n1", CORDON, [{"key": "ftagent.io/fault", "value": "gpu",
                                 "effect": "NoSchedule"}]),
                ("n2", {}, [])):  # n2: an operator's own cordon
            fake.create("nodes", {"metadata": {"name": name, "annotations": dict(notes)},
                                  "spec": {"unschedulable": True, "taints": taints}})
            fake.add_pod(ARBITER_NS, f"node-agent-{name}", node=name)
        yield fake


@pytest.fixture(scope="module")
def arbiter(kube: FakeKube) -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--kube", "--kube-api", kube.url, "--token", SECRET,
                        "--metrics-port", "-1", "--uncordon-after", "1",
                        env={"POD_NAMESPACE": ARBITER_NS}) as a:
        yield a


def _node(kube: FakeKube, name: str) -> dict[str, Any]:
    got: Any = kube.get("nodes", name)
    return dict(got)


def test_a_node_agent_saying_healthy_gets_ftagents_cordon_undone(
        kube: FakeKube, arbiter: ArbiterProcess) -> None:
    tokens = {n: kube.mint_token(ARBITER_NS, "ftagent-node", pod=f"node-agent-{n}").token
              for n in ("n1", "n2")}
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(arbiter.address) as ch:
        stub = pb_grpc.ArbiterStub(ch)
        while time.monotonic() < deadline:
            for n, tok in tokens.items():  # heartbeats, as `ftagent node` sends them
                try:
                    stub.ReportNode(pb.NodeReport(node=n, healthy=True),
                                    metadata=bearer(str(tok)), timeout=10)
                except grpc.RpcError as e:  # the pod watch has not seen the agent yet
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            if not _node(kube, "n1")["spec"].get("unschedulable"):
                break
            time.sleep(0.2)  # noqa: ASYNC251 -- the heartbeat's own period, not a wait
    n1 = _node(kube, "n1")
    assert not n1["spec"].get("unschedulable"), "n1 was never uncordoned"
    assert not n1["spec"].get("taints")
    assert "ftagent.io/cordoned-by" not in n1["metadata"].get("annotations", {})
    # the operator's cordon of n2 is not ftagent's to undo
    assert _node(kube, "n2")["spec"].get("unschedulable") is True
