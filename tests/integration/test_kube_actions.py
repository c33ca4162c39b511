"""Cluster faults and actions: the real ``kubernetes`` client against the fake API server
(real HTTP, real watch streams), a real Registry deciding, simulated agent connections."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import JobPhase
from ftagent.arbiter.timeline import Timeline
from ftagent.kube.actuator import Actuator
from ftagent.kube.cluster import JOB_LABEL, Cluster, KubeSettings, start_watches, tick_forever
from ftagent.v1 import ftagent_pb2 as pb
from tests.arbiter_helpers import wait_until
from tests.kube_fake import FakeKube

NS = "train"
OWNER = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llm",
         "uid": "job-uid", "controller": True}


@dataclass
class Setup:
    fake: FakeKube
    reg: Registry
    cluster: Cluster
    conns: list[Connection]

    def events(self) -> list[dict[str, Any]]:
        got: Any = self.fake.events(NS)  # (FakeKube.list shadows the builtin for mypy)
        return list(got)

    def nodes(self) -> list[dict[str, Any]]:
        got: Any = self.fake.list("nodes")
        return list(got)

    def requests(self) -> list[Any]:
        got: Any = self.fake.requests
        return list(got)

    def commands(self, rank: int) -> list[pb.Command]:
        out = []
        c = self.conns[rank]
        while not c.outbox.empty():
            item = c.outbox.get_nowait()
            if isinstance(item, tuple):
                m = pb.ArbiterMessage.FromString(item[0])
                if m.WhichOneof("body") == "command":
                    out.append(m.command)
        return out


@asynccontextmanager
async def cluster(world: int = 4, per_node: int = 1, nodes: int = 8,
                  owner: dict[str, Any] = OWNER,
                  before: Callable[[FakeKube], None] | None = None,
                  pod_spec: dict[str, Any] | None = None,
                  **settings: Any) -> AsyncIterator[Setup]:
    """``owner``: the rank pods' controller; ``before``: objects to create first;
    ``pod_spec``: more of the rank pods' spec (their containers with resources)."""
    fake = FakeKube()
    if before is not None:
        before(fake)
    for n in range(nodes):
        fake.add_node(f"node-{n}")
    reg = Registry(PolicyConfig(max_restarts=5), Timeline(), None, "arb")
    conns = []
    for r in range(world):
        fake.add_pod(NS, f"llm-worker-{r}", labels={JOB_LABEL: "llm"},
                     node=f"node-{r // per_node}", owner=owner, **(pod_spec or {}))
        c = Connection(f"peer-{r}")
        reg.hello(c, pb.Hello(job="llm", namespace=NS, rank=r, world_size=world,
                              agent_instance=f"i{r}", pod=f"llm-worker-{r}",
                              node=f"node-{r // per_node}"))
        conns.append(c)
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    api = fake.client()
    cl = Cluster(reg, api, KubeSettings(**settings),
                 actuator=Actuator(api, backoff=0.01, max_backoff=0.05))
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    threads = start_watches(cl, api, loop, stop)
    ticker = asyncio.create_task(tick_forever(cl, 0.05))
    s = Setup(fake, reg, cl, conns)
    try:
        await wait_until(lambda: len(cl.pod_cache) == world and len(cl.node_names) == nodes,
                         20, "the watches to list pods and nodes")
        for r in range(world):
            s.commands(r)
        yield s
    finally:
        ticker.cancel()
        stop.set()
        fake.drop_watches()
        cl.close()
        for t in threads:
            t.join(10)
        fake.stop()


def run(coro: Callable[[], Any]) -> None:
    asyncio.run(coro())


def test_node_not_ready_past_the_grace_replaces_its_rank_cordons_taints_and_deletes() -> None:
    async def body() -> None:
        async with cluster(node_notready_grace=0.5) as s:
            s.fake.set_node_ready("node-2", "Unknown")
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: job.generation == 1, 20, "the node fault's decision")
            assert job.phase is JobPhase.RESTARTING
            kinds = {r: [c.kind for c in s.commands(r)] for r in range(4)}
            assert kinds[2] == [pb.COMMAND_KIND_REPLACE]
            assert all(kinds[r] == [pb.COMMAND_KIND_RESTART] for r in (0, 1, 3))

            def cordoned() -> bool:
                n = s.fake.get("nodes", "node-2") or {}
                return bool((n.get("spec") or {}).get("unschedulable"))

            await wait_until(cordoned, 20, "node-2 cordoned")
            n = s.fake.get("nodes", "node-2") or {}
            assert {"key": "ftagent.io/fault", "value": "node", "effect": "NoSchedule"}.items() \
                <= n["spec"]["taints"][0].items()
            notes = n["metadata"]["annotations"]
            assert notes["ftagent.io/fault-job"] == f"{NS}/llm" and "not Ready" in \
                notes["ftagent.io/fault"]
            await wait_until(lambda: (p := s.fake.get("pods", "llm-worker-2", NS)) is None or
                             bool(p["metadata"].get("deletionTimestamp")), 20, "pod deleted")
            # the deletion was ours: no second fault, the budget spent once
            await asyncio.sleep(0)  # noqa: ASYNC110 -- one loop turn for queued events
            assert job.restarts == 1
            entries = s.reg.timeline.entries("llm", NS, 0)
            assert any(e.kind == "fault" and "node node-2 not Ready" in e.message
                       for e in entries)

            def reasons() -> set[str]:
                return {e["reason"] for e in s.events()}

            await wait_until(lambda: {"FaultReplacePod", "NodeCordoned", "PodDeleted"}
                             <= reasons(), 20, "Events recorded")
            on_job = [e for e in s.events() if e["involvedObject"]["kind"] ==
                      "PyTorchJob"]
            assert on_job and on_job[0]["involvedObject"]["name"] == "llm"
    run(body)


def test_a_preempted_pod_replaces_its_rank_without_cordoning_its_node() -> None:
    async def body() -> None:
        async with cluster() as s:
            s.fake.set_pod_condition(NS, "llm-worker-1", "DisruptionTarget",
                                     reason="PreemptionByScheduler",
                                     message="preempted by train/urgent")
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: job.generation == 1, 20, "the preemption's decision")
            assert [c.kind for c in s.commands(0)] == [pb.COMMAND_KIND_RESTART]
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "pod deleted")
            assert s.fake.count("update", "nodes") == 0
            assert any("preempted by the scheduler" in e.message
                       for e in s.reg.timeline.entries("llm", NS, 0))
            # the controller's replacement waits for a node: the goodput ledger counts
            # that time as capacity, not decision, until the scheduler places it
            led = s.reg.stats[(NS, "llm")][1].ledger
            assert led is not None and led.mode.value == "decision"
            s.fake.add_pod(NS, "llm-worker-1-new", labels={JOB_LABEL: "llm"},
                           phase="Pending", owner=OWNER)
            await wait_until(lambda: led.mode.value == "capacity", 20, "capacity wait")
            s.fake.set_pod_condition(NS, "llm-worker-1-new", "PodScheduled")
            await wait_until(lambda: led.mode.value == "decision", 20, "scheduled")
            b = led.breakdown(s.reg.clock())
            assert b.seconds["capacity"] > 0
            assert sum(b.seconds.values()) == pytest.approx(b.wall)
    run(body)


def test_forbidden_is_one_log_line_and_the_decision_still_reaches_the_agents(
        caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with cluster(node_notready_grace=0.2, max_cordon_fraction=0.5) as s:
            s.cluster.on_action_failed = failed.append
            s.fake.forbid("update", "nodes")
            s.fake.forbid("delete", "pods")
            for node in ("node-1", "node-3"):
                s.fake.set_node_ready(node, "False")
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: job.generation >= 1, 20, "a decision")
            assert any(c.kind == pb.COMMAND_KIND_RESTART for c in s.commands(0))
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "delete tried")
            await wait_until(lambda: job.generation == 2, 20, "the second node's decision")
            await wait_until(lambda: s.fake.count("delete", "pods") >= 2, 20, "2nd delete")
            await wait_until(lambda: s.fake.count("update", "nodes") >= 2, 20, "2nd cordon")
            # what ftagent_arbiter_actions_failed_total{action} counts: each refused action
            await wait_until(lambda: sorted(failed) == ["cordon", "cordon", "delete_pod",
                                                        "delete_pod"], 20, "failures counted")

    failed: list[str] = []
    with caplog.at_level(logging.ERROR, logger="ftagent.kube.actuator"):
        run(body)
    lines = [r.getMessage() for r in caplog.records if "403 Forbidden" in r.getMessage()]
    assert len([x for x in lines if "update nodes" in x]) == 1
    assert len([x for x in lines if "delete pods" in x]) == 1
    assert any("lacks RBAC permission 'update' on 'nodes'" in x for x in lines)


def test_a_conflict_is_retried_with_the_fresh_node_and_a_500_with_backoff() -> None:
    async def body() -> None:
        async with cluster() as s:
            s.fake.fail("update", "nodes", code=409, times=1)
            s.fake.fail("get", "nodes", code=500, times=2)
            s.fake.set_pod_phase(NS, "llm-worker-0", "Failed", reason="Evicted",
                                 message="The node was low on resource: memory.")
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "delete")
            assert s.fake.count("update", "nodes") == 0  # kubelet eviction: no cordon
            # a GPU fault from the agent, which the node agent confirms: REPLACE, cordon
            # through one 409 and two 500s
            s.cluster.node_reported("node-3", ["node-agent-xid"], {"gpu"})
            f = pb.Fault(id="gpu-1", kind=pb.FAULT_KIND_GPU, severity=pb.SEVERITY_FATAL,
                         scope=pb.SCOPE_NODE, message="Xid 79: fallen off the bus",
                         generation=1)
            s.reg.handle(s.conns[3], pb.AgentMessage(fault=f), time.monotonic())
            await wait_until(lambda: bool(((s.fake.get("nodes", "node-3") or {}).get("spec")
                                           or {}).get("unschedulable")), 20, "cordon")
            n = s.fake.get("nodes", "node-3") or {}
            assert n["spec"]["taints"][0]["value"] == "gpu"
            assert s.fake.count("update", "nodes") == 2
    run(body)


def test_the_circuit_breaker_stops_a_rule_that_blames_every_node() -> None:
    async def body() -> None:
        async with cluster(world=8, nodes=8, max_cordon_fraction=0.25) as s:
            skips: list[None] = []
            s.cluster.on_cordon_skipped = lambda: skips.append(None)
            for r in range(8):  # a bad rule: every node's GPU is "fatal" (node agents too)
                s.cluster.node_reported(f"node-{r}", [f"node-bad-{r}"], {"gpu"})
                job = s.reg.jobs[(NS, "llm")]
                f = pb.Fault(id=f"bad-{r}", kind=pb.FAULT_KIND_GPU, scope=pb.SCOPE_NODE,
                             severity=pb.SEVERITY_FATAL, message="bogus",
                             generation=job.generation)
                s.reg.handle(s.conns[r], pb.AgentMessage(fault=f), time.monotonic())
            await wait_until(lambda: s.fake.count("delete", "pods") >= 5, 20, "deletes")
            cordoned = [n["metadata"]["name"] for n in s.nodes()
                        if (n.get("spec") or {}).get("unschedulable")]
            assert len(cordoned) == 2
            skipped = [e for e in s.reg.timeline.entries("llm", NS, 0)
                       if "not cordoned: circuit breaker" in e.message]
            assert len(skipped) == 3  # budget 5: five REPLACEs, two cordons
            assert len(skips) == 3  # ftagent_arbiter_cordons_skipped_total
    run(body)


def test_events_aggregate_into_one_series_whose_count_grows() -> None:
    async def body() -> None:
        async with cluster() as s:
            for i in range(3):
                job = s.reg.jobs[(NS, "llm")]
                f = pb.Fault(id=f"crash-{i}", kind=pb.FAULT_KIND_CRASH, message="exit 1",
                             generation=job.generation, exit_status=1)
                s.reg.handle(s.conns[1], pb.AgentMessage(fault=f), time.monotonic())

            def series() -> list[dict[str, Any]]:
                return [e for e in s.events() if e["reason"] == "FaultRestart"]

            def counts(kind: str) -> list[Any]:
                return [e.get("count") for e in series() if e["involvedObject"]["kind"] == kind]

            # the Pod's and the job's series are written by separate calls: wait for both
            await wait_until(lambda: counts("Pod") == [3] and counts("PyTorchJob") == [3], 20,
                             "one Pod series and one PyTorchJob series, each with count 3")
            assert s.fake.count("create", "events") == 2
    run(body)


def test_a_restarts_event_names_its_culprit_as_annotations_on_its_pod_and_job() -> None:
    """Issue 35: the culprit as data on the Kubernetes Event too (the same ranks as its
    message), on the culprit's pod and the job object; a later occurrence of the series
    that blames another rank replaces them."""
    async def body() -> None:
        async with cluster(per_node=2) as s:
            def crash(rank: int, i: int) -> None:
                job = s.reg.jobs[(NS, "llm")]
                f = pb.Fault(id=f"crash-{i}", kind=pb.FAULT_KIND_CRASH, message="exit 1",
                             generation=job.generation, exit_status=1)
                s.reg.handle(s.conns[rank], pb.AgentMessage(fault=f), time.monotonic())

            def notes(kind: str) -> list[dict[str, str]]:
                return [e["metadata"].get("annotations", {}) for e in s.events()
                        if e["reason"] == "FaultRestart"
                        and e["involvedObject"]["kind"] == kind]

            crash(3, 0)
            want = {"ftagent.io/culprit-ranks": "3", "ftagent.io/culprit-pods": "llm-worker-3",
                    "ftagent.io/culprit-nodes": "node-1"}
            await wait_until(lambda: notes("Pod") == [want] and notes("PyTorchJob") == [want],
                             20, "the culprit's annotations on its pod's and job's Event")
            (ev,) = [e for e in s.events() if e["reason"] == "FaultRestart"
                     and e["involvedObject"]["kind"] == "Pod"]
            assert ev["involvedObject"]["name"] == "llm-worker-3"
            assert "; culprit ranks 3 (pod llm-worker-3, node node-1); " in ev["message"]
            crash(0, 1)
            later = {"ftagent.io/culprit-ranks": "0", "ftagent.io/culprit-pods": "llm-worker-0",
                     "ftagent.io/culprit-nodes": "node-0"}
            await wait_until(lambda: later in notes("Pod") and notes("PyTorchJob") == [later],
                             20, "the job's series annotated with the later culprit")
    run(body)


def test_a_pod_stuck_terminating_is_force_deleted_past_the_limit() -> None:
    async def body() -> None:
        async with cluster(force_delete_after=0.3) as s:
            s.fake.delete("pods", "llm-worker-3", NS, grace=30)  # someone deletes it
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: job.generation == 1, 20, "the deletion's decision")

            def forced() -> bool:
                return any(r.verb == "delete" and r.resource == "pods" and
                           r.query.get("gracePeriodSeconds") == "0"
                           for r in s.requests())

            await wait_until(forced, 20, "force delete")
            await wait_until(lambda: s.fake.get("pods", "llm-worker-3", NS) is None, 20,
                             "the pod gone")
    run(body)


def test_a_new_term_as_leader_rebinds_the_cluster_and_a_standby_does_not_tick() -> None:
    """--leader-elect swaps the registry at each term: the node fault goes to the new
    one (whose agents get the commands); while not leading the ticks do nothing."""
    async def body() -> None:
        async with cluster(node_notready_grace=0.5) as s:
            leading = [False]
            s.cluster.active = lambda: leading[0]
            old = s.reg
            new = Registry(PolicyConfig(max_restarts=5), Timeline(), None, "arb-2")
            conns = []
            for r in range(4):
                c = Connection(f"peer2-{r}")
                new.hello(c, pb.Hello(job="llm", namespace=NS, rank=r, world_size=4,
                                      agent_instance=f"j{r}", pod=f"llm-worker-{r}",
                                      node=f"node-{r}"))
                new.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
                conns.append(c)
            s.cluster.rebind(new)  # a standby's (here: already populated) registry
            s.fake.set_node_ready("node-1", "False")
            await wait_until(lambda: get_ready(s.cluster.node_cache["node-1"]) == "False", 20,
                             "the standby's watch to see the node NotReady")
            t0 = time.monotonic()  # past the grace, but a standby reports and ticks nothing
            await wait_until(lambda: time.monotonic() - t0 > 1.0, 5, "a second past the grace")
            assert new.jobs[(NS, "llm")].generation == 0
            leading[0] = True
            s.cluster.rebind(new)  # the term as leader begins: the nodes judged afresh
            await wait_until(lambda: new.jobs[(NS, "llm")].generation == 1, 20,
                             "the new registry's decision")
            assert old.jobs[(NS, "llm")].generation == 0  # the old term decides nothing

    run(body)


def get_ready(node: dict[str, Any]) -> str:
    return next((c.get("status", "") for c in node.get("status", {}).get("conditions", [])
                 if c.get("type") == "Ready"), "")


def test_a_cordon_made_is_counted_by_node_and_kind() -> None:
    async def body() -> None:
        async with cluster(node_notready_grace=0.5) as s:
            seen: list[tuple[str, str]] = []
            s.cluster.on_cordon = lambda node, kind: seen.append((node, kind))
            s.fake.set_node_ready("node-3", "Unknown")
            await wait_until(lambda: len(seen) > 0, 20, "the cordon to be counted")
            assert seen == [("node-3", "node")]

    run(body)


def test_a_pod_of_a_trainjob_finds_it_through_its_job_and_jobset() -> None:
    """Trainer v2: pod -> batch Job -> JobSet -> TrainJob, read through the API (get on
    jobs and jobsets): the job-level Events land on the TrainJob users look at."""
    async def body() -> None:
        async with cluster() as s:
            def ref(api: str, kind: str, name: str) -> dict[str, Any]:
                return {"apiVersion": api, "kind": kind, "name": name, "uid": f"{name}-uid",
                        "controller": True}

            s.fake.create("trainjobs.trainer.kubeflow.org", {
                "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                "metadata": {"name": "tj", "namespace": NS}})
            s.fake.create("jobsets.jobset.x-k8s.io", {
                "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                "metadata": {"name": "tj", "namespace": NS, "ownerReferences": [
                    ref("trainer.kubeflow.org/v1alpha1", "TrainJob", "tj")]}})
            s.fake.create("jobs.batch", {
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": "tj-node-0", "namespace": NS, "ownerReferences": [
                    ref("jobset.x-k8s.io/v1alpha2", "JobSet", "tj")]}})
            pod = {"metadata": {"name": "tj-node-0-0", "namespace": NS, "uid": "pod-uid",
                                "ownerReferences": [ref("batch/v1", "Job", "tj-node-0")]}}
            first = s.cluster._owner(pod)
            assert first is not None and first.kind == "Job"  # stands in until read
            await wait_until(lambda: getattr(s.cluster._owners.get("pod-uid"), "kind", "")
                             == "TrainJob", 20, "the owner climb")
            assert s.cluster._owner(pod).name == "tj"  # type: ignore[union-attr]

    run(body)


def _ref(api: str, kind: str, name: str) -> dict[str, Any]:
    return {"apiVersion": api, "kind": kind, "name": name, "uid": f"{name}-uid",
            "controller": True}


def _trainjob_chain(fake: FakeKube) -> None:
    """TrainJob tj -> JobSet tj -> batch Job tj-node-0 (the rank pods' controller)."""
    fake.create("trainjobs.trainer.kubeflow.org", {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": "tj", "namespace": NS}})
    fake.create("jobsets.jobset.x-k8s.io", {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "tj", "namespace": NS, "ownerReferences": [
            _ref("trainer.kubeflow.org/v1alpha1", "TrainJob", "tj")]}})
    fake.create("jobs.batch", {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "tj-node-0", "namespace": NS, "ownerReferences": [
            _ref("jobset.x-k8s.io/v1alpha2", "JobSet", "tj")]}})


def test_a_trainjob_shows_the_jobs_progress_and_goodput_in_its_trainer_status() -> None:
    """Kubeflow Trainer v2 (KEP-2779): status.trainerStatus of the rank pods' TrainJob
    carries step, loss, goodput and restarts, merge-patched on its status subresource."""
    async def body() -> None:
        async with cluster(world=2, owner=_ref("batch/v1", "Job", "tj-node-0"),
                           before=_trainjob_chain, trainjob_status_interval=0.2) as s:
            for c in s.conns:
                s.reg.handle(c, pb.AgentMessage(progress=pb.ProgressSummary(
                    step=42, loss=0.5, ts=time.time())), 0.0)

            def trainer_status() -> dict[str, Any]:
                tj = s.fake.get("trainjobs.trainer.kubeflow.org", "tj", NS) or {}
                return dict((tj.get("status") or {}).get("trainerStatus") or {})

            await wait_until(lambda: any(m["name"] == "step" and m["value"] == "42"
                                         for m in trainer_status().get("metrics", [])),
                             20, "the TrainJob's trainerStatus")
            got = {m["name"]: m["value"] for m in trainer_status()["metrics"]}
            assert got["loss"] == "0.5" and got["restarts"] == "0"
            assert 0.0 <= float(got["goodput"]) <= 1.0
            assert trainer_status()["lastUpdatedTime"].endswith("Z")
            assert s.cluster.trainjobs.off == ""
            assert any(q.verb == "patch" and q.resource ==
                       "trainjobs.trainer.kubeflow.org/status" for q in s.requests())

    run(body)


def test_without_the_trainjob_crd_or_its_field_nothing_is_written_and_it_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The writer alone against the fake: a 404 for the resource (no CRD) or an answer
    without trainerStatus (a CRD without the field: pruned) stops it, logged once; a 404
    for one deleted TrainJob stops only that one; RBAC's 403 stops it too."""
    from ftagent.kube.trainjob_status import TrainJobStatus, trainer_status

    status = trainer_status(7, None, 0.9, 1, 0.0)
    assert status["metrics"] == [{"name": "step", "value": "7"},
                                 {"name": "goodput", "value": "0.9000"},
                                 {"name": "restarts", "value": "1"}]
    fake = FakeKube()
    try:
        _trainjob_chain(fake)
        w = TrainJobStatus(fake.client(), interval=10.0)
        assert w.due(NS, "tj", 100.0) and not w.due(NS, "tj", 105.0)
        w.write(NS, "tj", status)
        assert w.written == 1 and w.off == ""
        w.write(NS, "gone", status)  # deleted: that one only
        assert w.off == "" and not w.due(NS, "gone", 200.0) and w.due(NS, "tj", 200.0)
        fake.prune_status("trainjobs.trainer.kubeflow.org", "trainerStatus")
        fake.create("trainjobs.trainer.kubeflow.org", {
            "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": "old", "namespace": NS}})
        with caplog.at_level(logging.INFO, "ftagent.kube.trainjob"):
            w.write(NS, "old", status)
            w.write(NS, "old", status)
        assert "no status.trainerStatus" in w.off and not w.due(NS, "tj", 300.0)
        assert len([r for r in caplog.records if "not written" in r.message]) == 1
        fake.remove_resource("trainjobs.trainer.kubeflow.org")
        w2 = TrainJobStatus(fake.client())
        w2.write(NS, "tj", status)
        assert "not installed" in w2.off
        fake2 = FakeKube()
        try:
            _trainjob_chain(fake2)
            fake2.forbid("patch", "trainjobs.trainer.kubeflow.org/status")
            w3 = TrainJobStatus(fake2.client())
            w3.write(NS, "tj", status)
            assert "RBAC" in w3.off
        finally:
            fake2.stop()
    finally:
        fake.stop()
