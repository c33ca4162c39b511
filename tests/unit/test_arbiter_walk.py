"""Issue 36, the arbiter's half of a crash: at most 30 cross-file calls (bench/fault_walk.py),
and the checks that moved to get there still run on every input.

The cuts: a decision's command built, read from the snapshots and fanned out once per
decision; a peer's fault checked and converted in one call (``wire.convert.checked_fault``,
its bounds compared in line); the timeline's bound checked in line at ``Timeline.add``; a
FaultAck's outcome bounded in line; ``Registry.handle`` is ``Jobs.handle``; the barrier
decides without applying; the counters live with their writer, the journal. The bounds
below are each one a peer could reach before; each is checked on the path that moved.
"""

from __future__ import annotations

import math
import sys

import pytest

from ftagent.arbiter.connection import Connection
from ftagent.arbiter.timeline import MAX_ENTRY_MESSAGE, Timeline
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits
from ftagent.wire.convert import checked_fault
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import fault_walk  # noqa: E402


def test_the_arbiters_half_of_a_crash_is_at_most_30_cross_file_calls() -> None:
    """58 on the tree this stop started from (e9b12e5), 71 when issue 36 was worked first."""
    fault, arrivals = fault_walk.arbiter_walk()  # asserts the job was released
    calls = sum(fault.edges.values()) + sum(arrivals.edges.values())
    edges = sorted((fault.edges + arrivals.edges).items())
    assert calls <= fault_walk.ARBITER_GOAL == 30, edges
    # the commands reached both ranks once each per decision: one fan-out per phase
    assert fault.edges[("ftagent/arbiter/commands.py", "ftagent/arbiter/connection.py")] == 1
    assert arrivals.edges[("ftagent/arbiter/commands.py",
                           "ftagent/arbiter/connection.py")] == 1


def _fault(**kw: object) -> pb.Fault:
    base: dict[str, object] = dict(id="f1", kind=pb.FAULT_KIND_CRASH, message="exit 1",
                                   generation=0, detected_at=1.0)
    base.update(kw)
    return pb.Fault(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "bad", "said"), [
    ("id", "", "fault id is empty"),
    ("id", "x" * (limits.MAX_ID + 1), f"at most {limits.MAX_ID}"),
    ("id", "f\x1b[2J", "control characters"),
    ("generation", -1, "fault generation -1 is out of range"),
    ("generation", limits.MAX_GENERATION + 1, "out of range"),
    ("message", "m" * (limits.MAX_MESSAGE + 1), "fault message is"),
    ("evidence_json", "{" + " " * limits.MAX_EVIDENCE + "}", "fault evidence is"),
    ("detected_at", math.inf, "not finite"),
    ("detected_at", math.nan, "not finite"),
])
def test_a_fault_out_of_range_is_refused_by_the_one_call_that_converts_it(
        field: str, bad: object, said: str) -> None:
    with pytest.raises(limits.OutOfRange, match=said.replace("[", r"\[")):
        checked_fault(_fault(**{field: bad}))


def test_a_fault_at_its_bounds_is_converted_and_its_message_made_printable() -> None:
    f = checked_fault(_fault(id="i" * limits.MAX_ID, generation=limits.MAX_GENERATION,
                             message="crash \x1b[31mred\x07"))
    assert f.id == "i" * limits.MAX_ID and f.message == "crash \\x1b[31mred\\x07"
    assert checked_fault(_fault(message="plain")).message == "plain"


@pytest.mark.parametrize(("message", "kept"), [
    ("plain", "plain"),
    ("p" * MAX_ENTRY_MESSAGE, "p" * MAX_ENTRY_MESSAGE),
    ("p" * (MAX_ENTRY_MESSAGE + 1), "p" * (MAX_ENTRY_MESSAGE - 1) + "…"),
    ("a\nb\x1b", "a\\x0ab\\x1b"),
    ("\u202e" * MAX_ENTRY_MESSAGE, ("\\u202e" * MAX_ENTRY_MESSAGE)[:MAX_ENTRY_MESSAGE - 1]
     + "…"),
])
def test_every_timeline_entry_is_bounded_at_its_one_entry_point(message: str,
                                                                 kept: str) -> None:
    e = Timeline().add(1.0, "j", "", 0, "fault", message)
    assert e.message == kept and len(e.message) <= MAX_ENTRY_MESSAGE


def test_a_fault_acks_outcome_is_bounded() -> None:
    conn = Connection("peer")
    conn.ack("f1", True, "ignored: " + "x" * 1000)
    conn.ack("f2", True, "restart")
    got = []
    while not conn.outbox.empty():
        item = conn.outbox.get_nowait()
        assert isinstance(item, tuple)
        got.append(pb.ArbiterMessage.FromString(item[0]).fault_ack)
    assert [len(a.outcome) for a in got] == [200, 7] and got[0].outcome.endswith("…")
    assert got[1].outcome == "restart" and got[1].final
