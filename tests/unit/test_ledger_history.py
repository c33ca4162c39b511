"""Issue 24: each incident of the ledger (``per_incident``) survives an arbiter restart
through the job's history record, as the category totals do; a record's incidents are
checked where they enter (a bad one is left out, the record is kept)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftagent.arbiter.history import (
    History,
    JobRecord,
    incident_from_json,
    incident_json,
)
from ftagent.arbiter.history_file import FileHistory
from ftagent.arbiter.ledger import INCIDENTS_KEPT, Incident
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.model import Fault, FaultKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import fault_to_proto


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock, state_dir: Path) -> Registry:
    return Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                    history=History(FileHistory(str(state_dir))))


def summaries(reg: Registry, conns: list[Connection], clock: Clock, first: int,
              last: int, **kw: int) -> None:
    for step in range(first, last + 1):
        for c in conns:
            reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
                step=step, ts=clock.now, seconds_since_progress=0.0, **kw)), 0.0)
        clock.now += 1


def crash_and_resume(reg: Registry, conns: list[Connection], clock: Clock, gen: int,
                     resumed: int, upto: int) -> None:
    f = fault_to_proto(Fault(FaultKind.CRASH, "boom", detected_at=clock.now), gen - 1,
                       exit_status=1)
    reg.handle(conns[1], pb.AgentMessage(fault=f), 0.0)
    clock.now += 2
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=gen)), 0.0)
    clock.now += 3
    summaries(reg, conns, clock, resumed + 1, upto, resumed_step=resumed)


def incidents(reg: Registry) -> list[tuple[int, str, int, int, int, str]]:
    g = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    return [(i.generation, i.kind, i.reached_step, i.resumed_step, i.recomputed_steps,
             i.resume_source) for i in g.per_incident]


def test_each_incident_survives_an_arbiter_restart(tmp_path: Path) -> None:
    clock = Clock()
    reg = registry(clock, tmp_path)
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}"))
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    clock.now += 5
    summaries(reg, conns, clock, 1, 20)
    crash_and_resume(reg, conns, clock, 1, 15, 30)  # steps 16..20 redone
    crash_and_resume(reg, conns, clock, 2, 25, 32)  # steps 26..30 redone
    before = incidents(reg)
    assert before == [(1, "crash", 20, 15, 5, "reported"), (2, "crash", 30, 25, 5, "reported")]
    stages = [(i.detect_seconds, i.decide_seconds, i.restart_seconds, i.recompute_seconds)
              for i in reg.job_info(reg.jobs[("", "j")], ranks=False).goodput.per_incident]
    reg.history.close()

    clock.now += 30  # the arbiter is away for 30 s; a new one reads the history
    reg2 = registry(clock, tmp_path)
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg2.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}",
                               generation=2, released_generation=2, trainer_running=True,
                               restart_count=2))
    summaries(reg2, conns, clock, 60, 61)
    assert incidents(reg2) == before
    g = reg2.job_info(reg2.jobs[("", "j")], ranks=False).goodput
    assert (g.recomputed_steps, g.incidents) == (10, 2)  # carried once, not twice
    assert [(i.detect_seconds, i.decide_seconds, i.restart_seconds, i.recompute_seconds)
            for i in g.per_incident] == stages

    # a third restart under the new arbiter comes after them
    crash_and_resume(reg2, conns, clock, 3, 55, 62)
    assert [i[:5] for i in incidents(reg2)] == [*[i[:5] for i in before],
                                                (3, "crash", 61, 55, 6)]
    assert reg2.job_info(reg2.jobs[("", "j")], ranks=False).goodput.recomputed_steps == 16

    # and once its agents are gone, the history's record shows them too
    for c in conns:
        reg2.handle(c, pb.AgentMessage(exit=pb.TrainerExit(generation=3, exit_code=0)), 0.0)
        reg2.disconnect(c)
    clock.now += 4000
    reg2.tick()
    past = reg2.find_any("j", "")
    assert past is not None and not reg2.jobs
    gp = reg2.info(past, ranks=False).goodput
    assert [(i.generation, i.recomputed_steps) for i in gp.per_incident] == [
        (1, 5), (2, 5), (3, 6)]


def test_a_records_incidents_are_checked_where_they_enter() -> None:
    good = Incident(4, "hang", 10.0, 15.0, 16.0, released=20.0, reached=40, resumed=30,
                    resume_source="reported", recompute_seconds=2.5)
    again = incident_from_json(json.loads(json.dumps(incident_json(good))))
    assert again == good
    top = Incident(4, "crash", 10.0, 10.0, 11.0, reached=2**53 - 1, resumed=2**53 - 5)
    assert incident_from_json(incident_json(top)) == top  # any step the wire allows
    bad = [
        "x", [1, 2], [*incident_json(good)[:2], float("nan"), *incident_json(good)[3:]],
        [-1, *incident_json(good)[1:]], [*incident_json(good)[:7], True,
                                         *incident_json(good)[8:]],
        [*incident_json(good)[:9], "guessed", *incident_json(good)[10:]],
        [*incident_json(good)[:2], 1e300, *incident_json(good)[3:]],
        [*incident_json(good)[:7], 2**53, *incident_json(good)[8:]],
    ]
    for v in bad:
        with pytest.raises(ValueError):
            incident_from_json(v)
    rec = JobRecord.from_json({"job": "j", "goodput": {"productive": 1.0},
                               "goodput_incidents": [*bad, incident_json(good)]})
    assert rec.goodput_incidents == [incident_json(good)]  # the record is kept
    many = JobRecord.from_json({"job": "j", "goodput_incidents":
                                [incident_json(good)] * (INCIDENTS_KEPT + 10)})
    assert len(many.goodput_incidents) == INCIDENTS_KEPT
    assert JobRecord.from_json({"job": "j", "goodput_incidents": "no"}).goodput_incidents == []
    long_kind = incident_from_json(["k" * 500 if f == "kind" else v for f, v in zip(
        ("generation", "kind"), incident_json(good)[:2], strict=True)]
        + incident_json(good)[2:])
    assert len(long_kind.kind) == 32
