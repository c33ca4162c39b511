"""The arbiter's side of ReportNode, pure: which jobs a node fault reaches, and once."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from ftagent.arbiter.intake import holds_gpu
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import Verdict
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def registry(clock: Clock) -> Registry:
    return Registry(PolicyConfig(max_restarts=5), Timeline(), None, "arb-1", clock=clock)


def hello(reg: Registry, job: str, rank: int, world: int, node: str,
          gpus: Sequence[str] = ()) -> Connection:
    conn = Connection(f"peer-{job}-{rank}")
    reg.hello(conn, pb.Hello(job=job, rank=rank, world_size=world, node=node, pod=f"{job}-{rank}",
                             agent_instance=f"{job}-{rank}", gpus=gpus))
    return conn


def fault(fid: str, detected_at: float, kind: pb.FaultKind = pb.FAULT_KIND_GPU,
          evidence: dict[str, object] | None = None) -> pb.Fault:
    return pb.Fault(id=fid, kind=kind, severity=pb.SEVERITY_FATAL, scope=pb.SCOPE_NODE,
                    message="GPU 0: Xid 79", detected_at=detected_at,
                    evidence_json=json.dumps(evidence) if evidence else "")


U = ["GPU-6f3a1c2e-88d1-4f3e-9a2b-1c2d3e4f5a6b", "GPU-0b1c2d3e-4f5a-6b7c-8d9e-0f1a2b3c4d5e"]


def test_a_gpu_fault_reaches_only_the_jobs_whose_pods_hold_that_gpu() -> None:
    """Six one-GPU pods of five jobs on one node: an Xid 79 on GPU 1 replaces the pods
    that hold GPU 1 (by UUID or by index) and leaves the jobs on GPU 0 running; a job whose
    pod says nothing of its GPUs is decided as before (it may hold the GPU)."""
    clock = Clock()
    reg = registry(clock)
    hello(reg, "a", 0, 2, "n1", gpus=[U[0]])
    hello(reg, "a", 1, 2, "n1", gpus=[U[1].upper()])
    hello(reg, "b", 0, 1, "n1", gpus=[U[0]])
    hello(reg, "c", 0, 1, "n1")  # GPUs unknown
    hello(reg, "d", 0, 1, "n1", gpus=["0"])  # indices (deviceIDStrategy=index)
    hello(reg, "e", 0, 1, "n1", gpus=["1"])
    xid = fault("x", 999.0, evidence={"gpu": 1, "uuid": U[1], "xid": 79})
    ack = reg.node_report(pb.NodeReport(node="n1", faults=[xid]))
    assert ack.acks[0].outcome == ("a rank 1: replace; c rank 0: replace; e rank 0: replace; "
                                   "b, d: not on that GPU"), ack.acks[0].outcome
    gens = {j: reg.jobs[("", j)].generation for j in "abcde"}
    assert gens == {"a": 1, "b": 0, "c": 1, "d": 0, "e": 1}
    replaced = [e for e in reg.timeline.entries("a", "", 0) if e.kind == "decision"][-1]
    assert replaced.rank == 1, replaced


@pytest.mark.parametrize(("gpus", "evidence", "held"), [
    ([U[0]], {"gpu": 0, "uuid": U[0]}, True),
    ([U[0]], {"gpu": 0, "uuid": U[0].upper()}, True),
    ([U[0]], {"gpu": 1, "uuid": U[1]}, False),
    (U, {"gpu": 1, "uuid": U[1]}, True),
    (["0", "1"], {"gpu": 1, "uuid": U[1]}, True),
    (["0"], {"gpu": 1, "uuid": U[1]}, False),
    ([], {"gpu": 1, "uuid": U[1]}, None),  # the pod did not say
    ([U[0]], {"gpu": -1, "uuid": ""}, None),  # an NVSwitch: every GPU
    ([U[0]], {"gpu": 1, "uuid": ""}, None),  # a UUID to compare with no UUID
    (["MIG-5c2a9c1e-7d4b-5e8f-a1b2-c3d4e5f6a7b8"], {"gpu": 1, "uuid": U[1]}, None),
    ([U[0]], {}, None),
    ([U[0]], {"gpu": "1", "uuid": U[1]}, None),
])
def test_holds_gpu(gpus: list[str], evidence: dict[str, object], held: bool | None) -> None:
    assert holds_gpu(gpus, evidence) is held


def test_one_decision_per_job_about_its_lowest_rank_on_the_node() -> None:
    clock = Clock()
    reg = registry(clock)
    for r, node in enumerate(["n1", "n1", "n2"]):
        hello(reg, "a", r, 3, node)
    hello(reg, "b", 0, 1, "n1")
    hello(reg, "c", 0, 1, "n3")
    ack = reg.node_report(pb.NodeReport(node="n1", faults=[fault("x", 999.0)]))
    assert ack.ranks == 3 and ack.arbiter_id == "arb-1"
    assert ack.acks[0].final and ack.acks[0].outcome == "a rank 0: replace; b rank 0: replace"
    a, b, c = (reg.jobs[("", j)] for j in "abc")
    assert (a.generation, a.restarts, b.generation, c.generation) == (1, 1, 1, 0)
    again = reg.node_report(pb.NodeReport(node="n1", faults=[fault("x", 999.0)]))
    assert again.acks[0].outcome == "a rank 0: already received; b rank 0: already received"
    assert (a.generation, a.restarts) == (1, 1), "a repeated report spends nothing"


def test_a_fault_the_job_already_restarted_for_is_ignored() -> None:
    """The pod agent reported the same Xid first: its job is at a new generation, opened
    after the node saw the fault, so the node's report must not restart it again."""
    clock = Clock()
    reg = registry(clock)
    conn = hello(reg, "a", 0, 1, "n1")
    reg.handle(conn, pb.AgentMessage(fault=fault("pod-says", 1000.0)), 0.0)  # from the pod
    job = reg.jobs[("", "a")]
    assert job.generation == 1
    clock.t = 1001.0
    late = reg.node_report(pb.NodeReport(node="n1", faults=[fault("node-says", 999.9)]))
    assert late.acks[0].outcome == "a rank 0: ignore"
    assert (job.generation, job.restarts) == (1, 1)
    fresh = reg.node_report(pb.NodeReport(node="n1", faults=[fault("later", 1000.9)]))
    assert fresh.acks[0].outcome == "a rank 0: replace", "a fault after the restart counts"
    assert job.generation == 2


def test_node_without_jobs_is_recorded_and_a_nic_outage_waits_then_restarts() -> None:
    clock = Clock()
    reg = registry(clock)
    none = reg.node_report(pb.NodeReport(node="empty", faults=[fault("x", 1.0)]))
    assert none.ranks == 0 and none.acks[0].final
    assert none.acks[0].outcome == "no job has ranks on node empty: recorded"
    hello(reg, "a", 0, 2, "n1")
    hello(reg, "a", 1, 2, "n2")
    down = pb.Fault(id="down", kind=pb.FAULT_KIND_NIC, severity=pb.SEVERITY_ERROR,
                    scope=pb.SCOPE_NODE, message="link eth0 lost carrier",
                    evidence_json='{"device": "eth0", "reason": "carrier_lost"}',
                    detected_at=1000.0)
    up = pb.Fault(id="up", kind=pb.FAULT_KIND_NIC, severity=pb.SEVERITY_INFO,
                  scope=pb.SCOPE_NODE, message="link eth0 is up again",
                  evidence_json='{"device": "eth0", "recovered": true, "outage_seconds": 3}',
                  detected_at=1003.0)
    got = reg.node_report(pb.NodeReport(node="n2", faults=[down]))
    assert got.acks[0].outcome == "a rank 1: wait"
    job = reg.jobs[("", "a")]
    assert 1 in job.nic_outages and job.generation == 0
    got = reg.node_report(pb.NodeReport(node="n2", faults=[up]))
    # the job may resume by itself (its steps advance): 3 s outage + 5 s to show it
    assert got.acks[0].outcome == "a rank 1: link_back" and job.generation == 0
    clock.t += 8.5  # no rank stepped
    reg.tick()
    assert job.generation == 1
    last = [e for e in reg.timeline.entries("a", "", 0) if e.kind == "decision"][-1]
    assert last.action == Verdict.RESTART.value and "link back" in last.message


def test_a_fault_without_a_known_kind_is_acknowledged_as_ignored() -> None:
    reg = registry(Clock())
    hello(reg, "a", 0, 1, "n1")
    ack = reg.node_report(pb.NodeReport(node="n1", faults=[
        pb.Fault(id="odd", kind=99, detected_at=1.0)]))  # type: ignore[arg-type]
    assert ack.acks[0].final and ack.acks[0].outcome.startswith("ignored: ")
    assert reg.jobs[("", "a")].generation == 0
