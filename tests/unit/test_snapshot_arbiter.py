"""The arbiter's side of snapshots: the newest step every rank holds, told on RESTART, and
the ledger's exact resume step and source. The registry is the real one (as in
test_ledger.py); its connections' outboxes hold what it sends."""

from __future__ import annotations

import pytest

from ftagent.arbiter import snapshots
from ftagent.arbiter.history import History
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import JobState, RankState
from ftagent.arbiter.status_view import format_job
from ftagent.arbiter.timeline import Timeline
from ftagent.model import Fault, FaultKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import command_to_action, fault_to_proto


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _job(*held: tuple[int, ...], world: int = 2) -> JobState:
    job = JobState(job="j", world_size=world)
    for r, steps in enumerate(held):
        job.ranks[r] = RankState(rank=r, snapshot_steps=steps)
    return job


def test_the_resume_step_is_the_newest_every_rank_holds() -> None:
    assert snapshots.resume_step(_job((10, 20, 30), (10, 20))) == 20
    assert snapshots.resume_step(_job((10, 20), (30,))) is None  # nothing in common
    assert snapshots.resume_step(_job((10, 20))) is None  # rank 1 never said
    assert snapshots.resume_step(_job((10,), (), world=2)) is None
    assert snapshots.resume_step(_job((5, 7), (7,), (7, 9), world=3)) == 7


def _commands(c: Connection) -> list[pb.Command]:
    out = []
    while not c.outbox.empty():
        item = c.outbox.get_nowait()
        if isinstance(item, tuple):
            m = pb.ArbiterMessage.FromString(item[0])
            if m.HasField("command"):
                out.append(m.command)
    return out


def _crash(reg: Registry, clock: Clock, conns: list[Connection],
           held: list[list[int]]) -> list[pb.Command]:
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    clock.now += 1
    for step in range(1, 26):
        for c in conns:
            reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
                step=step, ts=clock.now, seconds_since_progress=0.0)), 0.0)
        clock.now += 1
    for c, steps in zip(conns, held, strict=True):
        reg.handle(c, pb.AgentMessage(snapshots=pb.SnapshotReport(steps=steps)), 0.0)
    f = fault_to_proto(Fault(FaultKind.CRASH, "boom", detected_at=clock.now), 0, exit_status=1)
    for c in conns:
        _commands(c)  # what came before the crash
    reg.handle(conns[1], pb.AgentMessage(fault=f), 0.0)
    return [cmd for c in conns for cmd in _commands(c)]


def test_a_restart_tells_every_rank_the_newest_complete_step() -> None:
    clock = Clock()
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                   history=History())
    conns = [Connection(f"peer-{r}") for r in range(2)]
    # rank 1 died while writing its step-20 shard: 10 is the newest both hold
    cmds = _crash(reg, clock, conns, [[10, 20], [10]])
    restarts = [c for c in cmds if c.kind == pb.COMMAND_KIND_RESTART]
    assert len(restarts) == 2 and all(c.resume_step == 10 for c in restarts)
    action = command_to_action(restarts[0])
    assert action is not None and action.resume_step == 10
    info = reg.job_info(reg.jobs[("", "j")], ranks=False)
    assert info.snapshot_step == 10
    assert "snapshot: newest complete on every rank: step 10" in format_job(info)


def test_no_snapshot_no_resume_step_and_bad_reports_are_dropped() -> None:
    clock = Clock()
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                   history=History())
    conns = [Connection(f"peer-{r}") for r in range(2)]
    # rank 1's report names 9 steps (more than 8) and a negative one: both dropped
    cmds = _crash(reg, clock, conns, [[10], list(range(1, 10))])
    assert all(not c.HasField("resume_step") for c in cmds)
    reg.handle(conns[1], pb.AgentMessage(snapshots=pb.SnapshotReport(steps=[-1, 10])), 0.0)
    assert reg.jobs[("", "j")].ranks[1].snapshot_steps == ()


def test_a_new_agent_on_a_rank_forgets_the_old_ones_snapshots() -> None:
    clock = Clock()
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                   history=History())
    c0, c1 = Connection("p0"), Connection("p1")
    reg.hello(c0, pb.Hello(job="j", rank=0, world_size=1, agent_instance="old"))
    reg.handle(c0, pb.AgentMessage(snapshots=pb.SnapshotReport(steps=[4])), 0.0)
    assert reg.jobs[("", "j")].ranks[0].snapshot_steps == (4,)
    reg.disconnect(c0)
    reg.hello(c1, pb.Hello(job="j", rank=0, world_size=1, agent_instance="new"))
    assert reg.jobs[("", "j")].ranks[0].snapshot_steps == ()


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_the_ledger_takes_the_resume_step_and_its_source(source: str) -> None:
    clock = Clock()
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                   history=History())
    conns = [Connection(f"peer-{r}") for r in range(2)]
    _crash(reg, clock, conns, [[10, 20], [10, 20]])
    clock.now += 1
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=1)), 0.0)
    clock.now += 1
    for step in range(21, 24):
        for c in conns:
            reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
                step=step, ts=clock.now, seconds_since_progress=0.0, resumed_step=20,
                resume_source=source)), 0.0)
        clock.now += 1
    g = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    (inc,) = g.per_incident
    assert (inc.reached_step, inc.resumed_step, inc.recomputed_steps, inc.resume_source) == \
        (25, 20, 5, source)


def test_a_summary_with_an_unknown_resume_source_is_dropped() -> None:
    from ftagent.wire.checks import progress_in_range
    assert progress_in_range(pb.ProgressSummary(step=1, resume_source="memory"))
    assert not progress_in_range(pb.ProgressSummary(step=1, resume_source="x" * 40))
