"""TokenReviews (arbiter/auth.py): who a review makes a caller, the cache's bounds, an
outage never letting anyone in; and the registry's limits that key on identity. Pure: a
review function and a clock are injected."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import grpc
import pytest

from ftagent.arbiter.auth import (
    EXTRA,
    Anyone,
    Chain,
    PodFacts,
    Presented,
    Principal,
    Reviewed,
    ReviewUnavailable,
    TokenReviews,
    identity_problem,
    principal_of,
)
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.checks import Refused
from ftagent.wire.credentials import current_token


def jwt(exp: float, n: int = 0) -> str:
    body = base64.urlsafe_b64encode(json.dumps({"exp": exp, "n": n}).encode()).rstrip(b"=")
    return f"eyJhbGciOiJSUzI1NiJ9.{body.decode()}.sig"


def pod_review(ns: str = "team", pod: str = "p0", uid: str = "u0", node: str = "n1",
               account: str = "trainer", aud: tuple[str, ...] = ("ftagent",)) -> Reviewed:
    return Reviewed(True, username=f"system:serviceaccount:{ns}:{account}", audiences=aud,
                    extra={EXTRA + "pod-name": (pod,), EXTRA + "pod-uid": (uid,),
                           EXTRA + "node-name": (node,)})


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_principal_of_a_pod_a_node_agent_and_what_counts_for_nothing() -> None:
    p = principal_of(pod_review(), "ftagent", "ftagent")
    assert p == Principal("pod team/p0", namespace="team", pod="p0", pod_uid="u0",
                          pod_node="n1")
    n = principal_of(pod_review("ftagent", "agent-x", account="ftagent-node"), "ftagent",
                     "ftagent")
    assert n is not None and n.node == "n1" and n.pod is None and not n.admin
    # the same ServiceAccount name in another namespace is no node agent
    other = principal_of(pod_review("team", account="ftagent-node"), "ftagent", "ftagent")
    assert other is not None and other.node is None
    assert principal_of(pod_review(aud=()), "ftagent", "ftagent") is None  # API audience
    assert principal_of(Reviewed(False, error="x"), "ftagent", "ftagent") is None
    unbound = Reviewed(True, username="system:serviceaccount:team:trainer",
                       audiences=("ftagent",))
    assert principal_of(unbound, "ftagent", "ftagent") is None  # names no pod
    user = Reviewed(True, username="alice", audiences=("ftagent",),
                    extra=pod_review().extra)
    assert principal_of(user, "ftagent", "ftagent") is None


def test_cache_ttl_stops_at_the_tokens_expiry_and_is_bounded() -> None:
    clock, calls = Clock(), []

    async def review(token: str) -> Reviewed:
        calls.append(token)
        return pod_review()

    async def main() -> None:
        tr = TokenReviews(review, ttl=60, max_entries=2, clock=clock)
        short = jwt(clock.t + 10)
        assert await tr.authenticate(Presented(short)) is not None
        assert await tr.authenticate(Presented(short)) is not None
        assert len(calls) == 1
        clock.t += 11  # past its exp, well within the TTL: asked again
        await tr.authenticate(Presented(short))
        assert len(calls) == 2
        for n in range(3):  # bounded: the oldest is dropped
            await tr.authenticate(Presented(jwt(clock.t + 3600, n)))
        assert len(tr._cache) == 2
        # not JWT-shaped: no API call at all
        assert await tr.authenticate(Presented("x" * 40)) is None
        assert len(calls) == 5

    asyncio.run(main())


def test_concurrent_calls_share_one_review_and_an_outage_lets_nobody_in() -> None:
    clock, calls = Clock(), []
    gate: asyncio.Event | None = None
    down = True

    async def review(token: str) -> Reviewed:
        calls.append(token)
        assert gate is not None
        await gate.wait()
        if down:
            raise ReviewUnavailable("HTTP 503")
        return pod_review() if token.startswith("eyJ") else Reviewed(False, error="forged")

    async def main() -> None:
        nonlocal gate, down
        gate = asyncio.Event()
        chain = Chain([TokenReviews(review, clock=clock), Anyone(tokenless=True)])
        tok = jwt(clock.t + 3600)
        waiting = [asyncio.ensure_future(chain.authenticate(Presented(tok))) for _ in range(5)]
        await asyncio.sleep(0)
        gate.set()
        got = await asyncio.gather(*waiting, return_exceptions=True)
        assert len(calls) == 1 and all(isinstance(g, ReviewUnavailable) for g in got)
        down = False  # not cached: the next call asks again
        assert (await chain.authenticate(Presented(tok))) == principal_of(
            pod_review(), "ftagent", "")
        # a refused token does not fall through to the tokenless anonymous
        assert await chain.authenticate(Presented("not.a.token")) is None
        assert (await chain.authenticate(Presented(None))).admin  # type: ignore[union-attr]

    asyncio.run(main())


def test_identity_problem_names_each_mismatch() -> None:
    p = Principal("pod team/p0", namespace="team", pod="p0", pod_uid="u0", pod_node="n1")
    facts = PodFacts(uid="u0", job="alpha", node="n1", rank=0, world_size=2)
    ok = ("team", "p0", "n1", "alpha", 0, 2)
    assert identity_problem(p, *ok, facts) == ("", False)
    for i, bad, word in ((0, "x", "namespace"), (1, "p1", "pod"), (2, "n2", "node"),
                         (3, "beta", "job"), (4, 1, "rank"), (5, 3, "world size")):
        args: list[object] = list(ok)
        args[i] = bad
        problem, retry = identity_problem(p, *args, facts=facts)  # type: ignore[arg-type,misc]
        assert f"{word} mismatch" in problem and not retry
    # --nproc-per-node 4 (the pod's own): pod rank 0 of 2 pods runs ranks 0-3 of 8
    four = PodFacts(uid="u0", job="alpha", node="n1", rank=0, world_size=2, local_world=4)
    assert identity_problem(p, "team", "p0", "n1", "alpha", 3, 8, four) == ("", False)
    for rank, world in ((4, 8), (5, 8)):
        assert "rank mismatch" in identity_problem(p, "team", "p0", "n1", "alpha", rank,
                                                   world, four)[0]
    # a Hello's world size no longer divides the pod into ranks: 8 of a 1-rank pod is not
    assert "world size mismatch" in identity_problem(p, "team", "p0", "n1", "alpha", 3, 8,
                                                     facts)[0]
    assert identity_problem(p, *ok, None)[1] is True  # not seen yet: retry
    stale = identity_problem(p, *ok, PodFacts(uid="u9", job="alpha"))
    assert "replaced pod" in stale[0] and not stale[1]


def _hello(rank: int, world: int = 2, **kw: object) -> pb.Hello:
    return pb.Hello(job="j", namespace="ns", rank=rank, world_size=world, pod=f"p{rank}",
                    agent_instance=f"i{rank}", **kw)  # type: ignore[arg-type]


def test_registry_caps_restarts_ranks_and_keeps_a_rank_its_pods() -> None:
    async def main() -> None:
        reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "arb",
                       restart_ceiling=5, max_ranks_per_job=2)
        reg.hello(Connection("a", pod_uid="u0"), _hello(0, max_restarts=1_000_000))
        assert reg.jobs[("ns", "j")].max_restarts == 5
        with pytest.raises(Refused) as e:
            reg.hello(Connection("b"), _hello(2, world=3))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        first = Connection("a", pod_uid="u0")
        reg.hello(first, _hello(1))
        reg.disconnect(first)
        thief = _hello(1)
        thief.agent_instance = "other"
        with pytest.raises(Refused) as e:  # its pod still exists: not free to take
            reg.hello(Connection("c", pod_uid="u7"), thief)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(Refused):  # nor by a credential that names no pod
            reg.hello(Connection("d"), thief)
        reg.pod_alive = lambda ns, pod, uid: False  # the pod is gone: its successor may
        reg.hello(Connection("c", pod_uid="u7"), thief)
        assert reg.jobs[("ns", "j")].ranks[1].pod_uid == "u7"

    asyncio.run(main())


def test_current_token_reads_the_projected_file_fresh(tmp_path: Path) -> None:
    from tests.kube_fake.tokens import write_projected

    assert current_token("tok", "") == "tok"
    path = write_projected(tmp_path / "v", "first\n")
    assert current_token("ignored", str(path)) == "first"
    write_projected(tmp_path / "v", "second")  # the kubelet rotated it
    assert current_token("ignored", str(path)) == "second"
    assert current_token("ignored", str(tmp_path / "missing")) == ""  # refused, retried
    big = tmp_path / "big"
    big.write_bytes(b"x" * (64 * 1024 + 1))
    assert current_token("", str(big)) == ""
