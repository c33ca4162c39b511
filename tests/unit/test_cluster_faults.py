"""Cluster faults: the registry's hooks for faults from outside the agents, and the pure
rules (kube/cluster_faults.py) that turn node and pod objects into those faults."""

from __future__ import annotations

from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import Decision, JobPhase, JobState, Verdict
from ftagent.arbiter.timeline import Timeline
from ftagent.kube.cluster_faults import NodeFaults, PodFaults, parse_time, pending_fault
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


# --------------------------------------------------------------------------- pure rules

T0 = "2024-05-01T10:00:00Z"
E0 = parse_time(T0) or 0.0


def node(name: str, status: str, since: str = T0, **extra: str) -> dict[str, object]:
    return {"metadata": {"name": name, "uid": f"u-{name}"},
            "status": {"conditions": [{"type": "MemoryPressure", "status": "False"},
                                      {"type": "Ready", "status": status,
                                       "lastTransitionTime": since, **extra}]}}


def test_a_node_not_ready_becomes_a_fault_only_past_the_grace_and_once() -> None:
    w = NodeFaults(grace=40.0)
    assert w.observe(node("n1", "Unknown", reason="NodeStatusUnknown"), E0 + 1) == []
    assert w.next_deadline() == E0 + 40
    assert w.due(E0 + 39.9) == []
    got = w.due(E0 + 40.0)
    assert len(got) == 1 and got[0].node == "n1"
    f = got[0].fault
    assert f.kind.value == "node" and f.severity.value == "fatal" and f.scope.value == "node"
    assert "not Ready (Ready=Unknown) for 40s" in f.message and "NodeStatusUnknown" in f.message
    assert w.due(E0 + 100) == [] and w.observe(node("n1", "Unknown"), E0 + 100) == []


def test_a_node_back_within_the_grace_is_no_fault_and_a_new_outage_counts_afresh() -> None:
    w = NodeFaults(grace=40.0)
    w.observe(node("n1", "False"), E0 + 1)
    w.observe(node("n1", "True", since="2024-05-01T10:00:30Z"), E0 + 30)
    assert w.due(E0 + 100) == [] and w.next_deadline() is None
    later = "2024-05-01T10:05:00Z"
    w.observe(node("n1", "False", since=later), E0 + 300)
    got = w.due(E0 + 340)
    assert len(got) == 1 and got[0].fault.id.endswith(later)


def test_an_old_outage_seen_at_start_is_a_fault_at_once_and_a_deleted_node_too() -> None:
    w = NodeFaults(grace=40.0)
    assert len(w.observe(node("n1", "False"), E0 + 600)) == 1  # NotReady for 10 min
    gone = w.observe(node("n2", "True"), E0, deleted=True)
    assert len(gone) == 1 and "deleted" in gone[0].fault.message
    assert w.observe(node("n2", "True"), E0, deleted=True) == []


def test_missing_and_odd_fields_are_not_faults_nor_errors() -> None:
    w = NodeFaults(grace=1.0)
    obj: object
    for obj in ({}, {"metadata": {}}, {"metadata": {"name": "x"}}, {"metadata": {"name": "x"},
                "status": {"conditions": "nope"}}, {"metadata": {"name": "x"}, "status": {
                "conditions": [None, {"type": "Ready", "status": "Maybe"}]}}, None, []):
        assert w.observe(obj, E0) == []
    # no transition time: counted from when it was first seen
    assert w.observe({"metadata": {"name": "y"}, "status": {"conditions": [
        {"type": "Ready", "status": "False", "lastTransitionTime": "garbage"}]}}, E0) == []
    assert len(w.due(E0 + 1)) == 1
    p = PodFaults()
    for obj in ({}, {"metadata": {"name": "p"}}, None, {"metadata": {"name": "p", "uid": 3}}):
        assert p.observe(obj) == []
    assert parse_time("2024-05-01T10:00:00.123456+02:00") == E0 - 7200 + 0.123456


def pod(name: str = "p0", uid: str = "u0", **status: object) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid},
            "spec": {"nodeName": "n1"}, "status": {"phase": "Running", **status}}


def test_preemption_eviction_and_deletion_are_pod_faults_once_per_pod() -> None:
    p = PodFaults()
    pre = pod(conditions=[{"type": "DisruptionTarget", "status": "True",
                           "reason": "PreemptionByScheduler", "message": "by ns/big"}])
    got = p.observe(pre)
    assert len(got) == 1 and got[0].pod == "p0" and got[0].node == "n1"
    f = got[0].fault
    assert f.scope.value == "pod" and f.severity.value == "error"
    assert "preempted by the scheduler" in f.message and "by ns/big" in f.message
    deleting = {**pre, "metadata": {**pre["metadata"], "deletionTimestamp": T0}}  # type: ignore
    assert p.observe(deleting) == [] and p.observe(deleting, deleted=True) == []
    ev = p.observe(pod("p1", "u1", phase="Failed", reason="Evicted",
                       message="The node was low on resource: memory."))
    assert len(ev) == 1 and "evicted by the kubelet: The node was low" in ev[0].fault.message
    gone = p.observe(pod("p2", "u2"), deleted=True)
    assert len(gone) == 1 and "deleted while its job runs" in gone[0].fault.message
    assert p.observe(pod("p3", "u3")) == []  # a running pod is no fault


def test_a_pod_ftagent_deleted_itself_is_no_fault() -> None:
    p = PodFaults()
    p.deleted_by_us("u9")
    assert p.observe(pod("p9", "u9"), deleted=True) == []


def test_a_replacement_pending_past_the_grace_is_a_warning_saying_why() -> None:
    once: set[str] = set()
    pending = pod("p0-new", "u5", phase="Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}])
    assert pending_fault(pending, 100.0, since=50.0, grace=60.0, once=once) is None
    got = pending_fault(pending, 110.0, since=50.0, grace=60.0, once=once)
    assert got is not None and got.fault.severity.value == "warning"
    assert "Pending 60s" in got.fault.message and "Insufficient nvidia.com/gpu" in \
        got.fault.message
    assert pending_fault(pending, 200.0, since=50.0, grace=60.0, once=once) is None


def test_a_replace_the_dead_pod_never_acknowledged_is_not_sent_to_its_successor() -> None:
    """A node dies with its pod: the REPLACE decided for that rank is never acknowledged.
    The controller's new pod (another name) registers the rank: it rejoins the job's
    generation, it is not replaced in turn (one pod per REPLACE)."""
    reg, conns, clock = running_job()
    for c in conns:
        commands(c)
    f = Fault(FaultKind.NODE, "node node-1 NotReady", Severity.FATAL, Scope.NODE, id="n1")
    reg.report_fault("ns", "j", f, clock(), rank=2)
    assert [c.kind for c in commands(conns[2])] == [pb.COMMAND_KIND_REPLACE]
    reg.disconnect(conns[2])  # the pod died with its node: no ack
    new = Connection("peer-2b")
    reg.hello(new, pb.Hello(job="j", namespace="ns", rank=2, world_size=4,
                            agent_instance="i2b", pod="j-2-b", node="node-5"))
    got = [c.kind for c in commands(new)]
    assert pb.COMMAND_KIND_REPLACE not in got, got
    # the same pod reconnecting (its agent's stream broke) still gets it
    reg2, conns2, clock2 = running_job()
    reg2.report_fault("ns", "j", f, clock2(), rank=2)
    commands(conns2[2])
    reg2.disconnect(conns2[2])
    again = Connection("peer-2c")
    reg2.hello(again, pb.Hello(job="j", namespace="ns", rank=2, world_size=4,
                               agent_instance="i2", pod="j-2", node="node-1"))
    assert pb.COMMAND_KIND_REPLACE in [c.kind for c in commands(again)]
