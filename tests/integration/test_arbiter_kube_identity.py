"""Identity from the cluster (issue 20): the real ``ftagent arbiter --kube`` against the
fake API server, agents presenting real pod-bound projected ServiceAccount tokens checked
with TokenReview. Every attack of the issue that these cover succeeded on the code before
(a job token or any bearer was taken at its Hello's word): here it is refused, with the
mismatch named."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("kubernetes")

from ftagent.v1 import ftagent_pb2 as pb  # noqa: E402
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc  # noqa: E402
from ftagent.wire.credentials import bearer  # noqa: E402
from tests.arbiter_helpers import ArbiterProcess, ftagent_cmd  # noqa: E402
from tests.integration.test_arbiter_security import hello, stream_status  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402

SECRET = "admin-secret-0123456789"  # so that no anonymous caller exists
NS = "team"
ARBITER_NS = "ftagent"
JOB = "ftagent.io/job"


def _pod(fake: FakeKube, name: str, job: str, node: str, rank: int | None = None,
         world: int = 2) -> None:
    notes = {} if rank is None else {"ftagent.io/rank": str(rank),
                                     "ftagent.io/world-size": str(world)}
    fake.add_pod(NS, name, labels={JOB: job}, node=node)
    if notes:
        fake.patch("pods", name, {"metadata": {"annotations": notes}}, NS)


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        for n in ("n1", "n2"):
            fake.add_node(n)
        _pod(fake, "a-0", "alpha", "n1", rank=0)
        _pod(fake, "a-1", "alpha", "n2", rank=1)
        _pod(fake, "b-0", "beta", "n2", rank=0)
        _pod(fake, "free-0", "gamma", "n1")  # labels give no rank
        _pod(fake, "free-1", "gamma", "n2")
        fake.add_pod(ARBITER_NS, "node-agent-n1", node="n1")
        yield fake


@pytest.fixture(scope="module")
def arbiter(kube: FakeKube) -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--kube", "--kube-api", kube.url, "--token", SECRET,
                        "--restart-ceiling", "7", "--metrics-port", "-1",
                        env={"POD_NAMESPACE": ARBITER_NS}) as a:
        yield a


def token(kube: FakeKube, pod: str, namespace: str = NS, **kw: object) -> str:
    sa = "ftagent-node" if namespace == ARBITER_NS else "trainer"
    return kube.mint_token(namespace, sa, pod=pod, **kw).token  # type: ignore[arg-type]


def connect(arbiter: ArbiterProcess, tok: str, msg: pb.AgentMessage,
            timeout: float = 15.0) -> tuple[grpc.StatusCode, str]:
    """Connect with ``tok`` and say ``msg``; UNAVAILABLE (the pod watch has not seen the pod
    yet) is retried, as the agent retries it."""
    deadline = time.monotonic() + timeout
    while True:
        code, details = stream_status(arbiter.address, [msg.SerializeToString()], tok,
                                      welcome_ends=True)
        if code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
            return code, details
        time.sleep(0.1)


def own(pod: str, job: str, rank: int, node: str, **kw: object) -> pb.AgentMessage:
    return hello(job, rank=rank, world=2, namespace=NS, pod=pod, node=node, **kw)


def test_a_pod_registers_as_itself(kube: FakeKube, arbiter: ArbiterProcess) -> None:
    code, details = connect(arbiter, token(kube, "a-0"), own("a-0", "alpha", 0, "n1"))
    assert code == grpc.StatusCode.OK, details


@pytest.mark.parametrize(("claim", "what"), [
    (dict(pod="a-1"), "pod mismatch"),            # another rank's pod of the same job
    (dict(node="n2"), "node mismatch"),           # a node it does not run on
    (dict(job="beta"), "job mismatch"),           # another job of its namespace
    (dict(namespace="kube-system", job="coredns"), "namespace mismatch"),
    (dict(rank=1), "rank mismatch"),              # its labels say rank 0
])
def test_a_hello_that_disagrees_with_the_verified_pod_is_refused(
        kube: FakeKube, arbiter: ArbiterProcess, claim: dict[str, object], what: str) -> None:
    h = pb.Hello(job="alpha", rank=0, world_size=2, namespace=NS, pod="a-0", node="n1")
    for k, v in claim.items():
        setattr(h, k, v)
    msg = pb.AgentMessage(hello=h)
    code, details = connect(arbiter, token(kube, "a-0"), msg)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert what in details


@pytest.mark.parametrize("bad", ["audience", "expired", "deleted", "forged"])
def test_tokens_the_api_server_refuses_are_unauthenticated(
        kube: FakeKube, arbiter: ArbiterProcess, bad: str) -> None:
    if bad == "audience":
        tok = token(kube, "b-0", audiences=("vault",))
    elif bad == "expired":
        tok = token(kube, "b-0", expiration_seconds=-1)
    elif bad == "deleted":
        _pod(kube, "gone-0", "beta", "n1")
        tok = token(kube, "gone-0")
        kube.delete("pods", "gone-0", NS)
    else:
        head, body, _ = token(kube, "b-0").split(".")
        tok = f"{head}.{body}.AAAA"
    msg = own("b-0", "beta", 0, "n2")
    code, details = connect(arbiter, tok, msg)
    if bad == "deleted":
        # Verified locally, a deleted pod's token is refused once the arbiter's pod watch
        # has seen the deletion; until then it is refused as a pod that is not the Hello's.
        # Never accepted on the way.
        deadline = time.monotonic() + 10
        while code != grpc.StatusCode.UNAUTHENTICATED and time.monotonic() < deadline:
            assert code == grpc.StatusCode.PERMISSION_DENIED, details
            time.sleep(0.05)
            code, details = connect(arbiter, tok, msg)
    assert code == grpc.StatusCode.UNAUTHENTICATED, details


def test_a_rank_belongs_to_the_pod_that_registered_it(kube: FakeKube,
                                                       arbiter: ArbiterProcess) -> None:
    assert connect(arbiter, token(kube, "free-0"), own("free-0", "gamma", 0, "n1"))[0] \
        == grpc.StatusCode.OK  # registered, then disconnected (the call ended)
    # another pod of the job, its agent just gone: the rank is not free to take
    code, details = connect(arbiter, token(kube, "free-1"), own("free-1", "gamma", 0, "n2"))
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "belongs to pod free-0" in details
    # nor for the job's HMAC token holder (the admin secret here: any credential)
    code, details = connect(arbiter, SECRET, own("free-1", "gamma", 0, "n2"))
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    # the pod gone (replaced), its successor takes the rank
    kube.delete("pods", "free-0", NS)
    deadline = time.monotonic() + 15
    while True:
        code, details = connect(arbiter, token(kube, "free-1"), own("free-1", "gamma", 0, "n2"))
        if code == grpc.StatusCode.OK or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert code == grpc.StatusCode.OK, details


def test_restart_budget_is_capped_by_the_arbiter(kube: FakeKube, arbiter: ArbiterProcess
                                                 ) -> None:
    _pod(kube, "d-0", "delta", "n1", rank=0)
    tok = token(kube, "d-0")
    msg = own("d-0", "delta", 0, "n1", max_restarts=1_000_000)
    deadline = time.monotonic() + 15
    while True:
        with grpc.insecure_channel(arbiter.address) as ch:
            call = ch.stream_stream("/ftagent.v1.Arbiter/Connect")(
                iter([msg.SerializeToString()]), metadata=bearer(tok), timeout=10)
            try:
                first = pb.ArbiterMessage.FromString(next(iter(call)))
                call.cancel()
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
        time.sleep(0.1)
    assert first.welcome.max_restarts == 7


def test_review_outage_stops_no_locally_verified_pod(kube: FakeKube,
                                                     arbiter: ArbiterProcess) -> None:
    """Pods' tokens are verified with the issuer's published keys (kube/projected.py): a
    TokenReview outage stops no agent. (Where the keys cannot be read, the outage answers
    UNAVAILABLE, never anonymous: test_projected_identity.py.)"""
    # an established stream (pod a-1, connected before the outage) is kept through it
    held_token = token(kube, "a-1")
    assert connect(arbiter, held_token, own("a-1", "alpha", 1, "n2"))[0] == grpc.StatusCode.OK
    with grpc.insecure_channel(arbiter.address) as ch:
        msgs = [own("a-1", "alpha", 1, "n2"),
                pb.AgentMessage(progress=pb.ProgressSummary(step=7))]
        done = threading.Event()

        def requests() -> Iterator[bytes]:  # then keep the stream open (no half-close)
            yield from (m.SerializeToString() for m in msgs)
            done.wait(30)

        call = ch.stream_stream("/ftagent.v1.Arbiter/Connect")(
            requests(), metadata=bearer(held_token), timeout=30)
        replies = iter(call)
        assert pb.ArbiterMessage.FromString(next(replies)).WhichOneof("body") == "welcome"
        kube.forbid("create", "tokenreviews.authentication.k8s.io", times=None)
        try:
            code, details = connect(arbiter, token(kube, "b-0"), own("b-0", "beta", 0, "n2"))
            assert code == grpc.StatusCode.OK, details
            stub = pb_grpc.ArbiterStub(ch)
            deadline = time.monotonic() + 10
            while True:  # the held stream's progress still arrives during the outage
                info = stub.GetJob(pb.GetJobRequest(job="alpha", namespace=NS),
                                   metadata=bearer(SECRET), timeout=10)
                rank1 = next(r for r in info.ranks if r.rank == 1)
                if (rank1.connected and rank1.step == 7) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert rank1.connected and rank1.step == 7, info
        finally:
            kube.clear_faults()
            done.set()
            call.cancel()
    code, details = connect(arbiter, token(kube, "b-0"), own("b-0", "beta", 0, "n2"))
    assert code == grpc.StatusCode.OK, details


def test_node_agent_token_reports_only_for_its_node(kube: FakeKube,
                                                    arbiter: ArbiterProcess) -> None:
    tok = token(kube, "node-agent-n1", namespace=ARBITER_NS)
    with grpc.insecure_channel(arbiter.address) as ch:
        stub = pb_grpc.ArbiterStub(ch)
        for node, ok in (("n2", False), ("n1", True)):
            try:
                stub.ReportNode(pb.NodeReport(node=node), metadata=bearer(tok), timeout=10)
                assert ok, f"a report for {node} was accepted"
            except grpc.RpcError as e:
                assert not ok, e.details()
                assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e.details()
        # and a pod's own token reports for no node at all, not even its own
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportNode(pb.NodeReport(node="n1"), metadata=bearer(token(kube, "a-0")),
                            timeout=10)
        assert err.value.code() in (grpc.StatusCode.PERMISSION_DENIED,
                                    grpc.StatusCode.UNAVAILABLE)


def test_agent_presents_its_token_file_and_the_trainer_never_sees_it(
        kube: FakeKube, arbiter: ArbiterProcess, tmp_path: Path) -> None:
    """C2: ``ftagent run --token-file`` (FTAGENT_TOKEN_FILE, as the webhook sets it) reads the
    projected token at connect; FTAGENT_TOKEN and FTAGENT_TOKEN_FILE are not in the
    trainer's environment; ``ftagent status --token-file`` reads the pod's own job."""
    _pod(kube, "e-0", "echo", "n1", rank=0, world=1)
    path = kube.token_file(tmp_path / "ftagent", NS, "e-0", service_account="trainer")
    env = {**os.environ, "FTAGENT_TOKEN_FILE": str(path), "FTAGENT_TOKEN": "not-this-one",
           "POD_NAMESPACE": NS, "POD_NAME": "e-0", "NODE_NAME": "n1"}
    trainer = ("import os; print('CREDENTIALS', sorted(k for k in os.environ "
               "if k.startswith('FTAGENT_TOKEN')))")
    deadline = time.monotonic() + 60
    while True:  # the arbiter's pod watch may not have seen e-0 yet (UNAVAILABLE: retry)
        out = subprocess.run(
            [*ftagent_cmd("run", "--arbiter", arbiter.address, "--job", "echo", "--rank", "0",
                          "--world-size", "1", "--metrics-port", "-1",
                          "--arbiter-fail-open-after", "30", "--", "python3", "-c", trainer)],
            env=env, capture_output=True, text=True, timeout=90)
        if "CREDENTIALS" in out.stdout or time.monotonic() > deadline:
            break
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CREDENTIALS []" in out.stdout, out.stdout
    status = subprocess.run([*ftagent_cmd("status", "--arbiter", arbiter.address,
                                          "--token-file", str(path), "echo", "--json")],
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith("FTAGENT_")},
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert '"job": "echo"' in status.stdout and "e-0" in status.stdout, status.stdout[-2000:]


def test_tls_secret_is_created_at_first_start_and_agents_verify_it(kube: FakeKube,
                                                                  tmp_path: Path) -> None:
    """C4: ``--tls-secret`` with no Secret yet: the arbiter creates it (self-signed CA, a
    certificate for the Service's names) and serves TLS; a client verifying with the
    Secret's ca.crt connects, a plaintext client does not. A second arbiter reads the same
    Secret. Beyond loopback, --kube without TLS or --insecure refuses to start."""
    import base64

    args = ("--kube", "--kube-api", kube.url, "--token", SECRET, "--metrics-port", "-1",
            "--tls-secret", "ftagent-arbiter-tls", "--tls-service", "localhost")
    env = {"POD_NAMESPACE": ARBITER_NS}
    with ArbiterProcess(*args, env=env) as a:
        secret = kube.get("secrets", "ftagent-arbiter-tls", ARBITER_NS)
        assert secret is not None and secret["type"] == "kubernetes.io/tls"
        ca = base64.b64decode(secret["data"]["ca.crt"])
        port = a.address.rpartition(":")[2]
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        with grpc.secure_channel(f"localhost:{port}", creds) as ch:
            got = pb_grpc.ArbiterStub(ch).ListJobs(pb.ListJobsRequest(),
                                                   metadata=bearer(SECRET), timeout=10)
            assert got is not None
        with grpc.insecure_channel(a.address) as ch, pytest.raises(grpc.RpcError):
            pb_grpc.ArbiterStub(ch).ListJobs(pb.ListJobsRequest(), metadata=bearer(SECRET),
                                             timeout=5)
    # the next start reads it and makes none (what a second replica does)
    from ftagent.kube.certs import ensure_secret

    pems, created = ensure_secret(kube.client(), ARBITER_NS, "ftagent-arbiter-tls", ["x"])
    assert not created and pems.ca == ca
    # beyond loopback: plaintext --kube is refused (exit 2, the remedy named)
    from ftagent.cmd.arbiter import check_authority, parse
    from ftagent.config import ConfigError

    with pytest.raises(ConfigError, match="--tls-secret .*--insecure"):
        check_authority(parse(["--kube", "--listen", "0.0.0.0:9400"], {}))
    check_authority(parse(["--kube", "--listen", "0.0.0.0:9400", "--insecure"], {}))


def test_a_verified_node_agents_xid_replaces_and_cordons_end_to_end(
        kube: FakeKube, arbiter: ArbiterProcess, tmp_path: Path) -> None:
    """The whole chain with real processes and real token files: two ranks (ArbiterLinks
    with --token-file) on node n3, the node agent (`ftagent node --token-file`, its
    ServiceAccount ftagent-node, bound to a pod on n3) reports a fatal Xid: the job's rank
    there is replaced, its pod deleted with its uid, and n3 cordoned (node-scope evidence:
    the node's own agent)."""
    import asyncio
    import signal

    from ftagent.agent.reporter import ArbiterLink
    from ftagent.config import ArbiterClientConfig, IdentityConfig
    from ftagent.model import ActionKind
    from tests.arbiter_helpers import wait_until

    kube.add_node("n3")
    for r in range(2):
        _pod(kube, f"z-{r}", "zeta", "n3", rank=r)
    kube.add_pod(ARBITER_NS, "node-agent-n3", node="n3")
    node_token_file = kube.token_file(tmp_path / "node", ARBITER_NS, "node-agent-n3",
                                      service_account="ftagent-node")
    script = tmp_path / "gpu.txt"
    script.write_text("gpus 2\nt=1s gpu=1 xid=79\n")

    async def body() -> None:
        links = []
        for r in range(2):
            path = kube.token_file(tmp_path / f"z{r}", NS, f"z-{r}", service_account="trainer")
            links.append(ArbiterLink(
                ArbiterClientConfig(arbiter=arbiter.address, token_file=str(path)),
                IdentityConfig(job="zeta", namespace=NS, rank=r, world_size=2, pod=f"z-{r}",
                               node="n3")))
        tasks = [asyncio.create_task(link.run()) for link in links]
        try:
            await wait_until(lambda: all(link.connected for link in links), 30,
                             "both ranks registered with their pods' tokens")
            proc = subprocess.Popen(
                [*ftagent_cmd("node", "--metrics-port", "-1", "--node", "n3", "--arbiter",
                              arbiter.address, "--token-file", str(node_token_file),
                              "--gpu-backend", f"simulated:{script}", "--nic", "none",
                              "--report-interval", "0.5")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                replaced = await asyncio.wait_for(links[0].commands.get(), 30)
                assert replaced.kind is ActionKind.REPLACE and "Xid 79" in replaced.reason
                await wait_until(lambda: bool(((kube.get("nodes", "n3") or {}).get("spec")
                                               or {}).get("unschedulable")), 30, "n3 cordoned")

                def deletes() -> list[Any]:
                    return [q for q in kube.requests if q.verb == "delete"
                            and q.resource == "pods" and q.name == "z-0"]

                await wait_until(lambda: bool(deletes()), 30, "z-0 deleted (after the cordon)")
                uid = deletes()[0].body["preconditions"]["uid"]
                assert uid and uid != (kube.get("pods", "z-1", NS) or {})["metadata"]["uid"]
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        finally:
            for link in links:
                await link.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(body())


def test_a_spare_pod_registers_without_a_rank_but_only_for_its_job(
        kube: FakeKube, arbiter: ArbiterProcess) -> None:
    _pod(kube, "a-spare", "alpha", "n2", rank=2, world=3)  # an extra replica of the group
    code, details = connect(arbiter, token(kube, "a-0"), own("a-0", "alpha", 0, "n1"))
    assert code == grpc.StatusCode.OK, details
    tok = token(kube, "a-spare")
    code, details = connect(arbiter, tok, own("a-spare", "alpha", 0, "n2"))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "mismatch" in details, details
    code, details = connect(arbiter, tok, own("a-spare", "alpha", 0, "n2", spare=True))
    assert code == grpc.StatusCode.OK, details
    code, details = connect(arbiter, tok, own("a-spare", "beta", 0, "n2", spare=True))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "job mismatch" in details, details
