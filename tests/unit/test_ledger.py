"""The goodput ledger (arbiter/ledger.py): each fault's shape, categories that sum to the
wall time, recomputed steps equal to the steps redone (pure, injected times)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ftagent.arbiter.history import History
from ftagent.arbiter.history_file import FileHistory
from ftagent.arbiter.ledger import CATEGORIES, Ledger
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.status_view import format_goodput, format_jobs, to_dict
from ftagent.arbiter.timeline import Timeline
from ftagent.metrics import JobCollector
from ftagent.model import Fault, FaultKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import fault_to_proto


def steps(led: Ledger, gen: int, first: int, last: int, t0: float, dt: float,
          ranks: int = 2) -> float:
    """Every rank completes steps first..last, one every ``dt`` from ``t0``; returns the
    time of the last one."""
    t = t0
    for s in range(first, last + 1):
        t = t0 + (s - first) * dt
        for r in range(ranks):
            led.progress(r, gen, s, t)
    return t


def check_sum(led: Ledger, now: float) -> dict[str, float]:
    b = led.breakdown(now)
    assert set(b.seconds) == set(CATEGORIES)
    assert sum(b.seconds.values()) == pytest.approx(b.wall, abs=1e-9)
    assert b.wall == pytest.approx(now - led.start, abs=1e-9)
    assert all(v >= 0 for v in b.seconds.values()), b.seconds
    return b.seconds


def test_no_fault_startup_then_productive() -> None:
    led = Ledger(100.0, world_size=2)
    assert check_sum(led, 109.0)["startup"] == pytest.approx(9.0)
    # generation 0 trains from the first step any rank reports (synchronous training:
    # the other rank did it too, it may just not print it)
    led.progress(0, 0, 1, 110.0)
    led.progress(1, 0, 1, 110.2)
    last = steps(led, 0, 2, 50, 111.0, 1.0)
    led.end(last)
    s = check_sum(led, last)
    assert led.breakdown(500.0).seconds == s  # ended: later time does not count
    assert s["startup"] == pytest.approx(10.0)
    assert s["productive"] == pytest.approx(last - 110.0)
    assert led.breakdown(500.0).recomputed_steps == 0
    assert led.breakdown(500.0).ettr == pytest.approx((last - 110.0) / (last - 100.0))


def test_a_restart_waits_for_every_rank_that_reports_steps_and_no_silent_one() -> None:
    """Ranks 0 and 1 print steps, rank 2 never does (a trainer that logs on some ranks)."""
    led = Ledger(0.0, world_size=3)
    steps(led, 0, 1, 10, 1.0, 1.0)  # ranks 0 and 1
    led.restart(1, 11.0, onset=10.5, detected=10.5)
    led.released(1, 12.0)
    led.progress(0, 1, 6, 15.0)
    assert check_sum(led, 16.0)["restart"] == pytest.approx(4.0)  # rank 1 not yet
    led.progress(1, 1, 6, 16.5)
    s = check_sum(led, 17.0)
    assert s["restart"] == pytest.approx(4.5) and s["productive"] > 0
    # a rank that went silent holds nothing: the next summary of another one starts it
    led.restart(2, 20.0, onset=19.0, detected=19.0)
    led.released(2, 21.0)
    led.progress(0, 2, 6, 23.0)
    led.progress(0, 2, 7, 24.0)
    assert check_sum(led, 25.0)["restart"] == pytest.approx(4.5 + 2.0)


def test_crash_shape_and_recomputed_steps() -> None:
    """Steps 1..40 at 1 s each from t=10; checkpoint at 30; crash at step 40 (t=49.5);
    the agent sees it at once, the barrier is released at 52, the new generation's first
    step is 31 at 60."""
    led = Ledger(0.0, world_size=2)
    steps(led, 0, 1, 40, 10.0, 1.0)
    led.restart(1, 50.0, kind="crash", onset=49.5, detected=49.5)
    led.released(1, 52.0)
    assert check_sum(led, 55.0)["restart"] == pytest.approx(3.0)
    steps(led, 1, 31, 45, 60.0, 1.0)
    s = check_sum(led, 74.0)
    b = led.breakdown(74.0)
    assert s["startup"] == pytest.approx(10.0)
    assert s["detection"] == pytest.approx(0.0)
    assert s["decision"] == pytest.approx(2.5)  # 49.5 -> 52
    assert s["restart"] == pytest.approx(8.0)  # 52 -> 60
    # step 30 was done at t=39: 39 -> 49.5 was redone
    assert s["recomputed"] == pytest.approx(10.5)
    assert s["productive"] == pytest.approx((39.0 - 10.0) + (74.0 - 60.0))
    assert b.recomputed_steps == 10  # steps 31..40
    (inc,) = b.incidents
    assert inc.resume_source == "first_step" and inc.resumed == 30 and inc.reached == 40
    d = inc.durations()
    assert d == {"detect": 0.0, "decide": pytest.approx(2.5), "restart": pytest.approx(8.0),
                 "recompute": pytest.approx(10.5)}


def test_hang_detection_runs_from_the_last_step() -> None:
    led = Ledger(0.0, world_size=2)
    steps(led, 0, 1, 20, 5.0, 1.0)  # last step at 24
    led.restart(1, 60.0, kind="hang", onset=24.0, detected=59.0)
    led.released(1, 65.0)
    steps(led, 1, 1, 3, 70.0, 1.0)  # no checkpoint: starts over from step 1
    s = check_sum(led, 72.0)
    assert s["detection"] == pytest.approx(35.0)
    assert s["decision"] == pytest.approx(6.0)
    assert s["restart"] == pytest.approx(5.0)
    assert s["recomputed"] == pytest.approx(19.0)  # everything after step 0: 5 -> 24
    assert s["productive"] == pytest.approx(2.0)
    assert led.breakdown(72.0).recomputed_steps == 20


def test_reported_resume_step_wins_over_the_first_step() -> None:
    led = Ledger(0.0, world_size=1)
    steps(led, 0, 1, 10, 0.0, 1.0, ranks=1)  # step 1 at 0 ... step 10 at 9
    led.restart(1, 10.0, kind="crash", onset=9.0, detected=9.0)
    led.resumed(1, 5)  # "loaded checkpoint from iteration 5"
    led.released(1, 11.0)
    steps(led, 1, 8, 9, 12.0, 1.0, ranks=1)  # first summary seen at step 8
    b = led.breakdown(13.0)
    assert b.recomputed_steps == 5
    assert b.seconds["recomputed"] == pytest.approx(5.0)  # step 5 at 4 -> 9
    assert b.incidents[0].resume_source == "reported"


def test_two_restarts_before_progress_is_kept_again() -> None:
    """Gen 1 crashes before passing the checkpoint gen 0 had: the recompute of the second
    incident reaches back over gen 1 into gen 0 without counting anything twice."""
    led = Ledger(0.0, world_size=1)
    steps(led, 0, 1, 20, 0.0, 1.0, ranks=1)  # step 20 at 19
    led.restart(1, 20.0, onset=19.0, detected=19.0)
    led.released(1, 21.0)
    steps(led, 1, 11, 15, 22.0, 1.0, ranks=1)  # resumed after 10; step 15 at 26
    led.restart(2, 27.0, onset=26.0, detected=26.0)
    led.released(2, 28.0)
    steps(led, 1, 11, 11, 0.0, 1.0, ranks=1)  # a late summary of gen 1: ignored
    steps(led, 2, 6, 7, 29.0, 1.0, ranks=1)  # resumed after 5
    b = led.breakdown(30.0)
    check_sum(led, 30.0)
    assert [i.recomputed_steps for i in b.incidents] == [10, 10]
    assert b.recomputed_steps == 20
    # gen 0: step 5 at 4 -> 19 redone (15 s); gen 1: 22 -> 26 (4 s)
    assert b.seconds["recomputed"] == pytest.approx(19.0)
    assert b.seconds["productive"] == pytest.approx(4.0 + 1.0)


def test_skewed_agent_clocks_stay_inside_the_wall_time() -> None:
    led = Ledger(100.0, world_size=1)
    led.progress(0, 0, 1, -1e12)  # a step "before" the job started
    steps(led, 0, 2, 5, 101.0, 1.0, ranks=1)
    led.restart(1, 110.0, onset=1e12, detected=-5.0)  # nonsense fault times
    led.released(1, 109.0)  # released "before" the decision
    led.progress(0, 1, 3, 1e12)
    s = check_sum(led, 1e12 + 1)
    assert s["restart"] >= 0


def test_non_finite_times_move_nothing() -> None:
    nan, inf = float("nan"), float("inf")
    led = Ledger(0.0, world_size=1)
    led.progress(0, 0, 1, nan)
    steps(led, 0, 2, 5, 1.0, 1.0, ranks=1)
    led.fault("f", "crash", nan, -inf)
    led.restart(1, 10.0, fault_id="f")
    led.released(1, inf)
    led.progress(0, 1, 3, inf)
    s = check_sum(led, 12.0)
    assert all(v == v for v in s.values())
    led.end(nan)
    assert sum(led.breakdown(nan).seconds.values()) == pytest.approx(led.breakdown(0).wall)


def test_unknown_resume_is_none_not_guessed() -> None:
    led = Ledger(0.0, world_size=2)
    steps(led, 0, 1, 5, 1.0, 1.0)
    led.restart(1, 10.0, onset=6.0, detected=6.0)
    b = led.breakdown(12.0)
    assert b.incidents[0].recomputed_steps is None  # the new generation has no step yet
    assert b.recomputed_steps == 0
    led.released(1, 11.0)
    check_sum(led, 12.0)


def test_exported_counters_never_go_down() -> None:
    led = Ledger(0.0, world_size=1)
    steps(led, 0, 1, 10, 0.0, 1.0, ranks=1)
    before = led.exported(9.0)["productive"]
    led.restart(1, 10.0, onset=9.0, detected=9.0)
    led.released(1, 10.0)
    steps(led, 1, 1, 2, 11.0, 1.0, ranks=1)
    after = led.exported(12.0)
    assert after["productive"] >= before
    assert led.breakdown(12.0).seconds["productive"] < before


def test_carried_totals_continue_after_an_arbiter_restart() -> None:
    led = Ledger(1000.0, world_size=1, carried={"productive": 50.0, "startup": 5.0})
    led.progress(0, 3, 100, 1010.0)  # the job went on while the arbiter was away
    s = check_sum_carried(led, 1020.0, 55.0)
    assert s["productive"] == pytest.approx(60.0)
    assert s["unattributed"] == pytest.approx(10.0)


def check_sum_carried(led: Ledger, now: float, carried: float) -> dict[str, float]:
    b = led.breakdown(now)
    assert sum(b.seconds.values()) == pytest.approx(b.wall, abs=1e-9)
    assert b.wall == pytest.approx(now - led.start + carried)
    return b.seconds


# ---------------------------------------------------------------- fed by the registry


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _registry(clock: Clock, history: History) -> Registry:
    return Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                    history=history)


def _progress(reg: Registry, conns: list[Connection], step: int, clock: Clock,
              **kw: int) -> None:
    for c in conns:
        reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
            step=step, ts=clock.now, seconds_since_progress=0.0, **kw)), 0.0)


def _crash_job(reg: Registry, clock: Clock, **again: int) -> list[Connection]:
    """Two ranks: 5 s startup, steps 1..20 (1 s each), a crash at step 20 (+0.5 s),
    3 s to the barrier's release, 4 s to the first step (11: resumed after 10).
    ``again``: fields of the new generation's ProgressSummaries (``resumed_step``)."""
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    clock.now += 5
    for step in range(1, 21):
        _progress(reg, conns, step, clock)
        clock.now += 1
    clock.now -= 0.5
    f = fault_to_proto(Fault(FaultKind.CRASH, "boom", detected_at=clock.now), 0,
                       exit_status=1)
    reg.handle(conns[1], pb.AgentMessage(fault=f), 0.0)
    clock.now += 3
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=1)), 0.0)
    clock.now += 4
    for step in range(11, 16):
        _progress(reg, conns, step, clock, **again)
        clock.now += 1
    return conns


def test_the_registry_feeds_the_ledger_into_status_and_metrics() -> None:
    clock = Clock()
    start = clock.now
    reg = _registry(clock, History())
    _crash_job(reg, clock)
    g = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    assert g.wall_seconds == pytest.approx(clock.now - start)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_seconds)
    assert g.seconds["startup"] == pytest.approx(5.0)
    assert g.seconds["decision"] == pytest.approx(3.0)
    assert g.seconds["restart"] == pytest.approx(4.0)
    assert g.seconds["recomputed"] == pytest.approx(10.5)  # step 10 (+14 s) -> crash (+24.5)
    assert g.recomputed_steps == 10 and g.incidents == 1
    assert g.ratio == pytest.approx(g.seconds["productive"] / g.wall_seconds)
    listing = format_jobs([reg.job_info(reg.jobs[("", "j")], ranks=False), pb.JobInfo(job="x")])
    assert "GOODPUT" in listing and f"{100 * g.ratio:.1f}%" in listing
    text = format_goodput(g)
    odd = pb.Goodput(wall_seconds=1.0, seconds={"x\x1b[2Jy" + "z" * 100: 1.0})
    assert "\x1b" not in format_goodput(odd) and "z" * 40 not in format_goodput(odd)
    assert text.startswith("goodput: ") and "10 steps recomputed" in text
    assert to_dict(pb.JobInfo(goodput=g))["goodput"]["seconds"]["restart"] == \
        pytest.approx(4.0)
    assert to_dict(pb.JobInfo())["goodput"] is None

    registry_ = CollectorRegistry()
    registry_.register(JobCollector(reg.job_snapshots))
    out = generate_latest(registry_).decode()
    assert 'ftagent_job_goodput_seconds_total{category="restart",job_name="j",' \
        'namespace=""} 4.0' in out
    assert 'ftagent_job_goodput_ratio{job_name="j",namespace=""}' in out


def test_the_ledger_survives_an_arbiter_restart(tmp_path: Path) -> None:
    clock = Clock()
    start = clock.now
    reg = _registry(clock, History(FileHistory(str(tmp_path))))
    conns = _crash_job(reg, clock)
    before = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    reg.history.close()
    clock.now += 30  # the arbiter is away for 30 s
    reg2 = _registry(clock, History(FileHistory(str(tmp_path))))
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg2.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}",
                               generation=1, released_generation=1, trainer_running=True,
                               restart_count=1))
    _progress(reg2, conns, 50, clock)
    g = reg2.job_info(reg2.jobs[("", "j")], ranks=False).goodput
    assert g.wall_seconds == pytest.approx(clock.now - start, abs=1.5)
    assert g.seconds["restart"] == pytest.approx(before.seconds["restart"])
    assert g.seconds["startup"] == pytest.approx(5.0)
    assert g.seconds["productive"] >= 30.0 + before.seconds["productive"]  # it went on
    assert (g.recomputed_steps, g.incidents) == (10, 1)  # carried over
    # and once its agents are gone, the history's record says the same
    for c in conns:
        reg2.handle(c, pb.AgentMessage(exit=pb.TrainerExit(generation=1, exit_code=0)), 0.0)
        reg2.disconnect(c)
    clock.now += 4000
    reg2.tick()
    assert not reg2.jobs
    past = reg2.find_any("j", "")
    assert past is not None
    gp = reg2.info(past, ranks=False).goodput
    assert (gp.recomputed_steps, gp.incidents) == (10, 1)
    assert gp.wall_seconds == pytest.approx(sum(gp.seconds.values()))
    assert gp.seconds["productive"] == pytest.approx(g.seconds["productive"], abs=0.01)


def test_a_rank_waiting_at_the_barrier_still_reports_its_previous_trainer() -> None:
    """Lines the crashed trainer printed are read after its exit: the agent has arrived for
    generation 1 already, but that step is generation 0's (the step it had reached), not
    the first step of generation 1."""
    clock = Clock()
    reg = _registry(clock, History())
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    for step in range(1, 21):
        _progress(reg, conns, step, clock)
        clock.now += 1
    f = fault_to_proto(Fault(FaultKind.CRASH, "boom", detected_at=clock.now), 0,
                       exit_status=1)
    reg.handle(conns[1], pb.AgentMessage(fault=f), 0.0)
    reg.handle(conns[1], pb.AgentMessage(arrival=pb.BarrierArrival(generation=1)), 0.0)
    _progress(reg, conns[1:], 21, clock)  # generation 0's last line, read late
    clock.now += 1
    reg.handle(conns[0], pb.AgentMessage(arrival=pb.BarrierArrival(generation=1)), 0.0)
    clock.now += 2
    _progress(reg, conns, 11, clock)
    g = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    assert g.recomputed_steps == 11  # steps 11..21 are done twice
    assert g.seconds["restart"] == pytest.approx(2.0)


def test_the_report_shows_the_ledger_from_the_arbiter() -> None:
    pytest.importorskip("matplotlib")
    from ftagent import report

    info = {"job": "llama", "timeline": [], "goodput": {
        "wall_seconds": 100.0, "ratio": 0.8, "recomputed_steps": 12,
        "seconds": {"productive": 80.0, "restart": 15.0, "<b>x</b>": 5.0, "bad": "1"}}}
    d = report.from_job_info(info, now=1.0)
    assert d.ledger == {"productive": 80.0, "restart": 15.0, "<b>x</b>": 5.0}
    page = report.render(d)
    assert '<table id="ledger">' in page and "80.0% of 100 s" in page
    assert "12 steps recomputed" in page and "<b>x</b>" not in page
    assert "<td>restart</td><td>15.0</td><td>15.0%</td>" in page
    assert '<table id="ledger">' not in report.render(report.from_job_info(
        {"job": "j", "goodput": None}, now=1.0))


def test_a_trainer_started_failing_open_reports_its_own_generation() -> None:
    """Agents that restarted into generation 1 while no arbiter answered (released up to
    0, a trainer of 1 running): their steps are generation 1's, with no startup."""
    clock = Clock()
    reg = _registry(clock, History())
    c = Connection()
    reg.hello(c, pb.Hello(job="j", rank=0, world_size=1, agent_instance="i", generation=1,
                          released_generation=0, trainer_running=True, restart_count=1))
    clock.now += 1
    _progress(reg, [c], 7, clock)
    clock.now += 1
    led = reg.stats[("", "j")][1].ledger
    assert led is not None and led.generation == 1
    g = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    assert g.seconds["startup"] == 0.0 and g.seconds["productive"] == pytest.approx(1.0)


# ---------------------------------------------------------------- issue 24: what the job says


def test_phase_time_moves_out_of_productive() -> None:
    """Rank 0 reports 2 s in a checkpoint save and 1 s of eval, rank 1 (waiting for it)
    less: the largest report is believed, once; a report larger than the training time
    moves no more than that; a phase before training began stays where it was."""
    led = Ledger(0.0, world_size=2)
    led.phases(0, 0, (5.0, 0.0), 1.0)  # start-up: not training yet, only a baseline
    steps(led, 0, 1, 10, 10.0, 1.0)  # training 10 -> 19
    led.phases(0, 0, (7.0, 1.0), 19.0)
    led.phases(1, 0, (1.5, 0.5), 19.0)
    led.phases(1, 0, (1.0, 0.5), 19.5)  # a report going back changes nothing
    s = check_sum(led, 20.0)
    assert s["checkpoint"] == pytest.approx(2.0) and s["other_phases"] == pytest.approx(1.0)
    assert s["productive"] == pytest.approx(10.0 - 3.0)
    led.phases(0, 0, (1e6, 1e6), 20.0)  # more than the job trained: capped
    s = check_sum(led, 20.0)
    assert s["productive"] == pytest.approx(0.0)
    assert s["checkpoint"] + s["other_phases"] == pytest.approx(10.0)
    # a new generation's trainers count from zero again
    led.restart(1, 21.0, kind="crash", onset=20.0, detected=20.0)
    led.released(1, 22.0)
    steps(led, 1, 11, 14, 23.0, 1.0)
    led.phases(0, 1, (0.5, 0.0), 26.0)
    s = check_sum(led, 26.0)
    assert s["checkpoint"] == pytest.approx(9.0 + 0.5)  # the cap went to the first category
    assert s["other_phases"] == pytest.approx(1.0)
    assert s["productive"] == pytest.approx(3.0 - 0.5)


def _summary(step: int, ts: float, **kw: float) -> pb.AgentMessage:
    return pb.AgentMessage(progress=pb.ProgressSummary(step=step, ts=ts,
                                                       seconds_since_progress=0.0, **kw))


def test_the_resume_step_the_job_reports_reaches_the_ledger_and_each_incident() -> None:
    """The crash job, but the new generation's trainers said "loaded checkpoint at
    iteration 5" (a ProgressSummary's resumed_step) and their first step seen is 11
    (steps 6..10 fell between two log ticks): steps 6..20 were redone, not 11..20. Each
    incident's stages come with the goodput block (status JSON, text, report)."""
    clock = Clock()
    reg = _registry(clock, History())
    conns = _crash_job(reg, clock, resumed_step=5)
    g = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    assert g.recomputed_steps == 15
    assert g.seconds["recomputed"] == pytest.approx(15.5)  # step 5 (+9 s) -> crash (+24.5)
    (inc,) = g.per_incident
    assert (inc.generation, inc.kind, inc.reached_step, inc.resumed_step,
            inc.recomputed_steps, inc.resume_source) == (1, "crash", 20, 5, 15, "reported")
    assert inc.detect_seconds == pytest.approx(0.0)
    assert inc.decide_seconds == pytest.approx(3.0)
    assert inc.restart_seconds == pytest.approx(4.0)
    assert inc.recompute_seconds == pytest.approx(15.5)
    js = to_dict(pb.JobInfo(goodput=g))["goodput"]
    assert js["per_incident"][0]["resumed_step"] == 5 and js["incidents"] == 1
    text = format_goodput(g)
    assert "RESUMED AFTER" in text and "5 (reported)" in text and "15.5s" in text
    # a summary with a resume step out of range is dropped whole, never believed
    bad = _summary(16, clock.now, resumed_step=-3)
    reg.handle(conns[0], bad, 0.0)
    assert reg.jobs[("", "j")].ranks[0].step == 15


def test_the_report_shows_each_incident() -> None:
    from ftagent import report

    info = {"job": "llama", "timeline": [], "goodput": {
        "wall_seconds": 100.0, "ratio": 0.8, "recomputed_steps": 12,
        "seconds": {"productive": 80.0, "restart": 20.0},
        "per_incident": [
            {"generation": 1, "kind": "<i>crash</i>", "detect_seconds": 0.5,
             "decide_seconds": 3.0, "restart_seconds": None, "recompute_seconds": 10.5,
             "recomputed_steps": None, "resumed_step": 30, "resume_source": "reported"},
            {"generation": "2"}, "junk"]}}
    d = report.from_job_info(info, now=1.0)
    assert len(d.incidents) == 1
    page = report.incident_table(d)  # (render() puts it under the ledger's table)
    assert '<table id="incidents">' in page and "<i>crash" not in page
    assert ("<td>1</td><td>&lt;i&gt;crash&lt;/i&gt;</td><td>0.5</td><td>3.0</td><td>-</td>"
            "<td>10.5</td><td>unknown</td><td>30 (reported)</td>") in page


def test_the_agent_carries_what_its_trainer_said() -> None:
    """The agent's side (reporter.TrainerSays, convert.fill_resume_and_phases): the resume
    step and the seconds in declared phases of this generation's trainer, open phases up
    to now, an end without a begin nothing; a new trainer starts from nothing."""
    from ftagent.agent.reporter import TrainerSays
    from ftagent.model import PhaseMarker, Resumed
    from ftagent.wire.checks import progress_in_range
    from ftagent.wire.convert import fill_resume_and_phases

    says = TrainerSays()
    says.observe(PhaseMarker("eval", False), 1.0)  # no begin: nothing
    says.observe(Resumed(30), 2.0)
    says.observe(PhaseMarker("checkpoint", True), 10.0)
    says.observe(PhaseMarker("checkpoint", False), 12.5)
    says.observe(PhaseMarker("eval", True), 20.0)
    assert says.resumed == 30 and says.phase_seconds(21.0) == (2.5, 1.0)
    msg = pb.ProgressSummary(step=31)
    fill_resume_and_phases(msg, says.resumed, *says.phase_seconds(21.0))
    assert (msg.resumed_step, msg.checkpoint_seconds, msg.other_phase_seconds) == (30, 2.5, 1.0)
    assert progress_in_range(msg)
    fill_resume_and_phases(msg, None, float("nan"), float("inf"))
    assert progress_in_range(msg) and msg.checkpoint_seconds == 0.0
    says.reset()
    assert says.resumed is None and says.phase_seconds(30.0) == (0.0, 0.0)
    for bad in (pb.ProgressSummary(step=1, resumed_step=-1),
                pb.ProgressSummary(step=1, checkpoint_seconds=float("nan")),
                pb.ProgressSummary(step=1, other_phase_seconds=2e9)):
        assert not progress_in_range(bad)


def test_no_straggler_share_from_step_times_alone() -> None:
    """Without a breakdown (no rank measured its collectives or data waits), two ranks of
    a synchronous job have the same step time over the same steps: means that differ say
    when each rank summarised, not that one is slow (issue 24: 35.6 s of a ten-minute
    bench booked as straggler with no instrument())."""
    from ftagent.arbiter.straggler import RankTiming, slowdown

    a, b = RankTiming(0, step_seconds=0.08), RankTiming(1, step_seconds=0.12)
    assert slowdown({0: a, 1: b}, 0.8) == 0.0
    waits = RankTiming(0, step_seconds=0.12, collective_seconds=0.06)  # measured: believed
    assert slowdown({0: waits, 1: b}, 0.8) == pytest.approx(0.5)


def test_time_waited_on_a_slow_rank_and_on_capacity() -> None:
    """A slow rank makes the job wait 40 % of each step for 10 s of training: 4 s of
    straggler; a replacement pod Pending without a node for 5 s of the decision: capacity;
    the categories still sum to the wall time."""
    from ftagent.arbiter.straggler import RankTiming, slowdown

    fast = RankTiming(0, step_seconds=1.0, collective_seconds=0.5)
    slow = RankTiming(1, step_seconds=1.0, collective_seconds=0.1)  # own 0.9 vs 0.5
    assert slowdown({0: fast, 1: slow}, 0.8) == pytest.approx(0.4)
    assert slowdown({0: fast}, 0.8) == 0.0  # no median of others
    jitter = RankTiming(1, step_seconds=1.0, collective_seconds=0.45)
    assert slowdown({0: fast, 1: jitter}, 0.8) == 0.0  # not slow by the watch's measure
    led = Ledger(0.0, world_size=2)
    steps(led, 0, 1, 21, 10.0, 1.0)  # training 10 -> 30
    led.slowed(0.0, 15.0)
    led.slowed(0.4, 25.0)  # 15 -> 25 at 40 %
    led.slowed(float("nan"), 26.0)  # nothing moves, nothing is lost
    s = check_sum(led, 30.0)
    assert s["straggler"] == pytest.approx(4.0)
    assert s["productive"] == pytest.approx(20.0 - 4.0)
    led.restart(1, 31.0, kind="node", onset=30.0, detected=30.5)
    led.capacity(True, 32.0)
    led.capacity(True, 33.0)  # still waiting: nothing changes
    led.capacity(False, 37.0)
    led.released(1, 38.0)
    s = check_sum(led, 39.0)
    assert s["capacity"] == pytest.approx(5.0)
    assert s["decision"] == pytest.approx(0.5 + 1.0 + 1.0)  # 30.5 -> 32, 37 -> 38
    assert s["restart"] == pytest.approx(1.0)
    led.slowed(0.5, 39.0)  # not training: nothing
    assert check_sum(led, 39.0)["straggler"] == pytest.approx(4.0)


def test_a_restart_before_the_generation_trained_hands_its_steps_to_the_next() -> None:
    """Steps 1..19, a crash; generation 1 loads the checkpoint of step 10 and is restarted
    again (a fatal Xid) before its first step; generation 2 loads step 10 too: steps
    11..19 were redone once, by the second restart; the first redid nothing."""
    led = Ledger(0.0, world_size=2)
    steps(led, 0, 1, 19, 1.0, 1.0)  # step 19 at 19
    led.restart(1, 20.0, kind="crash", onset=19.5, detected=19.5)
    led.released(1, 21.0)
    led.resumed(1, 10)
    led.restart(2, 25.0, kind="gpu", onset=24.0, detected=24.0)
    led.released(2, 26.0)
    led.resumed(2, 10)
    steps(led, 2, 11, 12, 28.0, 1.0)
    b = led.breakdown(30.0)
    first, second = b.incidents
    assert (first.recomputed_steps, second.recomputed_steps) == (0, 9)
    assert (second.reached, second.resumed, second.resume_source) == (19, 10, "reported")
    assert b.recomputed_steps == 9
    assert b.seconds["recomputed"] == pytest.approx(19.5 - 10.0)  # step 10 at 10 -> 19.5
    check_sum(led, 30.0)


def test_the_registry_feeds_the_straggler_share_from_the_step_timings() -> None:
    """Rank 1 computes 0.9 s of each 1 s step, rank 0 0.5 s (it waits in the all-reduce):
    40 % of the training time after the first timed summaries is straggler."""
    clock = Clock()
    reg = _registry(clock, History())
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    for step in range(1, 12):
        for r, c in enumerate(conns):
            reg.handle(c, _summary(step, clock.now, step_seconds=1.0, timed_steps=5,
                                   collective_seconds=0.5 if r == 0 else 0.1), 0.0)
        clock.now += 1
    g = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    assert g.seconds["straggler"] == pytest.approx(0.4 * 10, abs=0.01)  # steps 1 -> 11
    assert sum(g.seconds.values()) == pytest.approx(g.wall_seconds)
