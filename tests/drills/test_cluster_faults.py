"""Cluster faults through the fake Kubernetes API server, on a 2-node lab, one job.

The arbiter runs with ``--kube`` against tests/kube_fake (real HTTP, real watches, the real
``kubernetes`` client) where the job's pods and nodes are objects; the agents say which pod
and node they are (``--pod``, ``--node``), as the webhook's env does in a cluster.

1. node-1 goes NotReady (the kubelet stops posting status) while rank 1 there keeps
   stepping -> a blip: nothing replaced, the timeline says so; rank 1's pod then dies (its
   agent killed, as on a node really lost) while node-1 stays NotReady -> rank 1
   replaced: node-1 cordoned and tainted, its pod deleted, Events on the pod and
   the job; rank 1's agent exits with the replace status; the "controller" (the drill)
   creates the replacement pod on node-2 and starts its agent; the job trains again
2. rank 0's pod is preempted (DisruptionTarget, PreemptionByScheduler) -> rank 0 replaced
   without cordoning its node; its replacement pod's agent joins; training again

The arbiter leader killed with a follower waiting is drilled with two real arbiter
processes on one Lease of the fake API server in
tests/integration/test_leader_election.py::test_sigkill_the_leader_and_the_standby_decides_for_every_agent
(agents there are real ArbiterLinks, not trainers: a failover decides nothing for a healthy
job, and the lab's job would only show training going on, as drill 6 of
test_trainer_faults.py shows for a restarted arbiter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ftagent.kube.cluster import JOB_LABEL
from ftagent.model import EXIT_REPLACE
from tests.drills.conftest import (
    decisions,
    generation,
    require_lab,
    resumed,
    trained_past,
)
from tests.kube_fake import FakeKube
from tests.lab import Lab, line_of, wait

pytestmark = pytest.mark.timeout(600)

NS = "train"
OWNER = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "lab",
         "uid": "job-uid", "controller": True}
CKPT_EVERY = 10
AGENT = ["--hang-timeout-min", "5", "--max-restarts", "20", "--namespace", NS]
ENV = {"TRAIN_STEPS": "1000000", "CHECKPOINT_EVERY": str(CKPT_EVERY)}


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    require_lab()
    fake = FakeKube()
    try:
        for n in range(4):
            fake.add_node(f"node-{n}")
        for r in range(2):
            fake.add_pod(NS, f"lab-worker-{r}", labels={JOB_LABEL: "lab"}, node=f"node-{r}",
                         owner=OWNER)
        yield fake
    finally:
        fake.stop()


@pytest.fixture(scope="module")
def lab(kube: FakeKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    args = ["--kube", "--kube-api", kube.url, "--node-notready-grace", "1",
            "--max-restarts", "20"]
    with Lab(tmp_path_factory.mktemp("lab"), 2, arbiter_args=args) as lab:
        lab.start_job(ENV, AGENT)
        yield lab


def replaced_and_back(lab: Lab, kube: FakeKube, rank: int, pod: str, node: str,
                      n: int, killed: bool = False) -> dict[str, Any]:
    """The replace decision for ``rank`` (after ``n`` earlier ones); its agent's exit; the
    replacement pod on ``node`` with its agent; the job training again from the last
    checkpoint before the decision (the node's trouble does not stop training here: the
    lab's node is fine, only its Kubernetes object says otherwise). The decision."""
    wait(lambda: len(decisions(lab, "replace")) > n, 60, f"rank {rank} replaced", lab)
    before = max(lab.steps(0), lab.steps(1)) + 2
    replace = decisions(lab, "replace")[-1]
    assert f"rank {rank}" in replace["message"], line_of(replace)
    # (``killed``: its agent died with its node, so it heard no decision)
    assert lab.agents[rank].wait(60) == (-9 if killed else EXIT_REPLACE), lab.dump()
    # its agent gone, its log is whole: the step its trainer stopped at (the replace stops
    # every rank at one step and rank 0 checkpoints it). ``before`` may be a few steps short
    # of it: the log the test reads trails the trainer by the agent's output batching.
    stopped = lab.steps(rank)
    wait(lambda: (p := kube.get("pods", f"lab-worker-{rank}", NS)) is None
         or bool(p["metadata"].get("deletionTimestamp")), 30, "the old pod deleted", lab)
    kube.add_pod(NS, pod, labels={JOB_LABEL: "lab"}, node=node, owner=OWNER)
    gen = generation(lab) + 1
    lab.start_rank(rank, ["--pod", pod, "--node", node])
    wait(lambda: generation(lab) >= gen, 120, f"generation {gen} released", lab)
    wait(lambda: resumed(lab, rank) and resumed(lab, 1 - rank)
         and resumed(lab, 0)[-1] == resumed(lab, 1)[-1] and len(resumed(lab, 0)) >= gen,
         120, "both ranks resumed from one checkpoint", lab)
    step = resumed(lab, 0)[-1]
    assert before - CKPT_EVERY - 2 <= step <= max(before, stopped), (step, before, stopped)
    trained_past(lab, step + 5)
    return replace


def reasons(kube: FakeKube) -> set[str]:
    return {str(e["reason"]) for e in kube.events(NS)}


def test_1_node_not_ready_replaces_its_rank_cordons_and_the_new_pod_takes_over(
        lab: Lab, kube: FakeKube) -> None:
    lab.settled()
    trained_past(lab, CKPT_EVERY + 3, timeout=180)
    n = len(decisions(lab, "replace"))

    def fresh() -> bool:  # the arbiter heard rank 1's recent steps (summaries every 5 s)
        ranks = lab.status().get("ranks") or []
        return any(r.get("rank") == 1 and 0 <= r.get("progress_age_seconds", -1) < 5
                   and r.get("step", 0) > 0 for r in ranks)

    wait(fresh, 60, "the arbiter to know rank 1 steps", lab)
    kube.set_node_ready("node-1", "Unknown")
    # NotReady is not death: rank 1 keeps stepping there, so nothing is replaced
    wait(lambda: any("a blip, no replacement" in str(e["message"]) for e in lab.timeline()),
         60, "the NotReady blip noted", lab)
    at = lab.steps(1)
    trained_past(lab, at + 5)
    assert len(decisions(lab, "replace")) == n, lab.dump()
    # the node really lost: its pod dies with it (the agent and trainer killed) while the
    # node stays NotReady -> replaced as before
    lab.kill_agent(1)
    replace = replaced_and_back(lab, kube, 1, "lab-worker-1-b", "node-2", n, killed=True)
    assert "not Ready" in replace["message"] or any(
        "node node-1 not Ready" in str(e["message"]) for e in lab.timeline()), lab.dump()
    node = kube.get("nodes", "node-1") or {}
    assert node["spec"].get("unschedulable") is True, node
    assert any(t["key"] == "ftagent.io/fault" for t in node["spec"].get("taints") or []), node
    wait(lambda: {"FaultReplacePod", "NodeCordoned", "PodDeleted"} <= reasons(kube), 30,
         "the Events of the replacement", lab)
    on_job = [e for e in kube.events(NS) if e["involvedObject"]["kind"] == "PyTorchJob"]
    assert on_job and on_job[0]["involvedObject"]["name"] == "lab", kube.events(NS)


def test_2_preempted_pod_replaces_its_rank_without_cordoning_the_node(
        lab: Lab, kube: FakeKube) -> None:
    lab.settled()
    n = len(decisions(lab, "replace"))
    kube.set_pod_condition(NS, "lab-worker-0", "DisruptionTarget",
                           reason="PreemptionByScheduler", message="preempted by train/urgent")
    replaced_and_back(lab, kube, 0, "lab-worker-0-b", "node-3", n)
    assert any("preempted" in str(e["message"]) for e in lab.timeline()), lab.dump()
    node = kube.get("nodes", "node-0") or {}
    assert not node["spec"].get("unschedulable"), node
