"""Cluster faults: the registry's hooks for faults from outside the agents, and the pure
rules (kube/cluster_faults.py) that turn node and pod objects into those faults."""

from __future__ import annotations

from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import Decision, JobPhase, JobState, Verdict
from ftagent.arbiter.timeline import Timeline
from ftagent.model import Fault, FaultKind, Scope, Severity
from ftagent.v1 import ftagent_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def running_job(world: int = 4, per_node: int = 2, job: str = "j", namespace: str = "ns"
                ) -> tuple[Registry, list[Connection], Clock]:
    clock = Clock()
    reg = Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock)
    conns = [Connection(f"peer-{r}") for r in range(world)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job=job, namespace=namespace, rank=r, world_size=world,
                              agent_instance=f"i{r}", pod=f"{job}-{r}",
                              node=f"node-{r // per_node}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    assert reg.jobs[(namespace, job)].phase is JobPhase.RUNNING
    return reg, conns, clock


def commands(c: Connection) -> list[pb.Command]:
    out = []
    while not c.outbox.empty():
        item = c.outbox.get_nowait()
        if isinstance(item, tuple):
            m = pb.ArbiterMessage.FromString(item[0])
            if m.WhichOneof("body") == "command":
                out.append(m.command)
    return out


def test_report_fault_decides_like_an_agents_fault_and_tells_listeners() -> None:
    reg, conns, clock = running_job()
    for c in conns:
        commands(c)
    heard: list[tuple[str, Verdict, float]] = []

    def listener(job: JobState, d: Decision, now: float) -> None:
        heard.append((job.job, d.verdict, now))

    reg.add_decision_listener(listener)
    f = Fault(FaultKind.NODE, "node node-1 NotReady for 40s", Severity.FATAL, Scope.NODE,
              id="node-1-x")
    got = reg.report_fault("ns", "j", f, clock(), rank=2)
    assert [d.verdict for d in got] == [Verdict.REPLACE]
    job = reg.jobs[("ns", "j")]
    assert job.phase is JobPhase.RESTARTING and job.generation == 1
    assert heard == [("j", Verdict.REPLACE, clock())]
    kinds = [[cmd.kind for cmd in commands(c)] for c in conns]
    assert kinds[2] == [pb.COMMAND_KIND_REPLACE]
    assert all(k == [pb.COMMAND_KIND_RESTART] for i, k in enumerate(kinds) if i != 2)
    entries = reg.timeline.entries("j", "ns", 0)
    assert any(e.kind == "fault" and e.fault_id == "node-1-x" and "seen by the arbiter"
               in e.message for e in entries)
    assert reg.fault_kind(job, "node-1-x") == "node"
    # the same fault again is harmless: nothing decided twice, the budget spent once
    assert reg.report_fault("ns", "j", f, clock(), rank=2) == []
    assert job.restarts == 1


def test_report_fault_without_a_rank_restarts_the_job_and_unknown_jobs_are_ignored() -> None:
    reg, _, clock = running_job()
    f = Fault(FaultKind.NODE, "straggling", Severity.ERROR, Scope.JOB)
    assert [d.verdict for d in reg.report_fault("ns", "j", f, clock())] == [Verdict.RESTART]
    assert reg.report_fault("ns", "nope", Fault(FaultKind.NODE, "x"), clock(), rank=0) == []
    stale = Fault(FaultKind.NODE, "old", Severity.FATAL, Scope.NODE)
    assert [d.verdict for d in reg.report_fault("ns", "j", stale, clock(), rank=0,
                                                generation=0)] == [Verdict.IGNORE]


def test_ranks_on_node_and_rank_of_pod_follow_the_hellos() -> None:
    reg, conns, _ = running_job(world=4, per_node=2)
    assert [rs.rank for _, rs in reg.ranks_on_node("node-1")] == [2, 3]
    assert reg.ranks_on_node("node-9") == []
    got = reg.rank_of_pod("ns", "j-3")
    assert got is not None and got[1].rank == 3
    assert reg.rank_of_pod("other", "j-3") is None
    # rank 3 moves to another pod on another node: the old names no longer map to it
    reg.disconnect(conns[3])
    reg.hello(Connection(), pb.Hello(job="j", namespace="ns", rank=3, world_size=4,
                                     agent_instance="new", pod="j-3-b", node="node-7"))
    assert [rs.rank for _, rs in reg.ranks_on_node("node-1")] == [2]
    assert [rs.rank for _, rs in reg.ranks_on_node("node-7")] == [3]
    assert reg.rank_of_pod("ns", "j-3") is None
    assert reg.rank_of_pod("ns", "j-3-b") is not None


def test_a_failing_listener_never_stops_the_decision() -> None:
    reg, conns, clock = running_job()
    for c in conns:
        commands(c)

    def broken(job: JobState, d: Decision, now: float) -> None:
        raise RuntimeError("boom")

    reg.add_decision_listener(broken)
    f = Fault(FaultKind.CRASH, "exit 1", id="c1")
    assert [d.verdict for d in reg.report_fault("ns", "j", f, clock(), rank=0)] == \
        [Verdict.RESTART]
    assert all(commands(c) for c in conns)
