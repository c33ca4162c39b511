"""The fake API server's TokenReview answers the real ``kubernetes`` client as the real
server does (tests/kube_fake/tokens.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import urlopen

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

from tests.kube_fake import FakeKube  # noqa: E402

EXTRA = "authentication.kubernetes.io/"


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        fake.add_node("n1")
        fake.add_pod("team", "train-0", node="n1")
        yield fake


def _review(fake: FakeKube, token: str, audiences: list[str] | None = None) -> Any:
    api = client.AuthenticationV1Api(fake.client())
    body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=audiences))
    return api.create_token_review(body).status


def test_pod_bound_token_names_pod_and_node(fake_kube: FakeKube) -> None:
    minted = fake_kube.mint_token("team", "trainer", pod="train-0")
    st = _review(fake_kube, minted.token, ["ftagent"])
    pod = fake_kube.get("pods", "train-0", "team")
    node = fake_kube.get("nodes", "n1")
    assert pod is not None and node is not None
    assert st.authenticated is True and st.error is None
    assert st.audiences == ["ftagent"]
    assert st.user.username == "system:serviceaccount:team:trainer"
    assert st.user.uid
    assert st.user.groups == ["system:serviceaccounts", "system:serviceaccounts:team",
                              "system:authenticated"]
    assert st.user.extra == {
        EXTRA + "pod-name": ["train-0"], EXTRA + "pod-uid": [pod["metadata"]["uid"]],
        EXTRA + "node-name": ["n1"], EXTRA + "node-uid": [node["metadata"]["uid"]],
        EXTRA + "credential-id": [f"JTI={minted.jti}"]}


def test_wrong_audience_is_unauthenticated(fake_kube: FakeKube) -> None:
    minted = fake_kube.mint_token("team", pod="train-0", audiences=("vault",))
    st = _review(fake_kube, minted.token, ["ftagent"])
    assert not st.authenticated
    assert st.error == ('[invalid bearer token, token audiences ["vault"] is invalid for the '
                        'target audiences ["ftagent"]]')
    # no spec.audiences: the API server's own audience, which an ftagent token lacks
    assert not _review(fake_kube, fake_kube.mint_token("team", pod="train-0").token
                       ).authenticated


def test_expired_token_is_unauthenticated(fake_kube: FakeKube) -> None:
    minted = fake_kube.mint_token("team", pod="train-0", expiration_seconds=600)
    assert _review(fake_kube, minted.token, ["ftagent"]).authenticated
    now = fake_kube.issuer.clock()
    fake_kube.issuer.clock = lambda: now + 601
    st = _review(fake_kube, minted.token, ["ftagent"])
    assert not st.authenticated and "has expired" in st.error


def test_deleted_or_recreated_pod_invalidates_its_token(fake_kube: FakeKube) -> None:
    minted = fake_kube.mint_token("team", pod="train-0")
    fake_kube.delete("pods", "train-0", "team")
    st = _review(fake_kube, minted.token, ["ftagent"])
    assert not st.authenticated
    assert st.error == "[invalid bearer token, service account token has been invalidated]"
    fake_kube.add_pod("team", "train-0", node="n1")  # same name, another uid
    assert not _review(fake_kube, minted.token, ["ftagent"]).authenticated


def test_forged_token_is_unauthenticated(fake_kube: FakeKube) -> None:
    head, body, _sig = fake_kube.mint_token("team", pod="train-0").token.split(".")
    for token in (f"{head}.{body}.AAAA", "not-a-jwt", "ftj1.x.y.z"):
        st = _review(fake_kube, token, ["ftagent"])
        assert not st.authenticated and st.error.startswith("[invalid bearer token, ")


def test_tokenreviews_need_rbac_and_are_create_only(fake_kube: FakeKube) -> None:
    fake_kube.forbid("create", "tokenreviews.authentication.k8s.io")
    with pytest.raises(ApiException) as e:
        _review(fake_kube, fake_kube.mint_token("team", pod="train-0").token, ["ftagent"])
    assert e.value.status == 403
    assert 'cannot create resource "tokenreviews" in API group "authentication.k8s.io" at ' \
        "the cluster scope" in json.loads(str(e.value.body))["message"]
    with pytest.raises(HTTPError) as h:
        urlopen(fake_kube.url + "/apis/authentication.k8s.io/v1/tokenreviews", timeout=10)
    assert h.value.code == 405


def test_token_file_is_a_projected_volume_and_rotates(fake_kube: FakeKube,
                                                     tmp_path: Path) -> None:
    path = fake_kube.token_file(tmp_path / "ftagent", "team", "train-0")
    assert path == tmp_path / "ftagent" / "token" and path.is_symlink()
    assert os.readlink(path) == "..data/token"
    first = path.read_text()
    assert _review(fake_kube, first, ["ftagent"]).authenticated
    fake_kube.token_file(tmp_path / "ftagent", "team", "train-0")
    second = path.read_text()
    assert second != first and _review(fake_kube, second, ["ftagent"]).authenticated
    assert len([p for p in (tmp_path / "ftagent").iterdir() if p.name.startswith("..2")]) == 1
