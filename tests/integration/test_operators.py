"""Operators read jobs with their own Kubernetes credentials (issue 32.6): the real
``ftagent arbiter --kube --operators`` and ``ftagent status --kube-credentials`` against
the fake API server, whose TokenReview knows people's OIDC tokens and whose
SubjectAccessReview answers from RBAC rules the test grants. No shared secret is handed
to anyone: what a person may read is the cluster's RBAC's answer. On the code before, a
person's token was refused outright (only the arbiter's secret or job tokens read jobs)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytest.importorskip("kubernetes")
pytest.importorskip("jwt")

from ftagent.v1 import ftagent_pb2 as pb  # noqa: E402
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc  # noqa: E402
from ftagent.wire.credentials import bearer  # noqa: E402
from tests.arbiter_helpers import ArbiterProcess, ftagent_cmd  # noqa: E402
from tests.integration.test_arbiter_security import hello, stream_status  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402

SECRET = "admin-secret-0123456789"
SAR = "subjectaccessreviews.authorization.k8s.io"


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        fake.add_node("n1")
        for ns, job in (("team", "alpha"), ("other", "beta")):
            fake.add_pod(ns, f"{job}-0", labels={"ftagent.io/job": job}, node="n1")
            fake.patch("pods", f"{job}-0", {"metadata": {"annotations": {
                "ftagent.io/rank": "0", "ftagent.io/world-size": "1"}}}, ns)
        fake.allow("alice", ("get", "list", "watch"), namespace="team")
        fake.allow("group:sre", ("get", "list", "watch"))  # cluster-wide
        fake.allow("carol", "get", namespace="other", names=("beta",))
        yield fake


@pytest.fixture(scope="module")
def arbiter(kube: FakeKube) -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--kube", "--kube-api", kube.url, "--token", SECRET, "--operators",
                        "--metrics-port", "-1", env={"POD_NAMESPACE": "ftagent"}) as a:
        for ns, job in (("team", "alpha"), ("other", "beta")):  # each job registers
            tok = kube.mint_token(ns, "trainer", pod=f"{job}-0").token
            msg = hello(job, rank=0, world=1, namespace=ns, pod=f"{job}-0", node="n1")
            deadline = time.monotonic() + 20
            while True:
                code, details = stream_status(a.address, [msg.SerializeToString()], tok,
                                              welcome_ends=True)
                if code == grpc.StatusCode.OK or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert code == grpc.StatusCode.OK, details
        yield a


def _get(arbiter: ArbiterProcess, token: str, job: str, ns: str) -> grpc.StatusCode:
    with grpc.insecure_channel(arbiter.address) as ch:
        try:
            info = pb_grpc.ArbiterStub(ch).GetJob(pb.GetJobRequest(job=job, namespace=ns),
                                                  metadata=bearer(token), timeout=15)
            assert info.job == job
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def _list(arbiter: ArbiterProcess, token: str) -> set[str]:
    with grpc.insecure_channel(arbiter.address) as ch:
        got = pb_grpc.ArbiterStub(ch).ListJobs(pb.ListJobsRequest(), metadata=bearer(token),
                                               timeout=15)
    return {f"{j.namespace}/{j.job}" for j in got.jobs}


def test_the_clusters_rbac_decides_what_a_person_reads(kube: FakeKube,
                                                       arbiter: ArbiterProcess) -> None:
    alice, bob = kube.user_token("alice"), kube.user_token("bob")
    sre, carol = kube.user_token("dana", groups=("sre",)), kube.user_token("carol")
    assert _get(arbiter, alice, "alpha", "team") == grpc.StatusCode.OK
    assert _get(arbiter, alice, "beta", "other") == grpc.StatusCode.PERMISSION_DENIED
    assert _get(arbiter, bob, "alpha", "team") == grpc.StatusCode.PERMISSION_DENIED
    assert _get(arbiter, sre, "beta", "other") == grpc.StatusCode.OK
    assert _get(arbiter, carol, "beta", "other") == grpc.StatusCode.OK  # resourceNames
    assert _get(arbiter, carol, "alpha", "team") == grpc.StatusCode.PERMISSION_DENIED
    assert _list(arbiter, alice) == {"team/alpha"}
    assert _list(arbiter, bob) == set()
    assert _list(arbiter, sre) >= {"team/alpha", "other/beta"}
    assert _list(arbiter, carol) == set()  # a named grant lists nothing
    asked = [r for r in kube.requests if r.resource == SAR]
    assert asked and all(r.body["spec"]["resourceAttributes"]["group"] == "ftagent.io"
                         and r.body["spec"]["resourceAttributes"]["resource"] == "ftagentjobs"
                         for r in asked)
    # a token the API server does not know is no one
    assert _get(arbiter, kube.user_token("x")[:-8] + "AAAAAAAA", "alpha", "team") == \
        grpc.StatusCode.UNAUTHENTICATED


def test_a_person_never_acts_as_an_agent_or_a_node(kube: FakeKube,
                                                   arbiter: ArbiterProcess) -> None:
    sre = kube.user_token("erin", groups=("sre",))  # may read every job
    msg = hello("alpha", rank=0, world=1, namespace="team", pod="alpha-0", node="n1")
    code, details = stream_status(arbiter.address, [msg.SerializeToString()], sre)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    with grpc.insecure_channel(arbiter.address) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.ArbiterStub(ch).ReportNode(pb.NodeReport(node="n1"), metadata=bearer(sre),
                                           timeout=15)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_status_presents_the_kubeconfigs_token(kube: FakeKube, arbiter: ArbiterProcess,
                                               tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": kube.url}}],
        "users": [{"name": "alice", "user": {"token": kube.user_token("alice")}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "alice"}}]}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FTAGENT_")},
           "KUBECONFIG": str(config)}

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ftagent_cmd("status", "--arbiter", arbiter.address,
                                            "--kube-credentials", *args)],
                              env=env, capture_output=True, text=True, timeout=60)

    ok = status("--namespace", "team", "alpha", "--json")
    assert ok.returncode == 0, ok.stderr
    assert '"job": "alpha"' in ok.stdout
    denied = status("--namespace", "other", "beta")
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr, denied.stderr
    listed = status("--json")
    assert listed.returncode == 0 and '"alpha"' in listed.stdout \
        and '"beta"' not in listed.stdout, listed.stdout
    both = status("--token", SECRET)
    assert both.returncode == 2 and "give one" in both.stderr
