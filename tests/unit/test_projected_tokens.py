"""Projected tokens verified locally (kube/projected.py) and the TokenReview fallback's
limits (arbiter/auth.py). Pure: the fake issuer's real keys, an injected clock, a review
function that counts its calls. The attacks are issue 33's: many distinct JWT-shaped junk
tokens, a junk ``exp`` that defeated the negative cache, a flood from one source."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from typing import Any

import pytest

pytest.importorskip("jwt")

from ftagent.arbiter.auth import (  # noqa: E402
    EXTRA,
    Presented,
    Reviewed,
    ReviewUnavailable,
    TokenReviews,
    peer_source,
)
from ftagent.kube.projected import (  # noqa: E402
    IssuerKeys,
    KeysUnavailable,
    ProjectedTokens,
    parse_discovery,
    verify,
)
from tests.kube_fake.tokens import ISSUER, Issuer  # noqa: E402

NOW = 1_800_000_000.0


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


PODS = {("team", "p0"): {"metadata": {"uid": "uid-p0"}, "spec": {"nodeName": "n1"}},
        ("ftagent", "agent-n1"): {"metadata": {"uid": "uid-agent"}, "spec": {"nodeName": "n1"}}}


def _lookup(resource: str, name: str, namespace: str | None) -> dict[str, Any] | None:
    if resource == "nodes":
        return {"metadata": {"uid": f"node-{name}"}}
    return PODS.get((namespace or "", name))


def issuer(alg: str = "RS256") -> Issuer:
    return Issuer(_lookup, clock=Clock(), alg=alg)


def keys_of(iss: Issuer) -> tuple[str, dict[str, Any]]:
    return parse_discovery(iss.discovery("https://api"), iss.jwks())


def junk(n: int, exp: float = 1.0, kid: str | None = None) -> str:
    """A JWT-shaped token no issuer signed: its own kid, audience, pod and a junk exp."""
    def b64(obj: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()
    head = b64({"alg": "RS256", "kid": kid or f"kid-{n}"})
    body = b64({"iss": ISSUER, "aud": ["ftagent"], "exp": exp, "sub": "x",
                "kubernetes.io": {"namespace": "team", "pod": {"name": "p0", "uid": "uid-p0"}}})
    return f"{head}.{body}.{base64.urlsafe_b64encode(os.urandom(256)).rstrip(b'=').decode()}"


@pytest.mark.parametrize("alg", ["RS256", "ES256"])
def test_a_bound_token_verifies_and_says_its_pod(alg: str) -> None:
    iss = issuer(alg)
    issuer_name, keys = keys_of(iss)
    tok = iss.mint("team", "trainer", pod="p0").token
    got = verify(tok, keys, issuer_name, "ftagent", NOW + 1)
    assert got.bound is not None, got
    b = got.bound
    assert (b.namespace, b.service_account, b.pod, b.pod_uid, b.node) == (
        "team", "trainer", "p0", "uid-p0", "n1")


def test_what_is_refused_locally() -> None:
    iss = issuer()
    name, keys = keys_of(iss)
    claims = json.loads(base64.urlsafe_b64decode(
        iss.mint("team", "trainer", pod="p0").token.split(".")[1] + "=="))

    def signed(**change: Any) -> str:
        c = {**claims, **change}
        return iss.sign({k: v for k, v in c.items() if v is not None})

    cases = {
        "wrong audience": iss.mint("team", pod="p0", audiences=("vault",)).token,
        "expired": iss.mint("team", pod="p0", expiration_seconds=-1).token,
        "another issuer": signed(iss="https://old-issuer.example"),
        "not bound to a pod": iss.mint("team").token,
        "subject does not match": signed(sub="system:serviceaccount:kube-system:admin"),
        "not valid yet": signed(nbf=NOW + 3600),
        "not a JWT": "eyJ.x",
    }
    for want, tok in cases.items():
        got = verify(tok, keys, name, "ftagent", NOW + 1)
        assert got.bound is None and want in got.problem, (want, got)
    other = verify(signed(iss="https://old-issuer.example"), keys, name, "ftagent", NOW)
    assert other.other_issuer  # the cluster's key signed it: its API server decides
    head, body, sig = iss.mint("team", pod="p0").token.split(".")
    assert verify(f"{head}.{body}.{sig[:-4]}AAAA", keys, name, "ftagent", NOW).problem
    # alg confusion: HS256 keyed with the public key, and "none", are not accepted
    for alg in ("HS256", "none"):
        h = base64.urlsafe_b64encode(json.dumps({"alg": alg, "kid": iss.kid}).encode()
                                     ).rstrip(b"=").decode()
        assert "algorithm" in verify(f"{h}.{body}.{sig}", keys, name, "ftagent", NOW).problem
    # a key the set does not hold is reported (the caller refreshes, rate-limited)
    assert verify(junk(1), keys, name, "ftagent", NOW).unknown_key == "kid-1"


def _reviews(calls: list[str], clock: Clock, **kw: Any) -> TokenReviews:
    async def review(token: str) -> Reviewed:
        calls.append(token)
        await asyncio.sleep(0)
        return Reviewed(False, error="[invalid bearer token]")

    return TokenReviews(review, clock=clock, **kw)


def test_segments_are_strict_and_the_signature_covers_the_claims() -> None:
    """verify() parses each segment itself (once, C-speed): what PyJWT refused it refuses
    (GHSA-hxm8-2xgr-2p9m: junk outside the base64url alphabet), and claims never
    signed are never read."""
    iss = issuer()
    name, keys = keys_of(iss)
    head, body, sig = iss.mint("team", "trainer", pod="p0").token.split(".")
    _, other_body, _ = iss.mint("team", "admin", pod="p0").token.split(".")
    assert verify(f"{head}.{body}.{sig}", keys, name, "ftagent", NOW + 1).bound is not None
    refused = {
        "another token's claims": f"{head}.{other_body}.{sig}",
        "junk in the signature": f"{head}.{body}.{sig[:-4]}!!!!",
        "junk in the header": f"{head[:-2]}*!.{body}.{sig}",
        "padding in the body": f"{head}.{body}==.{sig}",
        "no signature": f"{head}.{body}.",
        "a header that is no object": f"{base64.urlsafe_b64encode(b'[1]').decode()}.{body}.{sig}",
        "a signature of another length": f"{head}.{body}.{sig}AAAA",
    }
    for why, tok in refused.items():
        got = verify(tok, keys, name, "ftagent", NOW + 1)
        assert got.bound is None and got.problem, (why, got)


def test_a_token_is_verified_once_however_often_its_pod_reconnects() -> None:
    """The fixed cost per reconnect: a token's signature is checked at its first call to
    this arbiter, then its hash is enough until it expires (streams, reconnects)."""
    iss, clock, calls = issuer(), Clock(), []
    keys = IssuerKeys(None, clock=clock, fetcher=lambda: keys_of(iss))
    pt = ProjectedTokens(keys, _reviews(calls, clock), clock=clock)
    tok = iss.mint("team", "trainer", pod="p0").token

    async def main() -> None:
        await keys.refresh()
        checks = []
        key = next(iter(keys.keys.values()))
        real = key.Algorithm.verify

        def counted(*a: Any) -> bool:
            checks.append(1)
            return bool(real(*a))

        key.Algorithm.verify = counted
        try:
            for _ in range(50):
                p = await pt.authenticate(Presented(tok, source="10.0.0.9"))
                assert p is not None and p.pod == "p0"
        finally:
            del key.Algorithm.verify
        assert len(checks) == 1 and calls == []
        clock.t = NOW + 10**7  # past its expiry: checked again, and refused
        assert await pt.authenticate(Presented(tok, source="10.0.0.9")) is None

    asyncio.run(main())


def test_junk_tokens_cost_no_review_and_unknown_kids_one_fetch_per_window() -> None:
    iss, clock, calls = issuer(), Clock(), []
    keys = IssuerKeys(None, min_refresh=30.0, clock=clock, fetcher=lambda: keys_of(iss))
    pt = ProjectedTokens(keys, _reviews(calls, clock), clock=clock)

    async def main() -> None:
        for n in range(500):  # many distinct junk tokens, junk exp, junk kids
            assert await pt.authenticate(Presented(junk(n, exp=n), source="10.0.0.9")) is None
        assert calls == [] and keys.fetches == 1  # the first load; the window holds
        clock.t += 31
        for n in range(100):
            await pt.authenticate(Presented(junk(n), source="10.0.0.9"))
        assert calls == [] and keys.fetches == 2
        # a key rotated in the API server: its first token refreshes the set (a new window)
        clock.t += 31
        new_kid = iss.rotate_key("ES256")
        p = await pt.authenticate(Presented(iss.mint("team", "trainer", pod="p0").token))
        assert p is not None and p.pod == "p0" and p.pod_uid == "uid-p0" and new_kid in keys.keys
        assert calls == [] and keys.fetches == 3

    asyncio.run(main())


def test_a_deleted_pods_token_is_refused_and_node_agents_are_confirmed_once() -> None:
    iss, clock, calls = issuer(), Clock(), []
    keys = IssuerKeys(None, clock=clock, fetcher=lambda: keys_of(iss))
    confirmed: list[str] = []

    async def review(token: str) -> Reviewed:
        confirmed.append(token)
        return Reviewed(True, username="system:serviceaccount:ftagent:ftagent-node",
                        audiences=("ftagent",), extra={
                            EXTRA + "pod-name": ("agent-n1",), EXTRA + "pod-uid": ("uid-agent",),
                            EXTRA + "node-name": ("n1",)})

    pt = ProjectedTokens(keys, TokenReviews(review, clock=clock, node_namespace="ftagent"),
                         node_namespace="ftagent", clock=clock)
    watch = {("team", "p0"): "uid-p0"}
    pt.pod_uid = lambda ns, pod: watch.get((ns, pod))

    async def main() -> None:
        tok = iss.mint("team", "trainer", pod="p0").token
        assert (await pt.authenticate(Presented(tok))) is not None
        del watch[("team", "p0")]
        pt.pod_deleted("team", "p0", "uid-p0")  # the watch's DELETED event
        assert await pt.authenticate(Presented(tok)) is None
        assert calls == []
        agent = iss.mint("ftagent", "ftagent-node", pod="agent-n1").token
        for _ in range(3):
            p = await pt.authenticate(Presented(agent))
            assert p is not None and p.node == "n1" and p.pod is None
        assert len(confirmed) == 1  # once per pod uid per confirm_ttl, not per call
        clock.t += 301
        again = iss.mint("ftagent", "ftagent-node", pod="agent-n1").token
        assert (await pt.authenticate(Presented(again))) is not None
        assert len(confirmed) == 2

    asyncio.run(main())


def test_without_discovery_the_review_fallback_decides() -> None:
    clock, calls = Clock(), []

    def down() -> tuple[str, dict[str, Any]]:
        raise KeysUnavailable("HTTP 403")

    keys = IssuerKeys(None, clock=clock, fetcher=down)
    pt = ProjectedTokens(keys, _reviews(calls, clock), clock=clock)

    async def main() -> None:
        assert await pt.authenticate(Presented(junk(0), source="a")) is None
        assert len(calls) == 1 and keys.fetches == 1
        await pt.authenticate(Presented(junk(1), source="a"))
        assert len(calls) == 2 and keys.fetches == 1  # discovery retried once a window

    asyncio.run(main())


def test_negative_cache_ignores_the_junk_exp_a_token_claims() -> None:
    """Old code cached a refusal only until the token's own (unverified) exp: an exp in
    the past made every retry of one junk token a new review."""
    clock, calls = Clock(), []
    tr = _reviews(calls, clock)

    async def main() -> None:
        tok = junk(0, exp=1.0)
        for _ in range(20):
            assert await tr.authenticate(Presented(tok, source="a")) is None
        assert len(calls) == 1

    asyncio.run(main())


def test_review_queue_and_sources_are_bounded() -> None:
    """Distinct junk tokens from one source: a burst, then a trickle, each shed fast with
    ReviewUnavailable; another source still gets its review; the queue never grows past
    max_pending however many sources send."""
    clock, calls = Clock(), []
    gate = asyncio.Event()

    async def review(token: str) -> Reviewed:
        calls.append(token)
        await gate.wait()
        return Reviewed(False)

    async def main() -> None:
        tr = TokenReviews(review, clock=clock, max_pending=16, per_source=4,
                          source_rate=1.0, source_burst=6)
        tasks = [asyncio.ensure_future(tr.authenticate(Presented(junk(n), source="evil")))
                 for n in range(50)]
        await asyncio.sleep(0)
        assert len(tr._inflight) == 4  # per_source concurrent
        gate.set()
        got = await asyncio.gather(*tasks, return_exceptions=True)
        assert sum(isinstance(g, ReviewUnavailable) for g in got) == 46
        gate.clear()
        shed_before = tr.shed
        for n in range(10):  # the bucket: 6 at once, then 1 a second
            try:
                t = asyncio.ensure_future(tr.authenticate(Presented(junk(100 + n),
                                                                    source="evil")))
                gate.set()
                await t
            except ReviewUnavailable:
                pass
        assert tr.shed > shed_before
        assert await tr.authenticate(Presented(junk(999), source="honest")) is None
        gate.clear()
        many = [asyncio.ensure_future(tr.authenticate(Presented(junk(2000 + n),
                                                                source=f"s{n}")))
                for n in range(40)]
        await asyncio.sleep(0)
        assert len(tr._inflight) <= 16
        gate.set()
        await asyncio.gather(*many, return_exceptions=True)

    asyncio.run(main())


def test_peer_source_drops_the_port() -> None:
    assert peer_source("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert peer_source("ipv6:[::1]:40000") == "::1"
    assert peer_source("unix:/tmp/x") == "unix:/tmp/x"


def test_a_pod_call_waits_for_the_pod_watchs_first_list() -> None:
    """After a start or failover the pod watch's first list is under way: a pod's call
    waits for it (4 s at most) instead of every agent retrying into it."""
    from ftagent.arbiter.auth import PodFacts, Principal
    from ftagent.arbiter.server import ArbiterServer, ServerSettings

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code: Any, details: str) -> None:
            raise Aborted(details)

    async def main() -> None:
        srv = ArbiterServer(ServerSettings(listen="127.0.0.1:0", metrics_port=-1))
        facts: dict[tuple[str, str], PodFacts] = {}
        srv.pod_lookup = lambda ns, pod: facts.get((ns, pod))
        listed = asyncio.Event()
        srv.pods_synced = listed.wait
        p = Principal("pod team/p0", namespace="team", pod="p0", pod_uid="u0")
        call = asyncio.ensure_future(srv._pod_principal(p, Context()))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not call.done()  # waiting, not refused
        facts[("team", "p0")] = PodFacts(uid="u0", job="alpha")
        listed.set()
        got = await asyncio.wait_for(call, 5)
        assert got.job == "alpha"
        # once listed, a pod the watch has not seen is UNAVAILABLE at once (retry)
        other = Principal("pod team/p1", namespace="team", pod="p1", pod_uid="u1")
        with pytest.raises(Aborted, match="not \\(yet\\) in the arbiter's watch"):
            await asyncio.wait_for(srv._pod_principal(other, Context()), 1)  # type: ignore[arg-type]

    asyncio.run(main())
