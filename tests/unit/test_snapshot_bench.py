"""bench/snapshot.py's pure parts: the interval a save's blocking cost allows, the work a
fault redoes there, and issue 34's bar over the methods' rows (the bench itself copies
GiB of state and runs for minutes; these pin what it computes)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import snapshot as sb  # noqa: E402


def test_the_interval_keeps_saves_within_the_budget_of_training_time() -> None:
    # 0.5 s blocking, 0.2 s steps, 1 %: 250 steps (50 s) between saves
    assert sb.chosen_interval(0.5, 0.2) == 250
    assert 0.5 / (sb.chosen_interval(0.5, 0.2) * 0.2) <= 0.01
    assert sb.chosen_interval(0.501, 0.2) == 251  # rounded up, never under the budget
    assert sb.chosen_interval(0.0, 0.2) == 1 and sb.chosen_interval(1.0, 0.0) == 1


def test_a_fault_redoes_half_the_interval_on_average_and_at_most_all_of_it() -> None:
    r = sb.redone_at(250, 0.2)
    assert r["steps_max"] == 250 and r["steps_mean"] == pytest.approx(125.5)
    assert r["seconds_max"] == pytest.approx(50.0)
    assert sb.redone_at(1, 0.2)["steps_mean"] == 1  # the step in flight


def row(blocking: float) -> dict[str, float]:
    return {"first": blocking, "blocking": blocking, "background": 0.0, "resume": 1.0,
            "redone_steps": 3.0, "redone_steps_max": 3.0}


def test_the_bar_is_ftagent_at_most_the_fastest_peer_and_the_budget() -> None:
    rows = sb.rows_with_intervals([("ftagent", row(0.4)), ("dcp-async", row(0.5)),
                                   ("torch.save", row(2.0))], 0.2)
    v = sb.verdict(rows, 0.2)
    assert v["ok"] and v["fastest_peer"] == "dcp-async" and v["ratio"] == pytest.approx(0.8)
    assert v["share_at_interval"] <= 0.01
    slower = sb.rows_with_intervals([("ftagent", row(0.6)), ("dlrover-flash", row(0.5))], 0.2)
    v = sb.verdict(slower, 0.2)
    assert not v["ok"] and not v["le_fastest_peer"] and v["le_budget"]
    assert not sb.verdict(sb.rows_with_intervals([("ftagent", row(0.1))], 0.2), 0.2)["ok"]


def test_rounds_merge_into_medians_and_keep_each_rounds_blocking() -> None:
    m = sb.merge_rounds([row(0.4), row(0.6), row(2.0)])
    assert m["blocking"] == 0.6 and m["resume"] == 1.0
    assert m["blocking_rounds"] == [0.4, 0.6, 2.0]
