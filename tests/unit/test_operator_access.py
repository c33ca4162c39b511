"""Operators (arbiter/operators.py): who a TokenReview makes a person, what a
SubjectAccessReview grants one call, its cache; and the fake API server's
SubjectAccessReview, as the real ``kubernetes`` client reads it. Pure where it can be."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from ftagent.arbiter.auth import (
    EXTRA,
    Principal,
    Reviewed,
    ReviewUnavailable,
    UserInfo,
    authorize,
)
from ftagent.arbiter.operators import OperatorAccess, operator_of


def test_operator_of_a_person_and_never_of_a_pod() -> None:
    p = operator_of(Reviewed(True, username="alice", uid="u1", groups=("sre",)))
    assert p is not None and p.operator == UserInfo("alice", "u1", ("sre",))
    assert not p.admin and p.namespace is None and p.node is None and p.pod is None
    pod = Reviewed(True, username="system:serviceaccount:team:x",
                   extra={EXTRA + "pod-name": ("p",), EXTRA + "pod-uid": ("u",)})
    assert operator_of(pod) is None
    assert operator_of(Reviewed(False, username="alice")) is None
    # granted nothing: reads nothing (Connect and ReportNode never grant)
    assert not authorize(p, "team", "alpha")


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def test_grants_follow_the_answers_and_are_cached() -> None:
    rules = {("alice", "get", "team", "alpha"), ("alice", "list", "team", ""),
             ("sre", "list", "", "")}
    asked: list[tuple[str, str, str, str]] = []

    async def review(user: UserInfo, verb: str, ns: str, name: str) -> tuple[bool, str]:
        asked.append((user.username, verb, ns, name))
        return (user.username, verb, ns, name) in rules, ""

    clock = Clock()
    access = OperatorAccess(review, clock=clock, ttl=60, negative_ttl=10)
    access.namespaces = lambda: ["team", "other"]
    alice = Principal("operator alice", operator=UserInfo("alice"))
    sre = Principal("operator sre", operator=UserInfo("sre"))

    async def main() -> None:
        got = await access.grant(alice, "get", "team", "alpha")
        assert authorize(got, "team", "alpha") and not authorize(got, "team", "beta")
        assert not authorize(await access.grant(alice, "get", "other", "alpha"),
                             "other", "alpha")
        listed = await access.grant(alice, "list", "", "")
        assert authorize(listed, "team", "x") and not authorize(listed, "other", "x")
        assert authorize(await access.grant(sre, "list", "", ""), "any", "job")
        n = len(asked)
        await access.grant(alice, "get", "team", "alpha")
        assert len(asked) == n  # cached
        clock.t += 61
        await access.grant(alice, "get", "team", "alpha")
        assert len(asked) == n + 1
        # a request that does not parse is granted nothing
        assert (await access.grant(alice, "get", "\x00", "\x00")).readable == frozenset()

    asyncio.run(main())


def test_an_outage_is_unavailable_never_allowed() -> None:
    async def review(user: UserInfo, verb: str, ns: str, name: str) -> tuple[bool, str]:
        raise ReviewUnavailable("HTTP 503")

    access = OperatorAccess(review)
    with pytest.raises(ReviewUnavailable):
        asyncio.run(access.grant(Principal("o", operator=UserInfo("a")), "get", "t", "j"))


kubernetes = pytest.importorskip("kubernetes")


@pytest.fixture
def fake() -> Iterator[object]:
    from tests.kube_fake import FakeKube

    with FakeKube() as f:
        yield f


def test_fake_subject_access_review_answers_as_rbac(fake: object) -> None:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from ftagent.kube.tokenreview import access_review_sync, review_sync
    from tests.kube_fake import FakeKube

    assert isinstance(fake, FakeKube)
    fake.allow("alice", "get", namespace="team", names=("alpha",))
    fake.allow("group:sre", "*")
    api = fake.client()
    alice = UserInfo("alice", groups=("dev",))
    ok, reason = access_review_sync(api, alice, "get", "team", "alpha")
    assert ok and reason.startswith('RBAC: allowed by RoleBinding "')
    assert access_review_sync(api, alice, "get", "team", "beta") == (False, "")
    assert access_review_sync(api, alice, "list", "team", "") == (False, "")
    assert access_review_sync(api, alice, "get", "other", "alpha") == (False, "")
    assert access_review_sync(api, UserInfo("dana", groups=("sre",)), "watch", "", "")[0]
    with pytest.raises(ApiException) as e:  # neither user nor groups: 422, as for real
        client.AuthorizationV1Api(api).create_subject_access_review(
            client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
                resource_attributes=client.V1ResourceAttributes(verb="get"))))
    assert e.value.status == 422
    fake.forbid("create", "subjectaccessreviews.authorization.k8s.io")
    with pytest.raises(ReviewUnavailable, match="subjectaccessreviews"):
        access_review_sync(api, alice, "get", "team", "alpha")
    # a person's OIDC token: the API server's audiences only
    tok = fake.user_token("alice", groups=("dev",))
    r = review_sync(api, tok, [])
    assert r.authenticated and r.username == "alice" and "dev" in r.groups
    assert not review_sync(api, tok, ["ftagent"]).authenticated
