"""Issue 24: a link outage that restarts nothing is an incident of the ledger, its stall
booked as ``outage`` (onset -> the job's first step after the link came back), not as
productive, straggler or a learned phase; it survives an arbiter restart. Through the
registry as agents feed it (injected clock), and the ledger alone where a part of it is
pinned."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftagent.arbiter.history import History, incident_from_json, incident_json
from ftagent.arbiter.history_file import FileHistory
from ftagent.arbiter.ledger import CATEGORIES, Incident, Ledger
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.status_view import format_goodput
from ftagent.arbiter.timeline import Timeline
from ftagent.model import Fault, FaultKind, Severity
from ftagent.report import ReportData, _incident_row, incident_table
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import fault_to_proto
from tests.unit.test_ledger_onset import T0, Clock


def registry(clock: Clock, history: History | None = None) -> tuple[Registry, Connection]:
    """One rank, registered at T0 (a fault is decided at once: no peers to compare)."""
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                   history=history or History())
    c = Connection("peer-0")
    reg.hello(c, pb.Hello(job="j", rank=0, world_size=1, agent_instance="i0"))
    reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    return reg, c


def summary(reg: Registry, c: Connection, clock: Clock, step: int, at: float,
            other: float = 0.0) -> None:
    """A progress summary stamped with its step's time, arriving at ``at``."""
    clock.now = at
    reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
        step=step, ts=at, seconds_since_progress=0.0, other_phase_seconds=other)), 0.0)


def link(reg: Registry, c: Connection, clock: Clock, at: float, **evidence: object) -> None:
    clock.now = at
    sev = Severity.INFO if evidence.get("recovered") else Severity.ERROR
    f = Fault(FaultKind.NIC, "carrier lost on eth0", severity=sev, evidence=dict(evidence),
              detected_at=at)
    reg.handle(c, pb.AgentMessage(fault=fault_to_proto(f, 0)), 0.0)


def goodput(reg: Registry) -> pb.Goodput:
    return reg.job_info(reg.jobs[("", "j")], ranks=False).goodput


def outage_that_resumes(reg: Registry, c: Connection, clock: Clock) -> None:
    """Steps every 0.1 s from +5 (summaries every 5 s); the link goes down at +20 (its
    fault 2 s later), is back at +30, and TCP resumes the all-reduce at +33 (step 151):
    the hang verifier learned the 13 s stall as an undeclared phase, sent with it."""
    summary(reg, c, clock, 1, T0 + 5.0)
    summary(reg, c, clock, 51, T0 + 10.0)
    summary(reg, c, clock, 101, T0 + 15.0)
    summary(reg, c, clock, 150, T0 + 19.9)
    link(reg, c, clock, T0 + 22.0, detection_latency_seconds=2.0)
    link(reg, c, clock, T0 + 30.0, recovered=True, outage_seconds=10.0)
    assert not goodput(reg).per_incident  # no step since: the job is still stalled
    summary(reg, c, clock, 151, T0 + 33.0, other=13.0)
    summary(reg, c, clock, 200, T0 + 37.9, other=13.0)
    reg.tick()  # every rank's step advanced: the arbiter records it, no restart


def test_an_outage_that_restarts_nothing_is_an_incident_and_its_own_category() -> None:
    clock = Clock()
    reg, c = registry(clock)
    outage_that_resumes(reg, c, clock)
    job = reg.jobs[("", "j")]
    assert job.generation == 0 and job.nic_resume is None  # resumed by itself
    clock.now = T0 + 40.0
    g = goodput(reg)
    assert "outage" in CATEGORIES and g.seconds["outage"] == pytest.approx(13.0)
    # the old reading: the whole stall productive (and the learned phase other_phases)
    assert g.seconds["productive"] == pytest.approx(15.0 + 7.0)
    assert g.seconds["other_phases"] == pytest.approx(0.0)
    assert g.seconds["straggler"] == 0.0
    assert sum(g.seconds.values()) == pytest.approx(g.wall_seconds)
    (inc,) = g.per_incident
    assert (inc.kind, inc.generation, inc.no_restart) == ("nic", 0, True)
    assert inc.onset == pytest.approx(T0 + 20.0)
    assert inc.detect_seconds == pytest.approx(10.0)  # onset -> link back
    assert inc.decide_seconds == pytest.approx(3.0)  # link back -> the first step after
    assert not inc.HasField("restart_seconds")
    assert (inc.recompute_seconds, inc.recomputed_steps) == (0.0, 0)
    assert g.incidents == 0 and g.recomputed_steps == 0  # restarts: none

    text = format_goodput(g)
    assert "outage" in text and "none" in text.splitlines()[-1]
    row = _incident_row({"generation": 0, "kind": "nic", "detect_seconds": 10.0,
                         "decide_seconds": 3.0, "restart_seconds": None,
                         "recompute_seconds": 0.0, "recomputed_steps": 0,
                         "no_restart": True})
    assert row is not None
    html = incident_table(ReportData(job="j", source="status", incidents=[row]))
    assert "nic (outage, no restart)" in html and "<td>none</td>" in html


def test_an_outage_that_ends_in_a_restart_is_that_restarts_incident() -> None:
    """Back, but no step follows: the restart at the wait's end takes the outage's times
    (detection from the link going down, decision after it); no outage time is left."""
    clock = Clock()
    reg, c = registry(clock)
    summary(reg, c, clock, 1, T0 + 5.0)
    summary(reg, c, clock, 150, T0 + 19.9)
    link(reg, c, clock, T0 + 22.0, detection_latency_seconds=2.0)
    assert goodput(reg).seconds["outage"] == pytest.approx(2.0)  # while it lasts
    link(reg, c, clock, T0 + 30.0, recovered=True, outage_seconds=10.0)
    clock.now = T0 + 45.5
    reg.tick()
    g = goodput(reg)
    (inc,) = g.per_incident
    assert (inc.kind, inc.generation, inc.no_restart) == ("nic", 1, False)
    assert g.seconds["outage"] == 0.0
    assert g.seconds["detection"] == pytest.approx(2.0)
    assert g.seconds["decision"] == pytest.approx(23.5)
    assert g.incidents == 1


def test_an_outage_incident_survives_an_arbiter_restart(tmp_path: Path) -> None:
    clock = Clock()
    reg, c = registry(clock, History(FileHistory(str(tmp_path))))
    outage_that_resumes(reg, c, clock)
    before = list(goodput(reg).per_incident)
    reg.history.close()

    clock.now += 10  # a new arbiter reads the history
    reg2, _ = registry(clock, History(FileHistory(str(tmp_path))))
    c2 = Connection("peer-0b")
    reg2.hello(c2, pb.Hello(job="j", rank=0, world_size=1, agent_instance="i0",
                            generation=0, released_generation=0, trainer_running=True))
    summary(reg2, c2, clock, 400, clock.now)
    g = goodput(reg2)
    assert list(g.per_incident) == before
    assert g.per_incident[0].no_restart and g.incidents == 0
    assert g.seconds["outage"] == pytest.approx(13.0)


def test_a_record_from_before_outages_reads_as_restarts() -> None:
    inc = Incident(1, "crash", 10.0, 10.0, 11.0, released=12.0)
    assert incident_from_json(incident_json(inc)[:-1]) == inc
    out = Incident(0, "nic", 10.0, 20.0, 20.0, first_step_at=23.0, restarted=False)
    again = incident_from_json(incident_json(out))
    assert again == out and again.recomputed_steps == 0
    assert again.durations() == {"detect": 10.0, "decide": 3.0, "restart": None,
                                 "recompute": 0.0}
    with pytest.raises(ValueError):
        incident_from_json([*incident_json(out)[:-1], "no"])


def ledger_in_outage() -> Ledger:
    """Training from +0 (steps every 0.1 s); a link down at +10 the arbiter waits for
    (fault detected +12), back at +20."""
    led = Ledger(T0)
    for s in range(1, 101):
        led.progress(0, 0, s, T0 + 0.1 * s)
    led.fault("f1", "nic", T0 + 10.0, T0 + 12.0)
    led.outage("f1", T0 + 12.0)
    led.fault("f2", "nic", T0 + 10.0, T0 + 20.0, same_as="f1")
    return led


def test_the_stall_is_not_straggler_time() -> None:
    """Means over the agents' last steps that hold the stalled step make a rank look slow:
    that is the outage (booked), not a straggler; later windows are believed again."""
    led = ledger_in_outage()
    led.slowed(0.9, T0 + 15.0, step=100, over=64)  # during the outage: nothing moves
    led.progress(0, 0, 101, T0 + 23.0)  # the first step after the link came back
    for s in range(102, 151):
        led.progress(0, 0, s, T0 + 23.0 + 0.1 * (s - 101))
    led.slowed(0.9, T0 + 27.9, step=150, over=64)  # its window holds step 101
    assert led.breakdown(T0 + 27.9).seconds["straggler"] == 0.0
    for s in range(151, 181):
        led.progress(0, 0, s, T0 + 23.0 + 0.1 * (s - 101))  # step 180 at +30.9
    # another rank's window (117..180) no longer holds it, but the share compares every
    # rank's latest means, and the first rank's (up to step 150) still do: quiet until
    # the job is 64 steps past 150, when that rank has sent newer ones
    led.slowed(0.9, T0 + 30.9, step=180, over=64)
    assert led.breakdown(T0 + 30.9).seconds["straggler"] == 0.0
    for s in range(181, 221):
        led.progress(0, 0, s, T0 + 23.0 + 0.1 * (s - 101))  # step 220 at +34.9
    led.slowed(0.5, T0 + 34.9, step=220, over=64)  # past 150 + 64: believed again
    b = led.breakdown(T0 + 34.9)
    assert b.seconds["straggler"] == pytest.approx(0.5 * 4.0)
    assert b.seconds["outage"] == pytest.approx(13.0)
    assert sum(b.seconds.values()) == pytest.approx(b.wall)


def test_a_phase_reported_long_after_the_outage_is_a_phase() -> None:
    led = ledger_in_outage()
    led.progress(0, 0, 101, T0 + 23.0)
    led.phases(0, 0, (0.0, 4.0), T0 + 24.0)  # the learned stall: the outage already
    assert led.breakdown(T0 + 24.0).seconds["other_phases"] == 0.0
    led.phases(0, 0, (0.0, 6.0), T0 + 90.0)  # an eval a minute later: a phase
    assert led.breakdown(T0 + 90.0).seconds["other_phases"] == pytest.approx(2.0)


def test_redone_training_across_an_outage_leaves_the_outage_alone() -> None:
    """A restart that resumes before the outage redoes the training around it, not the
    outage's stall (booked as outage already)."""
    led = ledger_in_outage()
    led.progress(0, 0, 101, T0 + 23.0)
    for s in range(102, 131):
        led.progress(0, 0, s, T0 + 23.0 + 0.1 * (s - 101))  # step 130 at +25.9
    led.fault("c", "crash", T0 + 26.0, T0 + 26.0)
    led.restart(1, T0 + 26.0, fault_id="c")
    led.released(1, T0 + 27.0)
    led.resumed(1, 90)  # steps 91..130 redone: 9..10, 23..26 (the stall is not)
    led.progress(0, 1, 91, T0 + 28.0)
    b = led.breakdown(T0 + 28.0)
    assert b.seconds["outage"] == pytest.approx(13.0)
    assert b.seconds["recomputed"] == pytest.approx(1.0 + 3.0)
    assert b.recomputed_steps == 40
    assert [i.restarted for i in b.incidents] == [False, True]
    assert b.restarts == 1
