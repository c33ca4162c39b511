"""Issue 24, the ledger's ``detection``: from the fault's onset as its detector measured it
(a hang: the job's last step; a link: when it went down; an Xid: when the GPU raised it)
to the agent's fault, through the registry as agents feed it (injected clock; summaries
coalesced as the agents send them: one per 5 s, stamped with the step's time)."""

from __future__ import annotations

import pytest

from ftagent.arbiter.history import History
from ftagent.arbiter.ledger import MAX_LEAD, Ledger, onset_of
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.model import Fault, FaultKind, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import fault_to_proto

T0 = 1_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def one_rank_job(clock: Clock) -> tuple[Registry, Connection]:
    """One rank (no peers to compare: a fault is decided at once), registered at T0."""
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                   history=History())
    c = Connection("peer-0")
    reg.hello(c, pb.Hello(job="j", rank=0, world_size=1, agent_instance="i0"))
    reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    return reg, c


def train(reg: Registry, c: Connection, clock: Clock, first: int, last: int,
          t0: float, dt: float = 0.1) -> float:
    """Steps first..last, one every ``dt`` from ``t0``, reported as the agent does: the
    first at once, then the latest step every 5 s (its own time in ``ts``, 0 s since
    progress when the summary was built), and the last one at the next 5 s slot. Returns
    the last step's time; the clock is left at that last summary's arrival."""
    sent = -1e9
    t = t0
    for s in range(first, last + 1):
        t = t0 + (s - first) * dt
        if t - sent >= 5.0 or s == last:
            clock.now = t if s != last else max(t, sent + 5.0)
            sent = clock.now
            reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
                step=s, ts=t, seconds_since_progress=0.0)), 0.0)
    return t


def fault(reg: Registry, c: Connection, kind: FaultKind, at: float, **evidence: object
          ) -> None:
    sev = Severity.INFO if evidence.get("recovered") else Severity.ERROR
    f = Fault(kind, f"{kind.value}", severity=sev, evidence=dict(evidence), detected_at=at)
    reg.handle(c, pb.AgentMessage(fault=fault_to_proto(f, 0)), 0.0)


def goodput(reg: Registry) -> pb.Goodput:
    return reg.job_info(reg.jobs[("", "j")], ranks=False).goodput


def test_a_hang_is_detected_from_the_last_step_not_from_its_late_summary() -> None:
    """Steps every 0.1 s; the last (52) at +10.1 s, just after a summary went (+10.0), so
    its own summary waits for the next slot (+15.0); the hang fault at +15.1 (5 s budget,
    as its evidence says). Detection is 5 s: from the summary's arrival (the old reading)
    it was 0.1 s and the rest of the budget was productive."""
    clock = Clock()
    reg, c = one_rank_job(clock)
    last = train(reg, c, clock, 1, 52, T0 + 5.0)
    assert last == pytest.approx(T0 + 10.1) and clock.now == pytest.approx(T0 + 15.0)
    clock.now = last + 5.0
    fault(reg, c, FaultKind.HANG, clock.now, seconds_since_progress=5.0)
    g = goodput(reg)
    assert g.seconds["detection"] == pytest.approx(5.0)
    assert g.seconds["productive"] == pytest.approx(last - (T0 + 5.0))
    (inc,) = g.per_incident
    assert (inc.kind, inc.detect_seconds) == ("hang", pytest.approx(5.0))
    assert sum(g.seconds.values()) == pytest.approx(g.wall_seconds)


def test_a_hang_without_evidence_still_starts_at_the_jobs_last_step() -> None:
    """An agent that sends no ``seconds_since_progress``: the last step the ledger holds
    (the summary's own stamp), not the summary's arrival."""
    clock = Clock()
    reg, c = one_rank_job(clock)
    last = train(reg, c, clock, 1, 52, T0 + 5.0)  # its summary arrives at +15.0
    clock.now = last + 6.0
    fault(reg, c, FaultKind.HANG, clock.now)
    assert goodput(reg).seconds["detection"] == pytest.approx(6.0)


def test_a_link_outage_is_detected_from_the_link_going_down() -> None:
    """The link goes down at +20 (training stalls), its fault comes 2 s later (the
    grace), it is back at +30, no step follows, and the job restarts when the wait for
    the collective to resume ends (+45.5 here): 2 s of detection, 23.5 s of decision;
    none of the outage is productive (the old reading: all of it, and the restart named
    the link-back fault, so detection was 0)."""
    clock = Clock()
    reg, c = one_rank_job(clock)
    last = train(reg, c, clock, 1, 150, T0 + 5.0)  # the last step at +19.9
    clock.now = T0 + 22.0
    fault(reg, c, FaultKind.NIC, clock.now, detection_latency_seconds=2.0)
    assert not goodput(reg).per_incident  # waiting for the link
    clock.now = T0 + 30.0
    fault(reg, c, FaultKind.NIC, clock.now, recovered=True, outage_seconds=10.0)
    # back, but no rank steps again: the restart comes when the wait for TCP to resume the
    # collective runs out (policy.nic_resume_wait: the outage's 10 s + 5 s)
    assert not goodput(reg).per_incident
    clock.now = T0 + 45.5
    reg.tick()
    g = goodput(reg)
    (inc,) = g.per_incident
    assert inc.kind == "nic" and inc.onset == pytest.approx(T0 + 20.0)
    assert g.seconds["detection"] == pytest.approx(2.0)
    assert g.seconds["decision"] == pytest.approx(8.0 + 15.5)
    assert g.seconds["productive"] == pytest.approx(T0 + 20.0 - (T0 + 5.0))
    assert last < T0 + 20.0


def test_an_xid_is_detected_from_the_time_the_gpu_raised_it() -> None:
    clock = Clock()
    reg, c = one_rank_job(clock)
    train(reg, c, clock, 1, 150, T0 + 5.0)
    clock.now = T0 + 21.5
    fault(reg, c, FaultKind.GPU, clock.now, xid=79, first_seen_wall=T0 + 20.0)
    g = goodput(reg)
    assert g.per_incident[0].kind == "gpu"
    assert g.seconds["detection"] == pytest.approx(1.5)


def test_onset_of_believes_numbers_only_and_bounds_them() -> None:
    assert onset_of("hang", 100.0, {"seconds_since_progress": 7.5}) == 92.5
    assert onset_of("crash", 100.0, {"seconds_since_progress": 7.5}) is None
    for bad in ("7", True, None, float("nan"), float("inf"), [1]):
        assert onset_of("hang", 100.0, {"seconds_since_progress": bad}) is None
    assert onset_of("hang", 100.0, {"seconds_since_progress": -3.0}) == 100.0
    assert onset_of("hang", 1e9, {"seconds_since_progress": 1e300}) == 1e9 - MAX_LEAD
    assert onset_of("nic", 50.0, {"detection_latency_seconds": 2}) == 48.0
    assert onset_of("nic", 50.0, {"recovered": True, "outage_seconds": 10.0,
                                  "detection_latency_seconds": 2}) == 40.0
    assert onset_of("gpu", 50.0, {"first_seen_wall": 49.0}) == 49.0
    assert onset_of("gpu", 50.0, {"first_seen_wall": 60.0}) == 50.0  # not after detection


def test_a_claimed_onset_stays_inside_the_training_it_interrupts() -> None:
    """An onset from before the generation trained moves nothing out of the wall time."""
    led = Ledger(0.0, world_size=1)
    for s in range(1, 11):
        led.progress(0, 0, s, 10.0 + s)
    led.fault("f", "hang", -1e6, 25.0)
    led.restart(1, 26.0, fault_id="f")
    b = led.breakdown(26.0)
    assert b.seconds["startup"] == pytest.approx(11.0)
    assert b.seconds["detection"] == pytest.approx(5.0)  # from the last step (20)
    assert sum(b.seconds.values()) == pytest.approx(b.wall)


def test_a_hang_judged_busy_then_crashed_by_its_timeout_is_detection_and_decision() -> None:
    """Seen in the ten-minute bench: a hang's stacks were judged a busy job (no restart),
    and 30 s later gloo's timeout crashed a rank, which restarted the job. The stall
    (last step -> crash) went to ``recomputed`` (32.7 s for 12 steps); it is detection
    (last step -> the hang fault) and decision (-> the barrier), and only the redone
    steps' time is recomputed."""
    led = Ledger(0.0, world_size=2)
    for s in range(1, 101):  # step s at 10 + 0.1 s
        for r in (0, 1):
            led.progress(r, 0, s, 10.0 + 0.1 * s)
    # the last step, 100, at 20.0; the hang fault 2.7 s later; the crash at 52.1
    led.fault("h", "hang", onset_of("hang", 22.7, {"seconds_since_progress": 2.7}), 22.7)
    led.fault("c", "crash", None, 52.1)
    led.restart(1, 52.2, fault_id="c")
    led.resumed(1, 90)
    led.released(1, 53.0)
    for s in range(91, 95):
        for r in (0, 1):
            led.progress(r, 1, s, 54.0 + 0.1 * (s - 91))
    b = led.breakdown(54.3)
    assert b.seconds["detection"] == pytest.approx(2.7)
    assert b.seconds["decision"] == pytest.approx(53.0 - 22.7)
    assert b.seconds["recomputed"] == pytest.approx(1.0)  # steps 91..100: 19.0 -> 20.0
    assert b.recomputed_steps == 10
    (inc,) = b.incidents
    assert inc.kind == "crash" and inc.onset == pytest.approx(20.0)
    assert sum(b.seconds.values()) == pytest.approx(b.wall)


def test_a_hang_reported_before_the_job_stepped_again_is_not_the_stall() -> None:
    """A hang report (judged busy: an evaluation) after which the job made steps again,
    then a crash: the crash's own times; the hang belongs to a stall that ended."""
    led = Ledger(0.0, world_size=1)
    for s in range(1, 51):
        led.progress(0, 0, s, 10.0 + 0.1 * s)  # step 50 at 15.0
    led.fault("h", "hang", 12.0, 14.0)  # step 40 at 14.0: it stepped after
    led.fault("c", "crash", None, 15.05)
    led.restart(1, 15.1, fault_id="c")
    b = led.breakdown(15.1)
    assert b.seconds["detection"] == pytest.approx(0.0)
    assert b.incidents[0].onset == pytest.approx(15.05)


def test_a_hangs_own_measure_wins_over_another_ranks_later_stamp_of_the_same_step() -> None:
    """Seen in the e2e job: rank 1's agent saw step 11 at 20.0 and reported the hang 6.3 s
    later; rank 0's agent read step 11 a log tick later (20.6) and its summary came first.
    Detection is the 6.3 s its detector measured, not 5.7. Had the job gone past the step
    the agent saw (12), the job's last step would bound it."""
    for seen, reached, want in ((11, 11, 6.3), (11, 12, 26.3 - 21.0), (None, 11, 26.3 - 20.6)):
        led = Ledger(0.0, world_size=2)
        for s in range(1, 11):
            led.progress(0, 0, s, 10.0 + s - 1)  # step 10 at 19.0
        led.progress(0, 0, 11, 20.6)  # rank 0's stamp of step 11
        if reached == 12:
            led.progress(0, 0, 12, 21.0)
        led.fault("h", "hang", 20.0, 26.3, last_step=seen)
        led.restart(1, 27.0, fault_id="h")
        assert led.breakdown(27.0).seconds["detection"] == pytest.approx(want), (seen, reached)
