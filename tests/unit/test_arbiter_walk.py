"""Issue 36, the arbiter's half of a crash: at most 21 cross-file calls in 11 files, of a
hang at most 33 (bench/fault_walk.py), and the checks that moved to get there still run on
every input.

The cuts: a decision's command built, read from the snapshots and fanned out once per
decision; a peer's fault checked and converted in one call (``wire.convert.checked_fault``,
its bounds compared in line); the timeline's bound checked in line at ``Timeline.add``; a
FaultAck's outcome bounded in line; ``Registry.handle`` is ``Jobs.handle``; the barrier
decides without applying; the counters live with their writer, the journal. The bounds
below are each one a peer could reach before; each is checked on the path that moved.

Stop 42's cuts: a rank's fault and a probe's stacks read and decided in jobs.py (no
jobs -> intake -> jobs round trip); the policy reads the job's phase and the ranks' last
steps in place; a probe's answers kept, not one timeline entry per rank; the snapshots
read only by a command that carries some; open faults settled by the decision that
closes them (``state.apply`` derives ``Settled``) and every FaultAck of a decision in its
fan-out, after its command; the flight recorder's reader asked only for an answer that
carries its part; a fault's onset read by the ledger.

Stop 44's cut: a fault and the decision about it are one ``state.apply`` (a transaction),
observed once by the journal: they were applied and journaled one by one (two calls to
each per fault), and the journal read the job between them.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from ftagent.arbiter import policy
from ftagent.arbiter.connection import Connection
from ftagent.arbiter.registry import Registry
from ftagent.arbiter.timeline import MAX_ENTRY_MESSAGE, Timeline
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits
from ftagent.wire.convert import checked_fault
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import fault_walk  # noqa: E402


def test_the_arbiters_half_of_a_crash_is_at_most_21_cross_file_calls_in_11_files() -> None:
    """23 calls at stop 42's end (cb3cd6c: this test fails there), 29 in 13 files on the
    tree stop 42 started from (c555c99), 58 in 19 at the stop before (e9b12e5), 71 when
    issue 36 was worked first."""
    fault, arrivals = fault_walk.arbiter_walk()  # asserts the job was released
    calls = sum(fault.edges.values()) + sum(arrivals.edges.values())
    edges = sorted((fault.edges + arrivals.edges).items())
    assert fault_walk.ARBITER_NOW == (21, 11)
    assert calls <= 21 and len(fault.files | arrivals.files) <= 11, edges
    # the fault and the RESTART it decided: one transaction, observed once (they were
    # applied and journaled one by one: two calls to each)
    assert fault.edges[("ftagent/arbiter/jobs.py", "ftagent/arbiter/state.py")] == 1, edges
    assert fault.edges[("ftagent/arbiter/jobs.py", "ftagent/arbiter/journal.py")] == 1, edges
    # the commands reached both ranks once each per decision: one fan-out per phase, the
    # reporting agent's FaultAck in it (no call of its own)
    assert fault.edges[("ftagent/arbiter/commands.py", "ftagent/arbiter/connection.py")] == 1
    assert arrivals.edges[("ftagent/arbiter/commands.py",
                           "ftagent/arbiter/connection.py")] == 1
    # no step through the intake for an agent's fault, and back (jobs -> intake -> jobs)
    assert not any("intake.py" in a or "intake.py" in b for a, b in fault.edges), edges


def test_the_arbiters_half_of_a_hang_is_at_most_33_cross_file_calls() -> None:
    """35 at stop 42's end (cb3cd6c: this test fails there), 59 calls in 14 files on
    c555c99, 105 in 20 on e9b12e5."""
    walks = fault_walk.arbiter_hang_walk()  # asserts the job was released
    calls = sum(sum(w.edges.values()) for w in walks)
    edges = sorted(sum((w.edges for w in walks), start=type(walks[0].edges)()).items())
    assert fault_walk.ARBITER_HANG_NOW == (33, 11)
    assert calls <= 33 and len(set().union(*(w.files for w in walks))) <= 11, edges
    # the HANG and the DUMP_STACKS it decided: one transaction, observed once
    hang = walks[0]
    assert hang.edges[("ftagent/arbiter/jobs.py", "ftagent/arbiter/state.py")] == 1, edges
    assert hang.edges[("ftagent/arbiter/jobs.py", "ftagent/arbiter/journal.py")] == 1, edges
    # an answer to the probe is kept, not written down (no journal per rank's stacks)
    stacks = walks[1]
    assert stacks.edges[("ftagent/arbiter/jobs.py", "ftagent/arbiter/journal.py")] == 1, edges


def test_a_fault_applied_with_its_decision_is_written_down_as_the_job_was_then() -> None:
    """The journal reads a fault after the decision applied with it: the fault's entry
    still says the generation the job was at when it came (the RESTART's, the next), and
    ``state.apply`` hands it over in the same transaction, before the decision's."""
    reg, conns, _ = _hung_job(2, keep=100)
    reg.handle(conns[1], pb.AgentMessage(fault=_fault(id="c1", generation=0)), 0.0)
    got = [(e.kind, e.fault_id, e.action, e.generation)
           for e in reg.timeline.entries("j", "") if e.fault_id == "c1"]
    assert got == [("fault", "c1", "", 0), ("decision", "c1", "restart", 1)], got


def test_state_apply_returns_a_transaction_in_order_with_what_each_change_derived() -> None:
    from ftagent.arbiter.state import (
        Decision,
        FaultSeen,
        JobState,
        NicOutage,
        Settled,
        Verdict,
        apply,
    )
    from ftagent.model import Fault, FaultKind

    job = JobState(job="j", namespace="", world_size=2, generation=3)
    job.nic_outages[0] = NicOutage("down-0", since=5.0, deadline=60.0)
    job.nic_outages[1] = NicOutage("down-1", since=2.0, deadline=60.0)
    back = Fault(FaultKind.NIC, "link back", id="b1", evidence={"recovered": True})
    seen = FaultSeen("b1", False, 1, "nic: back", back, 3)
    link_back = Decision(Verdict.LINK_BACK, "back", 3, rank=1, fault_id="b1")
    applied = apply(job, [seen, link_back], 10.0)
    # the fault as it found the job: the oldest outage still open (the decision closed
    # rank 1's since), the generation then
    assert applied[0] == seen._replace(job_generation=3, outage="down-1")
    assert applied[1:] == [link_back] and 1 not in job.nic_outages
    assert apply(job, Decision(Verdict.LINK_BACK, "back", 3, rank=0), 11.0) == [
        Decision(Verdict.LINK_BACK, "back", 3, rank=0), Settled((("b1", 1),))]


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


def _hung_job(ranks: int, keep: int) -> tuple[Registry, list[Connection], list[float]]:
    """A job of ``ranks`` ranks, released at generation 0, whose rank 0 reports a HANG
    with every other rank stalled too: the arbiter probes every rank for its stacks."""
    now = [1_000.0]
    reg = Registry(policy.PolicyConfig(), Timeline(keep_per_job=keep), None, "t",
                   clock=lambda: now[0])
    conns = [Connection(f"peer-{r}") for r in range(ranks)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=ranks, pod=f"p{r}", node="n",
                              agent_instance=f"i{r}", state="waiting"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    reg.handle(conns[0], pb.AgentMessage(fault=pb.Fault(
        id="h1", kind=pb.FAULT_KIND_HANG, severity=pb.SEVERITY_ERROR, message="no step",
        generation=0, detected_at=now[0])), 0.0)
    assert reg.jobs[("", "j")].hang_probe is not None
    return reg, conns, now


def _stacks(reg: Registry, rank: int) -> pb.AgentMessage:
    """Rank ``rank``'s answer to the probe's DUMP_STACKS (its command id echoed)."""
    probe = reg.jobs[("", "j")].hang_probe
    assert probe is not None
    frames = "hang_before_collective (train.py:72)" if rank == 1 else "backward (x.py:1)"
    doc = {"processes": [{"pid": 100 + rank, "stack": f"Thread 1 (idle): \"Main\"\n"
                          f"    {frames}\n"}], "seconds": 0.01}
    return pb.AgentMessage(stacks=pb.Stacks(command_id=probe.command_id, json=json.dumps(doc)))


def test_a_probes_answers_do_not_push_the_fault_out_of_the_jobs_timeline() -> None:
    """Each rank's answer to a hang probe is kept, not written down one entry per rank:
    the decision says how many answered. (One entry per rank pushed the fault and the
    probe out of the entries a job's timeline keeps: 1,000, so a job of 1,024 ranks lost
    them at every job hang; here 12 ranks against 8 entries.)"""
    reg, conns, _ = _hung_job(12, keep=8)
    for r, c in enumerate(conns):
        reg.handle(c, _stacks(reg, r), 0.0)
    entries = reg.timeline.entries("j", "")
    kinds = [(e.kind, e.action) for e in entries]
    assert ("fault", "") in kinds and ("decision", "dump_stacks") in kinds, kinds
    decided = [e for e in entries if e.action == "restart"]
    assert decided and "stacks from 12/12 ranks" in decided[0].message, kinds


def test_a_probe_decided_at_its_deadline_names_the_ranks_that_did_not_answer() -> None:
    reg, conns, now = _hung_job(14, keep=100)
    for r, c in enumerate(conns):
        if r not in (3, 12, 13):
            reg.handle(c, _stacks(reg, r), 0.0)
    now[0] += policy.PolicyConfig().stacks_timeout + 1
    reg.tick()
    decided = [e for e in reg.timeline.entries("j", "") if e.kind == "decision"][-1]
    assert "stacks from 11/14 ranks (none from rank 3, 12, 13)" in decided.message, \
        decided.message


def test_a_settled_faults_final_ack_follows_the_command_on_its_stream() -> None:
    """The open hang fault's final FaultAck rides the settling decision's fan-out: after
    the RESTART on the hung rank's stream, outside the fan-out's count of commands."""
    reg, conns, _ = _hung_job(3, keep=100)
    for r, c in enumerate(conns):
        reg.handle(c, _stacks(reg, r), 0.0)
    got = []
    while not conns[0].outbox.empty():
        item = conns[0].outbox.get_nowait()
        assert isinstance(item, tuple)
        m = pb.ArbiterMessage.FromString(item[0])
        got.append(("ack", m.fault_ack.final, m.fault_ack.outcome, item[1])
                   if m.HasField("fault_ack") else
                   (m.WhichOneof("body"), m.command.kind if m.HasField("command") else 0))
    restart = got.index(("command", pb.COMMAND_KIND_RESTART))
    assert got[restart + 1] == ("ack", True, "restart", None), got
    assert ("ack", False, "dump_stacks", None) in got[:restart], got


def test_send_all_queues_the_acks_after_the_command_outside_its_fan_out() -> None:
    from ftagent.arbiter.connection import FanOut, send_all

    seen: list[float] = []
    a, b = Connection("a"), Connection("b")
    fan = FanOut(2, 0.0, seen.append)
    send_all([(a, b"cmd"), (b, b"cmd")], fan, [(a, b"ack")])
    items = [a.outbox.get_nowait(), a.outbox.get_nowait(), b.outbox.get_nowait()]
    assert items == [(b"cmd", fan), (b"ack", None), (b"cmd", fan)]
    assert fan.left == 2 and not seen


def test_a_crashs_faultack_follows_its_restart_on_the_reporting_stream() -> None:
    """The reporting agent's FaultAck rides the decision's fan-out, after the command:
    an agent that reads the final ack has read the RESTART it led to."""
    reg, conns, _ = _hung_job(2, keep=100)  # a hang probe open: then a crash of rank 1
    while not conns[1].outbox.empty():
        conns[1].outbox.get_nowait()
    reg.handle(conns[1], pb.AgentMessage(fault=_fault(id="c1", generation=0)), 0.0)
    got = []
    while not conns[1].outbox.empty():
        item = conns[1].outbox.get_nowait()
        assert isinstance(item, tuple)
        got.append(pb.ArbiterMessage.FromString(item[0]))
    assert [m.WhichOneof("body") for m in got] == ["command", "fault_ack"], got
    assert got[0].command.kind == pb.COMMAND_KIND_RESTART
    assert (got[1].fault_ack.fault_id, got[1].fault_ack.final,
            got[1].fault_ack.outcome) == ("c1", True, "restart")
