"""What a pod costs the ``--kube`` arbiter per Hello and per decision (issue 33: 10,000
agents back within 15 s of a failover, fault -> RESTART p99 as without identity): the real
``kubernetes`` client against the fake API server, a real Registry deciding."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from ftagent.kube import cluster as cluster_module  # noqa: E402
from ftagent.kube.cluster import ANNOTATE_AFTER  # noqa: E402
from ftagent.v1 import ftagent_pb2 as pb  # noqa: E402
from tests.arbiter_helpers import wait_until  # noqa: E402
from tests.integration.test_kube_actions import NS, cluster, run  # noqa: E402


def _patches(s: Any) -> list[Any]:
    return [r for r in s.requests() if r.verb == "patch" and r.resource == "pods"]


def test_a_restarts_pod_annotations_are_written_once_after_it_settled() -> None:
    """A RESTART and its barrier's release each noted every rank's state for its pod's
    annotation, and the first was PATCHed at once: 1,000 PATCHes (and their 1,000 watch
    events back) per decision of a 1,000-rank job, in the seconds the agents wait for
    their commands and the barrier. They are written ANNOTATE_AFTER after the decision,
    by the tick, one PATCH per pod with the state the release left."""
    async def body() -> None:
        async with cluster(world=4) as s:
            now = [time.time()]
            s.cluster.clock = lambda: now[0]
            job = s.reg.jobs[(NS, "llm")]
            f = pb.Fault(id="crash-0", kind=pb.FAULT_KIND_CRASH, message="exit 1",
                         generation=job.generation, exit_status=1)
            s.reg.handle(s.conns[1], pb.AgentMessage(fault=f), time.monotonic())
            gen = job.generation
            assert gen == 1, "no restart"
            await asyncio.sleep(0.5)  # ten of the harness's 0.05 s ticks: nothing due yet
            assert _patches(s) == [], "annotated before the restart settled"
            for c in s.conns:
                s.reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=gen)),
                             time.monotonic())
            assert job.barrier is None or job.barrier.released
            now[0] += ANNOTATE_AFTER
            await wait_until(lambda: len(_patches(s)) >= 4, 20, "the pods annotated")
            await asyncio.sleep(0.3)  # (a second wave would have started by now)
            patched = _patches(s)
            assert sorted(r.name for r in patched) == [f"llm-worker-{r}" for r in range(4)]
            for r in range(4):
                pod = s.fake.get("pods", f"llm-worker-{r}", NS)
                assert pod is not None
                notes = pod["metadata"]["annotations"]
                assert notes["ftagent.io/generation"] == "1"
                assert notes["ftagent.io/state"] == (job.ranks[r].state or "unknown")
            # the watch shows them: noting the same states again writes nothing
            await wait_until(lambda: all(
                (s.cluster.pod_cache[(NS, f"llm-worker-{r}")]["metadata"].get("annotations")
                 or {}).get("ftagent.io/generation") == "1" for r in range(4)), 20,
                "the annotations in the watch")
            s.cluster._annotate(job)
            now[0] += ANNOTATE_AFTER
            s.cluster.tick()
            await asyncio.sleep(0.3)
            assert len(_patches(s)) == 4, "a pod PATCHed with the states it has"
    run(body)


def test_a_pods_facts_are_read_from_its_object_once_and_follow_the_watch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod credential's Hello asks for its pod's facts twice (the server's principal,
    then the Hello's check), 10,000 times after a failover: what the pod object says is
    derived once per object the watch hands over, and a changed pod is read afresh."""
    calls = [0]
    real = cluster_module.identify

    def counting(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(cluster_module, "identify", counting)

    async def body() -> None:
        async with cluster(world=2, owner={}) as s:
            s.fake.patch("pods", "llm-worker-1", {"metadata": {"annotations": {
                "ftagent.io/rank": "1", "ftagent.io/world-size": "2"}}}, NS)
            await wait_until(lambda: (f := s.cluster.pod_facts(NS, "llm-worker-1"))
                             is not None and f.rank == 1, 20, "the watch's rank 1")
            calls[0] = 0
            first = s.cluster.pod_facts(NS, "llm-worker-1")
            again = s.cluster.pod_facts(NS, "llm-worker-1")
            assert first == again and first is not None and first.job == "llm"
            assert calls[0] == 0, f"the pod's labels and env read {calls[0]} times again"
            s.fake.patch("pods", "llm-worker-1", {"metadata": {"annotations": {
                "ftagent.io/rank": "0"}}}, NS)
            await wait_until(lambda: (f := s.cluster.pod_facts(NS, "llm-worker-1"))
                             is not None and f.rank == 0, 20, "the watch's new rank")
            s.fake.delete("pods", "llm-worker-1", NS)
            await wait_until(lambda: s.cluster.pod_facts(NS, "llm-worker-1") is None, 20,
                             "the deleted pod forgotten")
    run(body)


def test_the_ladders_features_are_read_once_per_pod_and_node_object(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every RESTART and every release set every rank's ladder Features, on the loop
    before the commands are written: reading each pod's restart rules and each node's
    kubelet version anew was 0.2 s of a 1,000-rank job's fault -> RESTART. They are read
    once per pod and node object the watches handed over; a changed pod is read again."""
    calls = [0]
    real = cluster_module.features_of

    def counting(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(cluster_module, "features_of", counting)

    async def body() -> None:
        async with cluster(world=4) as s:
            job = s.reg.jobs[(NS, "llm")]

            def restart(i: int) -> None:  # RESTART, then every rank arrives: the release
                f = pb.Fault(id=f"crash-{i}", kind=pb.FAULT_KIND_CRASH, message="exit 1",
                             generation=job.generation, exit_status=1)
                s.reg.handle(s.conns[1], pb.AgentMessage(fault=f), time.monotonic())
                for c in s.conns:
                    s.reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(
                        generation=job.generation)), time.monotonic())

            restart(0)  # (the pods' first reads may have been before the nodes were listed)
            calls[0] = 0
            restart(1)
            restart(2)
            assert job.generation == 3
            assert all(r.tiers is not None for r in job.ranks.values())
            assert calls[0] == 0, f"{calls[0]} reads of unchanged pods' and nodes' features"
            s.fake.patch("pods", "llm-worker-2", {"metadata": {"labels": {"x": "y"}}}, NS)
            await wait_until(lambda: s.cluster.pod_cache[(NS, "llm-worker-2")]
                             ["metadata"]["labels"].get("x") == "y", 20, "the pod's change")
            restart(3)
            assert calls[0] == 1, "the changed pod was not read again (or others were)"
    run(body)
