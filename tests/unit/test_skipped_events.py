"""The image cannot skip the agent silently (issue 33 item 7, issue 32 "Bad input"): which
injected pods get the one ``FtagentAgentNotRunning`` Event (ftagent/kube/skipped.py), pure,
on an injected clock. On the code before, no Event was written for them at all."""

from __future__ import annotations

import pytest

from ftagent.kube.skipped import SkipEvents, Term, message
from ftagent.kube.uninjected import PodView, count

T0 = 1767225600.0


def pv(name: str, ns: str = "ml", since: float | None = T0, uid: str | None = None
       ) -> tuple[str, PodView | None]:
    return f"{ns}/{name}", PodView(ns, name, "", since, uid if uid is not None else
                                   f"uid-{ns}-{name}")


def test_one_event_per_pod_past_the_grace_while_leading() -> None:
    s = SkipEvents(grace=120)
    pods = [pv("a"), pv("b"), pv("c", since=None), pv("d", uid=""), pv("e", ns="other"),
            ("ml/m", PodView("ml", "m", "not reviewed"))]
    assert s.due(pods, {"ml"}, set(), T0, T0 + 60) == []  # in grace
    assert s.due(pods, {"ml"}, None, None, T0 + 200) == []  # a follower: no streams
    got = s.due(pods, {"ml"}, {("ml", "b")}, T0, T0 + 121)
    assert [v.name for v in got] == ["a"]  # b's agent holds a stream
    assert s.due(pods, {"ml"}, set(), T0, T0 + 500) == [pods[1][1]]  # b lost it: once
    assert s.due(pods, {"ml"}, set(), T0, T0 + 900) == []  # once per pod uid


def test_a_new_leader_gives_its_agents_the_grace_to_reconnect() -> None:
    s = SkipEvents(grace=120)
    pods = [pv("a")]
    assert s.due(pods, {"ml"}, set(), T0 + 1000, T0 + 1060) == []
    assert [v.name for v in s.due(pods, {"ml"}, set(), T0 + 1000, T0 + 1121)] == ["a"]
    # the gauge follows the same rule when told the term's start
    assert count(pods, {"ml"}, set(), T0 + 1060, 120, T0 + 1000) == {}
    assert count(pods, {"ml"}, set(), T0 + 1060, 120) == {("ml", "agent not connected"): 1}


def test_many_such_pods_in_one_namespace_are_bounded() -> None:
    """A tenant with 1,000 pods that never connect: at most ``per_namespace`` Events per
    window from its namespace, ``per_pass`` per pass; another namespace still gets its own."""
    s = SkipEvents(grace=1, per_namespace=10, window=3600, per_pass=20)
    crowd = [pv(f"p{i}", ns="crowd") for i in range(1000)]
    pods = [*crowd, pv("solo", ns="ml")]
    first = s.due(pods, {"crowd", "ml"}, set(), T0, T0 + 10)
    assert len([v for v in first if v.namespace == "crowd"]) == 10
    assert [v.name for v in first if v.namespace == "ml"] == ["solo"]
    assert s.held_back == 990
    assert s.due(pods, {"crowd", "ml"}, set(), T0, T0 + 100) == []
    later = s.due(pods, {"crowd", "ml"}, set(), T0, T0 + 10 + 3600)  # the window moved on
    assert len(later) == 10 and {v.name for v in later}.isdisjoint(v.name for v in first)
    s2 = SkipEvents(grace=1, per_namespace=1000, per_pass=20)
    assert len(s2.due(crowd, {"crowd"}, set(), T0, T0 + 10)) == 20


def test_the_uids_remembered_are_bounded() -> None:
    s = SkipEvents(grace=1, per_namespace=10**6, per_pass=10**6, kept=100)
    s.due([pv(f"p{i}") for i in range(1000)], {"ml"}, set(), T0, T0 + 10)
    assert len(s._announced) == 100


def test_the_term_starts_when_leading_and_ends_with_it() -> None:
    leading: list[set[tuple[str, str]] | None] = [None]
    t = Term(lambda: leading[0])
    assert t.observe(5) == (None, None)
    leading[0] = set()
    assert t.observe(7) == (set(), 7)
    assert t.observe(9) == (set(), 7)
    leading[0] = None
    assert t.observe(10) == (None, None)
    leading[0] = {("ml", "a")}
    assert t.observe(11) == ({("ml", "a")}, 11)


@pytest.mark.parametrize("since", [T0, None])
def test_the_message_is_the_arbiters_own_words(since: float | None) -> None:
    m = message(PodView("ml", "a", "", since, "u"), T0 + 130, 120)
    assert "ftagent: not started" in m and "120 s" in m and len(m) < 1024


def test_a_pod_that_is_gone_is_forgotten() -> None:
    s = SkipEvents(grace=1)
    assert len(s.due([pv("a"), pv("b")], {"ml"}, set(), T0, T0 + 10)) == 2
    assert s.due([pv("b")], {"ml"}, set(), T0, T0 + 20) == []
    assert list(s._announced) == ["uid-ml-b"]
