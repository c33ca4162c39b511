"""The leader's label on its own pod (kube/leader_label.py) against the fake API server:
a new leader takes a stale label off another arbiter pod, standing by removes its own, a
gone pod is no error and a refused patch is one warning, never an exception."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ftagent.kube.leader_label import LABEL, LeaderLabel
from tests.kube_fake import FakeKube

NS = "ftagent-system"
APP = {"app.kubernetes.io/name": "ftagent-arbiter"}


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube() as f:
        yield f


def labels(fake: FakeKube, pod: str) -> dict[str, str]:
    obj = fake.get("pods", pod, NS)
    assert obj is not None
    return dict(obj["metadata"].get("labels") or {})


def test_a_new_leader_takes_the_label_from_a_dead_one(fake: FakeKube) -> None:
    fake.add_pod(NS, "old", labels={**APP, LABEL: "true"})  # SIGKILLed with its label
    fake.add_pod(NS, "new", labels=dict(APP))
    fake.add_pod(NS, "other-app", labels={LABEL: "true"})  # not an arbiter: left alone
    label = LeaderLabel(fake.client(), NS, "new")
    assert label.others() == ["old"]
    assert label.lead()
    assert labels(fake, "new")[LABEL] == "true"
    assert LABEL not in labels(fake, "old")
    assert labels(fake, "other-app")[LABEL] == "true"
    assert labels(fake, "new").items() >= APP.items()  # a merge patch: nothing else lost
    assert label.stand_by()
    assert LABEL not in labels(fake, "new")


def test_a_gone_pod_or_a_refused_patch_is_no_exception(fake: FakeKube,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    assert LeaderLabel(fake.client(), NS, "gone").stand_by()  # 404: nothing to unlabel
    fake.add_pod(NS, "mine", labels=dict(APP))
    fake.forbid("patch", "pods")
    assert not LeaderLabel(fake.client(), NS, "mine").lead()
    assert "cannot set the label" in caplog.text and "403" in caplog.text
