"""No cluster action on self-asserted facts (issue 20, "What to build" 2): the real
``kubernetes`` client against the fake API server, a real Registry and Cluster. On the code
before, a Hello naming a pod that is no rank of the job (``coredns-abc``, another job's) on
node-7 and one GPU fault got that pod deleted (no uid precondition) and node-7 cordoned;
a pod's GPU fault alone cordoned its node; the breaker's count lived in memory only."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

from ftagent.arbiter.registry import Connection
from ftagent.kube.cluster import JOB_LABEL, Cluster, KubeSettings
from ftagent.v1 import ftagent_pb2 as pb
from tests.arbiter_helpers import wait_until
from tests.integration.test_kube_actions import NS, Setup, cluster, run


def gpu_fault(s: Setup, conn: Connection, fid: str, job: str = "llm") -> None:
    g = s.reg.jobs[(NS, job)].generation
    f = pb.Fault(id=fid, kind=pb.FAULT_KIND_GPU, severity=pb.SEVERITY_FATAL,
                 scope=pb.SCOPE_NODE, message="Xid 79: fallen off the bus", generation=g)
    s.reg.handle(conn, pb.AgentMessage(fault=f), time.monotonic())


def unschedulable(s: Setup, node: str) -> bool:
    n: Any = s.fake.get("nodes", node) or {}
    return bool((n.get("spec") or {}).get("unschedulable"))


def deleted(s: Setup, ns: str, pod: str) -> bool:
    p: Any = s.fake.get("pods", pod, ns)
    return p is None or bool(p["metadata"].get("deletionTimestamp"))


def test_a_pods_own_gpu_fault_replaces_it_and_leaves_its_node_schedulable() -> None:
    async def body() -> None:
        async with cluster() as s:
            uid = (s.fake.get("pods", "llm-worker-3", NS) or {})["metadata"]["uid"]
            gpu_fault(s, s.conns[3], "gpu-alone")
            await wait_until(lambda: deleted(s, NS, "llm-worker-3"), 20, "pod deleted")
            delete = [r for r in s.requests() if r.verb == "delete" and r.resource == "pods"]
            assert delete[0].body["preconditions"] == {"uid": uid}
            await wait_until(lambda: "NodeNotCordoned" in {e["reason"] for e in s.events()},
                             20, "the Event saying why")
            assert s.fake.count("update", "nodes") == 0 and not unschedulable(s, "node-3")
            why = next(e for e in s.events() if e["reason"] == "NodeNotCordoned")
            assert "alone" in why["message"] and "node-3" in why["message"]
    run(body)


def test_a_hello_naming_another_pod_and_node_deletes_and_cordons_nothing_of_theirs() -> None:
    async def body() -> None:
        async with cluster() as s:
            s.fake.add_pod(NS, "coredns-abc", node="node-7")  # no ftagent pod
            s.fake.add_pod(NS, "other-0", labels={JOB_LABEL: "other"}, node="node-6")
            await wait_until(lambda: len(s.cluster.pod_cache) == 5, 20, "pods watched")
            for pod, node, fid in (("coredns-abc", "node-7", "x1"), ("other-0", "node-6", "x2")):
                liar = Connection("liar")
                s.reg.hello(liar, pb.Hello(job="llm", namespace=NS, rank=2, world_size=4,
                                           agent_instance="i2", pod=pod, node=node))
                gpu_fault(s, liar, fid)
            await wait_until(lambda: s.reg.jobs[(NS, "llm")].restarts >= 2, 20, "decisions")
            s.cluster.close(wait=True)  # every submitted action has run
            assert not deleted(s, NS, "coredns-abc")
            assert not deleted(s, NS, "other-0")
            assert s.fake.count("delete", "pods") == 0
            assert s.fake.count("update", "nodes") == 0
    run(body)


def test_one_tenant_with_two_jobs_on_a_node_cannot_cordon_it() -> None:
    """On the code before, two labelled pods of two "jobs" of one tenant on one node met
    the "two different jobs" rule: the node was cordoned and tainted."""
    async def body() -> None:
        async with cluster() as s:
            s.fake.add_pod(NS, "vision-0", labels={JOB_LABEL: "vision"}, node="node-1",
                           serviceAccountName="other-sa")
            await wait_until(lambda: len(s.cluster.pod_cache) == 5, 20, "pod watched")
            other = Connection("vision")
            s.reg.hello(other, pb.Hello(job="vision", namespace=NS, rank=0, world_size=1,
                                        agent_instance="v0", pod="vision-0", node="node-1"))
            gpu_fault(s, s.conns[1], "llm-gpu")
            gpu_fault(s, other, "vision-gpu", job="vision")
            await wait_until(lambda: deleted(s, NS, "llm-worker-1") and
                             deleted(s, NS, "vision-0"), 20, "both pods deleted")
            s.cluster.close(wait=True)
            assert not unschedulable(s, "node-1") and s.fake.count("update", "nodes") == 0
            why = [e["message"] for e in s.events() if e["reason"] == "NodeNotCordoned"]
            assert any(f"namespace {NS} alone" in m for m in why)
    run(body)


def test_the_same_gpu_fault_from_two_namespaces_and_accounts_on_a_node_cordons_it() -> None:
    async def body() -> None:
        async with cluster() as s:
            s.fake.add_pod("vision", "vision-0", labels={JOB_LABEL: "vision"},
                           node="node-1", serviceAccountName="vision-trainer")
            await wait_until(lambda: len(s.cluster.pod_cache) == 5, 20, "pod watched")
            other = Connection("vision")
            s.reg.hello(other, pb.Hello(job="vision", namespace="vision", rank=0,
                                        world_size=1, agent_instance="v0", pod="vision-0",
                                        node="node-1"))
            gpu_fault(s, s.conns[1], "llm-gpu")
            await wait_until(lambda: deleted(s, NS, "llm-worker-1"), 20, "llm pod deleted")
            assert not unschedulable(s, "node-1")
            g = s.reg.jobs[("vision", "vision")].generation
            f = pb.Fault(id="vision-gpu", kind=pb.FAULT_KIND_GPU, severity=pb.SEVERITY_FATAL,
                         scope=pb.SCOPE_NODE, message="Xid 79", generation=g)
            s.reg.handle(other, pb.AgentMessage(fault=f), time.monotonic())
            await wait_until(lambda: unschedulable(s, "node-1"), 20, "node-1 cordoned")
            n: Any = s.fake.get("nodes", "node-1")
            assert n["metadata"]["annotations"]["ftagent.io/cordon-evidence"] == "corroborated"
    run(body)


def test_a_node_agent_confirming_later_cordons_the_node() -> None:
    async def body() -> None:
        async with cluster() as s:
            gpu_fault(s, s.conns[2], "pod-first")
            await wait_until(lambda: deleted(s, NS, "llm-worker-2"), 20, "pod deleted")
            assert not unschedulable(s, "node-2")
            s.cluster.node_reported("node-2", ["agent-later"], {"nic"})  # another kind
            s.cluster.node_reported("node-2", ["agent-later-2"], {"gpu"})
            await wait_until(lambda: unschedulable(s, "node-2"), 20, "node-2 cordoned")
            assert not unschedulable(s, "node-1")
    run(body)


def test_the_breaker_has_a_cluster_cap_and_a_new_leader_remembers_its_cordons() -> None:
    async def body() -> None:
        async with cluster(max_confirmed_cordons=1, max_cordon_fraction=1.0) as s:
            for r in (0, 1):
                s.cluster.node_reported(f"node-{r}", [f"agent-{r}"], {"gpu"})
                gpu_fault(s, s.conns[r], f"gpu-{r}")
            await wait_until(lambda: s.fake.count("delete", "pods") >= 2, 20, "deletes")
            s.cluster.close(wait=True)
            cordoned = [n for n in ("node-0", "node-1") if unschedulable(s, n)]
            assert len(cordoned) == 1
            assert any("--max-confirmed-cordons 1" in e.message
                       for e in s.reg.timeline.entries("llm", NS, 0))
            # a new leader's Cluster, fresh memory: the node watch's annotations seed it
            fresh = Cluster(s.reg, s.fake.client(), KubeSettings(max_confirmed_cordons=1,
                                                                 max_cordon_fraction=1.0))
            for n in s.nodes():
                fresh.on_node("ADDED", n)
            assert fresh.breaker.cordoned(time.time()) == cordoned
            v = fresh.breaker.check("node-5", f"{NS}/llm", 4, 8, time.time(), confirmed=True)
            assert not v.allowed and "--max-confirmed-cordons" in v.reason
            fresh.close()
    run(body)


def test_the_breaker_counts_the_nodes_held_cordoned_not_an_hour() -> None:
    """On the code before, a cordon older than an hour left the breaker's count: with a
    cordon made two hours ago still on node-0, --max-cordons 1 allowed another one."""
    async def body() -> None:
        async with cluster(max_cordons=1, max_cordon_fraction=1.0) as s:
            s.fake.create("nodes", {"metadata": {"name": "node-9", "annotations": {
                "ftagent.io/cordoned-by": "ftagent-arbiter",
                "ftagent.io/cordoned-at": "2020-01-01T00:00:00Z",
                "ftagent.io/fault-job": "elsewhere/old"}}, "spec": {"unschedulable": True}})
            await wait_until(lambda: "node-9" in s.cluster.breaker.cordoned(), 20,
                             "the held cordon seen")
            v = s.cluster.breaker.check("node-1", f"{NS}/llm", 4, 8, time.time())
            assert not v.allowed and "--max-cordons 1" in v.reason
            # the operator uncordons it (kubectl uncordon): the budget comes back
            n: Any = copy.deepcopy(s.fake.get("nodes", "node-9"))
            n["spec"]["unschedulable"] = False
            s.fake.update("nodes", n)
            await wait_until(lambda: "node-9" not in s.cluster.breaker.cordoned(), 20,
                             "the uncordon seen")
            assert s.cluster.breaker.check("node-1", f"{NS}/llm", 4, 8, time.time()).allowed
    run(body)


def test_a_node_its_agent_reports_healthy_long_enough_is_uncordoned() -> None:
    async def body() -> None:
        async with cluster(uncordon_after=0.5, max_cordon_fraction=1.0) as s:
            s.cluster.node_reported("node-2", ["agent-gpu"], {"gpu"})
            gpu_fault(s, s.conns[2], "pod-gpu")
            await wait_until(lambda: unschedulable(s, "node-2"), 20, "node-2 cordoned")
            n: Any = s.fake.get("nodes", "node-2")
            assert n["metadata"]["annotations"]["ftagent.io/cordon-evidence"] == "node-agent"
            s.cluster.node_health("node-2", False)
            s.cluster.node_health("node-3", True)  # never cordoned: untouched
            # the node agent's heartbeats say healthy; after --uncordon-after, uncordoned
            deadline = time.monotonic() + 20
            while unschedulable(s, "node-2") and time.monotonic() < deadline:
                s.cluster.node_health("node-2", True)
                await asyncio.sleep(0.05)
            n = s.fake.get("nodes", "node-2")
            assert not n["spec"].get("unschedulable")
            assert not any(t.get("key") == "ftagent.io/fault" for t in n["spec"].get("taints")
                           or [])
            assert "ftagent.io/cordoned-by" not in n["metadata"].get("annotations", {})
            await wait_until(lambda: "node-2" not in s.cluster.breaker.cordoned(), 20,
                             "the breaker gave the node back")
            assert s.fake.count("update", "nodes") == 2  # the cordon and the uncordon
    run(body)
