"""Ranks that resumed one incident from different rungs of the recovery ladder: the
incident's source is the slowest (a replaced pod's rank from its peer's replica, the
others from memory: "peer"), whatever order their reports arrive in."""

from __future__ import annotations

import pytest

from ftagent.arbiter.ledger import Ledger
from tests.unit.test_ledger import steps


@pytest.mark.parametrize("order, want", [
    (("memory", "peer"), "peer"),
    (("peer", "memory"), "peer"),
    (("memory", "disk", "peer"), "disk"),
    (("memory", "memory"), "memory"),
])
def test_the_slowest_rung_is_the_incidents_source(order: tuple[str, ...], want: str) -> None:
    led = Ledger(0.0, world_size=len(order))
    steps(led, 0, 1, 10, 0.0, 1.0, ranks=len(order))
    led.restart(1, 10.0, kind="crash", onset=9.0, detected=9.0)
    for source in order:
        led.resumed(1, 6, source)
    led.released(1, 11.0)
    steps(led, 1, 7, 9, 12.0, 1.0, ranks=len(order))
    inc = led.breakdown(13.0).incidents[0]
    assert (inc.resumed, inc.resume_source, inc.recomputed_steps) == (6, want, 4)


def test_another_step_said_later_still_replaces_it() -> None:
    led = Ledger(0.0, world_size=2)
    steps(led, 0, 1, 10, 0.0, 1.0, ranks=2)
    led.restart(1, 10.0, kind="crash", onset=9.0, detected=9.0)
    led.resumed(1, 6, "peer")
    led.resumed(1, 3, "memory")  # a later, different answer: as before, the newest said
    assert led.breakdown(10.5).incidents[0].resume_source == "memory"


@pytest.mark.parametrize("order", [("memory", ""), ("", "memory"), ("peer", "", "")])
def test_a_snapshots_report_outranks_a_checkpoint_line_in_any_order(
        order: tuple[str, ...]) -> None:
    """examples/train.py loads its disk checkpoint (its "resumed from checkpoint at step 3"
    line, parsed: source "") and then the snapshot (ftagent.checkpoint's report: step 8,
    "memory"); the two reach the arbiter by different paths, in either order. The bench
    booked the disk step when the line came last (recomputed 908 steps for 8 redone)."""
    led = Ledger(0.0, world_size=1)
    steps(led, 0, 1, 10, 0.0, 1.0, ranks=1)
    led.restart(1, 10.0, kind="crash", onset=9.0, detected=9.0)
    for source in order:
        led.resumed(1, 8 if source else 3, source)
    led.released(1, 11.0)
    steps(led, 1, 9, 11, 12.0, 1.0, ranks=1)
    inc = led.breakdown(14.0).incidents[0]
    assert (inc.resumed, inc.resume_source, inc.recomputed_steps) == (8, order[0] or order[1], 2)
