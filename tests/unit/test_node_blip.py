"""NotReady is not death (kube/node_blip.py): the pure verdict."""

from __future__ import annotations

from dataclasses import dataclass

from ftagent.kube.node_blip import still_stepping


@dataclass
class R:
    rank: int
    connected: bool = True
    last_step_at: float | None = None


def test_every_rank_stepping_after_the_transition_and_recently_is_a_blip() -> None:
    got = still_stepping([R(2, last_step_at=109.0), R(3, last_step_at=109.5)], 100.0, 110.0,
                         40.0)
    assert got.stepping and "ranks 2, 3 there still stepping" in got.why
    assert "since it went NotReady" in got.why
    # a step just before the transition, within the window: alive (reports are coalesced)
    got = still_stepping([R(2, last_step_at=98.0)], 100.0, 110.0, 15.0)
    assert got.stepping and "since it went" not in got.why


def test_one_rank_stopped_or_gone_is_not_a_blip() -> None:
    since, now = 100.0, 110.0
    for bad, said in ((R(3, last_step_at=99.0), "last step was 11s ago"),
                      (R(3, connected=False, last_step_at=109.0), "not connected"),
                      (R(3), "has not stepped yet"),
                      (R(3, last_step_at=101.0), "last step was 9s ago")):
        got = still_stepping([R(2, last_step_at=109.0), bad], since, now, 5.0)
        assert not got.stepping and said in got.why
    assert not still_stepping([], since, now, 5.0).stepping


def test_the_reason_is_bounded() -> None:
    got = still_stepping([R(i) for i in range(10_000)], 1.0, 2.0, 1.0)
    assert not got.stepping and len(got.why) < 400
