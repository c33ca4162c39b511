"""Waiting is not hanging (issue 22, items 4 and 5), the arbiter's side: a rank verified
waiting in a collective reports a WARNING suspicion that is still decided as a hang; a
job whose stacks show busy ranks gets BUSY (no restart), sent to every rank with who is
busy, who waits and which spinning rank the others wait on; status shows it until steps
resume. Pure policy and the registry driven by messages (no gRPC, no sleeps)."""

from __future__ import annotations

import json
from typing import Any

from ftagent.arbiter import convert
from ftagent.arbiter.policy import (
    FaultReport,
    PolicyConfig,
    decide_fault,
    decide_stacks,
    stack_signature,
)
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import (
    Decision,
    HangProbe,
    JobPhase,
    JobState,
    RankState,
    Verdict,
)
from ftagent.arbiter.status_view import format_job, to_dict
from ftagent.arbiter.timeline import Timeline
from ftagent.model import ActionKind, Fault, FaultKind, JobBusy, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import command_to_action, fault_to_proto

SPIN = """Thread 7 (active): "MainThread"
    spin (train.py:64)
    main (train.py:117)
"""
WAIT = """Thread 8 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:825)
    backward (torch/_tensor.py:648)
    main (train.py:122)
"""
EVAL = """Thread 9 (active): "MainThread"
    Linear.forward (torch/nn/modules/linear.py:134)
    evaluate (train.py:138)
"""


def answer(text: str, state: str, where: str, fr: list[dict[str, Any]] | None = None,
           rank: int = 0) -> str:
    """A DUMP_STACKS answer as agent/verify.py (+ the flight recorder's summary) sends it."""
    out: dict[str, Any] = {"processes": [{"pid": 1, "stack": text}], "seconds": 2.0,
                           "liveness": {"state": state, "where": where, "declared": False}}
    if fr is not None:
        out["flight_recorder"] = {"summaries": [{"rank": rank, "groups": fr}]}
    return json.dumps(out)


def group(enq: int, done: int) -> dict[str, Any]:
    return {"name": "0", "enqueued": enq, "completed": done,
            "entries": [{"seq": enq, "op": "all_reduce", "in_sizes": [[4]],
                         "dtypes": ["Float"], "frames": []}]}


def probed(stacks: dict[int, str], fr: dict[int, Any] | None = None) -> JobState:
    j = JobState(job="j", world_size=len(stacks), phase=JobPhase.RUNNING)
    j.hang_probe = HangProbe(fault_id="f1", rank=1, deadline=100.0)
    for r, s in stacks.items():
        j.ranks[r] = RankState(rank=r, connected=True, step=40, stack=stack_signature(s))
        j.ranks[r].fr = None if fr is None else fr.get(r)
    return j


def busy_of(j: JobState) -> tuple[Decision, JobBusy]:
    (d,) = decide_stacks(j, 10.0, PolicyConfig())
    assert d.verdict is Verdict.BUSY and d.busy is not None, d
    return d, d.busy


def test_a_rank_spinning_while_its_peer_waits_in_a_collective_is_a_spin_culprit() -> None:
    d, b = busy_of(probed({0: answer(SPIN, "spinning", "spin (train.py:64)"),
                           1: answer(WAIT, "hung", "_engine_run_backward")}))
    assert (b.busy_ranks, b.waiting_ranks, b.state) == ((0,), (1,), "spinning")
    assert b.spin_culprits == (0,) and "--hang-culprit-spin-timeout" in d.reason


def test_the_flight_recorder_must_show_the_spinner_behind() -> None:
    stacks = {0: answer(SPIN, "spinning", "spin (train.py:64)"),
              1: answer(WAIT, "hung", "_engine_run_backward")}
    behind = {0: {"rank": 0, "groups": [group(6, 6)]}, 1: {"rank": 1, "groups": [group(7, 6)]}}
    assert busy_of(probed(stacks, behind))[1].spin_culprits == (0,)
    level = {0: {"rank": 0, "groups": [group(7, 6)]}, 1: {"rank": 1, "groups": [group(7, 6)]}}
    _, b = busy_of(probed(stacks, level))  # both inside #7: rank 1 does not wait on rank 0
    assert b.spin_culprits == () and b.busy_ranks == (0,)


def test_every_rank_busy_is_an_evaluation_and_never_a_culprit() -> None:
    _, b = busy_of(probed({r: answer(SPIN, "spinning", "spin (train.py:64)") for r in (0, 1)}))
    assert b.busy_ranks == (0, 1) and b.waiting_ranks == () and b.spin_culprits == ()


def test_an_alive_rank_is_never_a_spin_culprit() -> None:
    _, b = busy_of(probed({0: answer(EVAL, "alive", "evaluate (train.py:138)"),
                           1: answer(WAIT, "hung", "_engine_run_backward")}))
    assert b.state == "alive" and b.spin_culprits == ()


def test_a_waiting_suspicion_is_decided_as_a_hang_and_a_plain_warning_only_recorded() -> None:
    j = JobState(job="j", world_size=2, phase=JobPhase.RUNNING)
    for r in (0, 1):
        j.ranks[r] = RankState(rank=r, connected=True, step=40, last_step_at=0.0)
    suspect = Fault(FaultKind.HANG, "waiting in all_reduce", severity=Severity.WARNING,
                    evidence={"waiting_in_collective": True})
    (d,) = decide_fault(j, FaultReport(suspect, 1, 0), 100.0, PolicyConfig())
    assert d.verdict is Verdict.DUMP_STACKS
    alert = Fault(FaultKind.HANG, "--hang-action alert", severity=Severity.WARNING)
    (d,) = decide_fault(j, FaultReport(alert, 1, 0), 100.0, PolicyConfig())
    assert d.verdict is Verdict.ALERT_ONLY


def test_busy_travels_to_the_agent_bounded() -> None:
    b = JobBusy((0,), (1, 2), "spin (train.py:64)", "spinning", (0,))
    msg = convert.command_for(Decision(Verdict.BUSY, "job busy", 3, busy=b), "c1")
    a = command_to_action(pb.ArbiterMessage.FromString(msg.SerializeToString()).command)
    assert a is not None and a.kind is ActionKind.BUSY and a.busy == b and a.generation == 3
    hostile = pb.Command(id="c2", kind=pb.COMMAND_KIND_BUSY, busy=pb.JobBusy(
        busy_ranks=[-1, 5] + [1] * 1000, state="x\x1b[2J", where="w" * 10_000))
    a = command_to_action(hostile)
    assert a is not None and a.busy is not None
    assert a.busy.busy_ranks[0] == 5 and len(a.busy.busy_ranks) < 100
    assert a.busy.state == "" and len(a.busy.where) <= 200


def test_an_older_agent_ignores_busy() -> None:
    """An agent that does not know COMMAND_KIND_BUSY drops it (command_to_action: None for
    a kind it has no action for), as it drops any newer command."""
    cmd = pb.Command(id="c")
    cmd.kind = 99  # type: ignore[assignment]  # a kind from a newer arbiter
    assert command_to_action(cmd) is None


def test_the_registry_sends_busy_to_every_rank_and_status_shows_it_until_steps_resume(
) -> None:
    now = [1_000.0]
    reg = Registry(PolicyConfig(), Timeline(), None, "a", clock=lambda: now[0])
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}"))
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    for c in conns:
        reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
            step=40, ts=now[0], seconds_since_progress=0.0)), 0.0)
    now[0] += 8.0
    suspect = Fault(FaultKind.HANG, "waiting in _engine_run_backward for 7.2s",
                    severity=Severity.WARNING, evidence={"waiting_in_collective": True})
    reg.handle(conns[1], pb.AgentMessage(fault=fault_to_proto(suspect, 0)), 0.0)
    job = reg.jobs[("", "j")]
    assert job.hang_probe is not None
    cid = job.hang_probe.command_id  # the DUMP_STACKS' id: the answers echo it
    for r, (c, text, state) in enumerate([(conns[0], SPIN, "spinning"),
                                          (conns[1], WAIT, "hung")]):
        reg.handle(c, pb.AgentMessage(stacks=pb.Stacks(command_id=cid, json=answer(
            text, state, "spin (train.py:64)" if r == 0 else "_engine_run_backward"))), 0.0)
    told = []
    for c in conns:
        while not c.outbox.empty():
            item = c.outbox.get_nowait()
            assert isinstance(item, tuple)
            m = pb.ArbiterMessage.FromString(item[0])
            if m.WhichOneof("body") == "command" and m.command.kind == pb.COMMAND_KIND_BUSY:
                told.append(m.command)
    assert len(told) == 2 and all(list(t.busy.spin_culprits) == [0] for t in told)
    assert job.restarts == 0 and job.hang_probe is None
    info = reg.job_info(job, ranks=True)
    assert info.busy.startswith("job busy, not hung") and "rank 0 busy in spin" in info.busy
    assert "busy: job busy, not hung" in format_job(info)
    assert to_dict(info)["busy"] == info.busy
    reg.handle(conns[0], pb.AgentMessage(progress=pb.ProgressSummary(
        step=41, ts=now[0], seconds_since_progress=0.0)), 0.0)
    assert reg.job_info(job, ranks=False).busy == ""
