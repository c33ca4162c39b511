"""The recovery ladder's pod-level tiers against the fake API server (real HTTP, real
watches, a real Registry deciding): a rank that crashes again after its process restart
is restarted in its container (KEP-5307 rule, exit 216) where its pod carries the rule
the webhook adds and its node's kubelet has the gate; nothing is deleted or cordoned. The
same with the gate absent (the API server dropped the rule, or the kubelet is too old)
falls back to the process restart, saying why."""

from __future__ import annotations

import time
from typing import Any

from ftagent.arbiter.registry import Connection
from ftagent.kube.pod_tiers import add_rules
from ftagent.model import EXIT_RESTART_CONTAINER
from ftagent.v1 import ftagent_pb2 as pb
from tests.arbiter_helpers import wait_until
from tests.integration.test_kube_actions import NS, Setup, cluster, run
from tests.kube_fake import FakeKube


def ruled_spec() -> dict[str, Any]:
    """The rank pods' spec as the webhook leaves it (its restart rules on the trainer)."""
    c: dict[str, Any] = {"name": "trainer", "image": "trainer:latest",
                         "env": [{"name": "FTAGENT_JOB", "value": "llm"}]}
    assert add_rules(c, "Never") == ""
    return {"restartPolicy": "Never", "containers": [c]}


def crash(s: Setup, rank: int, i: int) -> None:
    job = s.reg.jobs[(NS, "llm")]
    f = pb.Fault(id=f"crash-{i}", kind=pb.FAULT_KIND_CRASH, message="exit 1",
                 generation=job.generation, exit_status=1)
    s.reg.handle(s.conns[rank], pb.AgentMessage(fault=f), time.monotonic())


def arrive(s: Setup, generation: int) -> None:
    for c in s.conns:
        s.reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=generation)),
                     time.monotonic())


async def crash_twice(s: Setup) -> list[pb.Command]:
    """Rank 2 crashes, every rank restarts (generation 1), rank 2 crashes again: the
    commands rank 2 got for the second decision."""
    job = s.reg.jobs[(NS, "llm")]
    crash(s, 2, 0)
    await wait_until(lambda: job.generation == 1, 20, "the first restart")
    assert [c.kind for c in s.commands(2)] == [pb.COMMAND_KIND_RESTART]
    arrive(s, 1)
    await wait_until(lambda: job.barrier is None or job.barrier.released, 20, "released")
    for r in range(4):
        s.commands(r)
    crash(s, 2, 1)
    await wait_until(lambda: job.generation == 2, 20, "the second decision")
    return s.commands(2)


def features(s: Setup, node: str, version: str, declared: list[str] | None) -> None:
    s.fake.set_node_features(node, kubelet_version=version, declared=declared)


def test_a_crash_the_process_restart_did_not_clear_restarts_the_container_in_place() -> None:
    async def body() -> None:
        async with cluster(pod_spec=ruled_spec()) as s:
            features(s, "node-2", "v1.36.1", ["RestartAllContainersOnContainerExits"])
            await wait_until(lambda: "declaredFeatures" in (s.cluster.node_cache.get(
                "node-2") or {}).get("status", {}), 20, "the node watch to see it")
            cmds = await crash_twice(s)
            assert [(c.kind, c.exit_code) for c in cmds] == [
                (pb.COMMAND_KIND_REPLACE, EXIT_RESTART_CONTAINER)]
            assert [c.kind for c in s.commands(0)] == [pb.COMMAND_KIND_RESTART]
            entries = s.reg.timeline.entries("llm", NS, 0)
            said = [e.message for e in entries if "restarts its container in place" in
                    e.message]
            assert said and "restart-process: did not clear it (1 in a row)" in said[0]
            time.sleep(0.3)  # noqa: ASYNC251 -- nothing may follow: give it a chance
            assert s.fake.count("delete", "pods") == 0  # the pod stays: in place
            assert not (s.fake.get("nodes", "node-2") or {}).get("spec", {}).get(
                "unschedulable")
            # the restarted container's new agent (same pod, a new process) rejoins: the
            # REPLACE its predecessor never acknowledged is not sent to it again
            s.reg.disconnect(s.conns[2])  # the old agent exited (216) before its ack went
            c = Connection("peer-2b")
            s.reg.hello(c, pb.Hello(job="llm", namespace=NS, rank=2, world_size=4,
                                    agent_instance="i2-restarted", pod="llm-worker-2",
                                    node="node-2"))
            sent = []
            while not c.outbox.empty():
                item = c.outbox.get_nowait()
                if isinstance(item, tuple):
                    m = pb.ArbiterMessage.FromString(item[0])
                    if m.WhichOneof("body") == "command":
                        sent.append(m.command.kind)
            assert pb.COMMAND_KIND_REPLACE not in sent, sent
    run(body)


def test_without_the_gate_the_ladder_falls_back_to_the_process_restart_and_says_why() -> None:
    def gates_off(fake: FakeKube) -> None:
        fake.set_feature_gates()  # an API server without ContainerRestartRules

    async def body() -> None:
        async with cluster(pod_spec=ruled_spec(), before=gates_off) as s:
            pod = s.fake.get("pods", "llm-worker-2", NS) or {}
            assert "restartPolicyRules" not in pod["spec"]["containers"][0]  # dropped
            cmds = await crash_twice(s)
            assert [c.kind for c in cmds] == [pb.COMMAND_KIND_RESTART]
            entries = s.reg.timeline.entries("llm", NS, 0)
            assert any("tier restart-process (restart-process: did not clear it" in e.message
                       and "the pod has no restart rule Restart for exit code 216"
                       in e.message for e in entries), [e.message for e in entries]
    run(body)


def test_an_old_kubelet_falls_back_though_the_pod_carries_the_rule() -> None:
    async def body() -> None:
        async with cluster(pod_spec=ruled_spec()) as s:
            features(s, "node-2", "v1.34.3", None)
            await wait_until(lambda: "nodeInfo" in (s.cluster.node_cache.get(
                "node-2") or {}).get("status", {}), 20, "the node watch to see it")
            cmds = await crash_twice(s)
            assert [c.kind for c in cmds] == [pb.COMMAND_KIND_RESTART]
            entries = s.reg.timeline.entries("llm", NS, 0)
            assert any("restart-container: needs Kubernetes 1.35 (ContainerRestartRules), "
                       "the node's kubelet runs 1.34" in e.message for e in entries)
    run(body)


def test_the_api_server_refuses_rules_without_a_restart_policy_and_unknown_actions() -> None:
    with FakeKube() as fake:
        bad = {"name": "t", "image": "x", "restartPolicyRules": [
            {"action": "Restart", "exitCodes": {"operator": "In", "values": [216]}}]}
        try:
            fake.add_pod(NS, "p", containers=[bad])
            raise AssertionError("accepted")
        except Exception as e:  # noqa: BLE001 -- the fake's 422
            assert "must specify restartPolicy when restartPolicyRules are used" in str(e)
        fake.set_feature_gates("ContainerRestartRules")  # 1.35: RestartAllContainers off
        c: dict[str, Any] = {"name": "t", "image": "x"}
        add_rules(c, "Never")
        try:
            fake.add_pod(NS, "q", containers=[c])
            raise AssertionError("accepted")
        except Exception as e:  # noqa: BLE001
            assert 'Unsupported value: "RestartAllContainers"' in str(e)
