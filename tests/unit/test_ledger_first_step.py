"""Issue 24, recomputed steps where the trainer does not say where it resumed: the ledger
takes the new generation's first step (F: step F - 1 was kept). The agent reads the
trainer's lines in batches and folds consecutive steps into the last (cmd/run.py,
latest_progress), so the first step it saw was the batch's last: 4 steps redone went
uncounted in the shape below. Its arbiter link now sends the batch's lowest step first."""

from __future__ import annotations

import pytest

from ftagent.agent.reporter import ArbiterLink
from ftagent.arbiter.history import History
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.config import ArbiterClientConfig, IdentityConfig
from ftagent.model import Fault, FaultKind, Progress
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import fault_to_proto


def link(rank: int) -> ArbiterLink:
    out = ArbiterLink(ArbiterClientConfig(arbiter="127.0.0.1:1"),
                      IdentityConfig(job="j", rank=rank))
    out.connected = True  # what it sends is read from its queue: no stream here
    out._up.set()  # the core posts while a stream is up
    return out


def sent(lk: ArbiterLink) -> list[int]:
    """Steps of the summaries it sends now: those queued, then the latest if due."""
    steps = [m.progress.step for m in lk._out if m.HasField("progress")]
    lk._out.clear()
    core = lk.proto  # the latest summary is the link's core's
    if core.progress_summary is not None and core.progress_new:
        steps.append(core.progress_summary.step)
        core.progress_new = False
    return steps


def batch(first: int, last: int) -> Progress:
    """Steps first..last read in one batch: one Progress, the earlier ones folded."""
    return Progress(step=last, loss=1.0, folded_losses=tuple(
        (s, 1.0) for s in range(first, last)))


def test_the_agent_sends_the_first_step_of_a_folded_batch_first() -> None:
    lk = link(0)
    lk.started(1, released=True)
    lk.report_progress(batch(41, 45), seconds_since_progress=0.0, hung=False)
    assert sent(lk) == [41, 45]
    lk.report_progress(batch(46, 50), seconds_since_progress=0.0, hung=False)
    assert sent(lk) == [50]  # later batches: the latest only, coalesced as before
    lk.started(2, released=True)
    lk.report_progress(Progress(step=41, loss=1.0), seconds_since_progress=0.0, hung=False)
    assert sent(lk) == [41]  # nothing folded: one summary


def test_the_ledger_counts_the_steps_a_folded_first_batch_hid() -> None:
    """Two ranks, steps 1..50 (1 s each), a crash at 50; the new generation's trainers
    resume from the checkpoint at step 40 without saying so, and the agents read steps
    41..45 in one batch: 10 steps redone (41..50), not 5."""
    clock = [1_000_000.0]
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a",
                   clock=lambda: clock[0], history=History())
    conns = [Connection(f"peer-{r}") for r in range(2)]
    links = [link(r) for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}"))
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    for step in range(1, 51):
        clock[0] += 1
        for c in conns:
            reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
                step=step, ts=clock[0], seconds_since_progress=0.0)), 0.0)
    f = fault_to_proto(Fault(FaultKind.CRASH, "boom", detected_at=clock[0]), 0, exit_status=1)
    reg.handle(conns[1], pb.AgentMessage(fault=f), 0.0)
    clock[0] += 2
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=1)), 0.0)
    clock[0] += 3
    for c, lk in zip(conns, links, strict=True):
        lk.started(1, released=True)
        lk.report_progress(batch(41, 45), seconds_since_progress=0.0, hung=False)
        for m in [*lk._out, pb.AgentMessage(progress=lk.proto.progress_summary)]:
            m.progress.ts = clock[0]
            reg.handle(c, m, 0.0)
    g = reg.job_info(reg.jobs[("", "j")], ranks=False).goodput
    (inc,) = g.per_incident
    assert (inc.reached_step, inc.resumed_step, inc.resume_source) == (50, 40, "first_step")
    assert g.recomputed_steps == 10
    assert g.seconds["recomputed"] == pytest.approx(10.0)  # step 40 (+40 s) -> crash (+50)
