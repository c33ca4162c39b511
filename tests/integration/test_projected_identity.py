"""Identity under flood (issue 33.5): the real ``ftagent arbiter --kube`` against the fake
API server, whose issuer signs with a real RSA key and serves OIDC discovery. Pods' tokens
are verified in the arbiter; the API server is asked nothing per token. On the code before,
each distinct JWT-shaped junk token cost one TokenReview (counted here at the fake), and the
honest agents' reviews queued behind the flood's."""

from __future__ import annotations

import base64
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

pytest.importorskip("kubernetes")
pytest.importorskip("jwt")

from ftagent.v1 import ftagent_pb2 as pb  # noqa: E402
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc  # noqa: E402
from ftagent.wire.credentials import bearer  # noqa: E402
from tests.arbiter_helpers import ArbiterProcess  # noqa: E402
from tests.integration.test_arbiter_security import hello, stream_status  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402
from tests.kube_fake.tokens import ISSUER  # noqa: E402

SECRET = "admin-secret-0123456789"
NS = "team"
REVIEWS = "tokenreviews.authentication.k8s.io"
JWKS = "/openid/v1/jwks"


def _pod(fake: FakeKube, name: str, rank: int = 0, job: str = "alpha") -> None:
    fake.add_pod(NS, name, labels={"ftagent.io/job": job}, node="n1")
    fake.patch("pods", name, {"metadata": {"annotations": {
        "ftagent.io/rank": str(rank), "ftagent.io/world-size": "2"}}}, NS)


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        fake.add_node("n1")
        _pod(fake, "a-0", 0)
        _pod(fake, "a-1", 1)
        yield fake


@pytest.fixture(scope="module")
def arbiter(kube: FakeKube) -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--kube", "--kube-api", kube.url, "--token", SECRET,
                        "--metrics-port", "-1", env={"POD_NAMESPACE": "ftagent"}) as a:
        yield a


def junk(n: int) -> str:
    """A distinct JWT-shaped token nobody signed, with a junk exp (in the past)."""
    def b64(obj: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()
    body = {"iss": ISSUER, "aud": ["ftagent"], "exp": n, "sub": "system:serviceaccount:team:x",
            "kubernetes.io": {"namespace": NS, "pod": {"name": "a-0", "uid": str(n)},
                              "serviceaccount": {"name": "x", "uid": "y"}}}
    sig = base64.urlsafe_b64encode(os.urandom(256)).rstrip(b"=").decode()
    return f"{b64({'alg': 'RS256', 'kid': f'junk-{n}'})}.{b64(body)}.{sig}"


def connect(arbiter: ArbiterProcess, tok: str, pod: str, rank: int,
            timeout: float = 15.0) -> tuple[grpc.StatusCode, str]:
    msg = hello("alpha", rank=rank, world=2, namespace=NS, pod=pod, node="n1")
    deadline = time.monotonic() + timeout
    while True:  # UNAVAILABLE: the pod watch has not seen the pod yet (the agent retries)
        code, details = stream_status(arbiter.address, [msg.SerializeToString()], tok,
                                      welcome_ends=True)
        if code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
            return code, details
        time.sleep(0.05)


def test_junk_tokens_cost_no_api_call_and_honest_agents_stay_fast(
        kube: FakeKube, arbiter: ArbiterProcess) -> None:
    honest = kube.mint_token(NS, "trainer", pod="a-0").token
    assert connect(arbiter, honest, "a-0", 0)[0] == grpc.StatusCode.OK  # keys loaded
    base_reviews, base_jwks = kube.count("create", REVIEWS), kube.count("get", JWKS)
    kube.slow("create", REVIEWS, 0.05)  # a real API server's rate limits, roughly
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        with grpc.insecure_channel(arbiter.address) as ch:
            stub = pb_grpc.ArbiterStub(ch)
            n = 0
            while not stop.is_set():
                futures = [stub.ListJobs.future(pb.ListJobsRequest(),
                                                metadata=bearer(junk(n + i)), timeout=30)
                           for i in range(200)]
                for f in futures:
                    try:
                        f.result()
                    except grpc.RpcError as e:
                        assert e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                            grpc.StatusCode.UNAVAILABLE), e
                n += 200
                sent[0] = n

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    took = []
    try:
        while sent[0] < 400:
            time.sleep(0.01)
        for i in range(10):  # honest agents authenticating during the flood
            pod, rank = ("a-0", 0) if i % 2 == 0 else ("a-1", 1)
            tok = kube.mint_token(NS, "trainer", pod=pod).token  # fresh: no cache hit
            t0 = time.monotonic()
            code, details = connect(arbiter, tok, pod, rank)
            took.append(time.monotonic() - t0)
            assert code == grpc.StatusCode.OK, details
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        kube.clear_faults()
    assert sent[0] >= 400
    assert kube.count("create", REVIEWS) == base_reviews, "junk tokens cost TokenReviews"
    assert kube.count("get", JWKS) - base_jwks <= 2  # unknown kids: one refresh a window
    # loaded 2-core machine: the bound is loose; the old code queued them for seconds
    print("honest authentication under the flood, s:", sorted(round(t, 3) for t in took))
    assert statistics.median(took) < 1.0 and max(took) < 3.0, took


def test_a_deleted_pods_token_is_refused_without_asking_the_api_server(
        kube: FakeKube, arbiter: ArbiterProcess) -> None:
    _pod(kube, "gone-0", 0, job="gone")
    tok = kube.mint_token(NS, "trainer", pod="gone-0").token
    before = kube.count("create", REVIEWS)
    msg = hello("gone", rank=0, world=2, namespace=NS, pod="gone-0", node="n1")
    deadline = time.monotonic() + 15
    while True:
        code, _ = stream_status(arbiter.address, [msg.SerializeToString()], tok,
                                welcome_ends=True)
        if code == grpc.StatusCode.OK or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert code == grpc.StatusCode.OK
    kube.delete("pods", "gone-0", NS)
    deadline = time.monotonic() + 15
    while True:  # once the watch saw the DELETED event
        code, details = stream_status(arbiter.address, [msg.SerializeToString()], tok)
        if code == grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert code == grpc.StatusCode.UNAUTHENTICATED, details
    assert kube.count("create", REVIEWS) == before


def test_a_rotated_signing_key_is_fetched_once(kube: FakeKube,
                                               arbiter: ArbiterProcess) -> None:
    kube.issuer.rotate_key("ES256")
    tok = kube.mint_token(NS, "trainer", pod="a-1").token
    before = kube.count("create", REVIEWS)
    deadline = time.monotonic() + 60
    while True:  # the refresh after the flood's may wait for its window (10 s)
        code, details = connect(arbiter, tok, "a-1", 1, timeout=1)
        if code == grpc.StatusCode.OK or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert code == grpc.StatusCode.OK, details
    assert kube.count("create", REVIEWS) == before


def test_without_discovery_tokens_go_to_tokenreview_and_an_outage_is_unavailable() -> None:
    """Where the keys cannot be read (RBAC lacks the issuer-discovery role), TokenReview
    decides as before; its outage answers UNAVAILABLE (retry), never anonymous."""
    with FakeKube() as kube:
        kube.add_node("n1")
        _pod(kube, "a-0", 0)
        kube.forbid("get", JWKS, times=None)
        with ArbiterProcess("--kube", "--kube-api", kube.url, "--token", SECRET,
                            "--metrics-port", "-1", env={"POD_NAMESPACE": "ftagent"}) as a:
            tok = kube.mint_token(NS, "trainer", pod="a-0").token
            code, details = connect(a, tok, "a-0", 0)
            assert code == grpc.StatusCode.OK, details
            assert kube.count("create", REVIEWS) >= 1
            kube.forbid("create", REVIEWS, times=None)
            fresh = kube.mint_token(NS, "trainer", pod="a-0").token
            code, details = stream_status(a.address, [hello(
                "alpha", rank=0, world=2, namespace=NS, pod="a-0",
                node="n1").SerializeToString()], fresh)
            assert code == grpc.StatusCode.UNAVAILABLE and "tokenreviews" in details, details
