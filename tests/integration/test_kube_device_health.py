"""Device health in pod status (KEP-4680) as evidence: the real ``kubernetes`` client
against the fake API server (real HTTP, real watches), a real Registry deciding. The
kubelet's Unhealthy device replaces its rank's pod; no NVML is involved anywhere."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from ftagent.arbiter.state import JobPhase
from ftagent.kube.cluster import JOB_LABEL
from ftagent.v1 import ftagent_pb2 as pb
from tests.arbiter_helpers import wait_until
from tests.integration.test_kube_actions import NS, OWNER, cluster, run

GPU: dict[str, Any] = {"containers": [{"name": "trainer", "image": "trainer:latest",
                       "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}


def unschedulable(s: Any, node: str) -> bool:
    return bool(((s.fake.get("nodes", node) or {}).get("spec") or {}).get("unschedulable"))


def test_an_unhealthy_device_in_pod_status_replaces_its_rank_and_cordons_on_kubelet_evidence(
        ) -> None:
    async def body() -> None:
        async with cluster(pod_spec=GPU) as s:
            s.fake.set_device_health(NS, "llm-worker-2", "nvidia.com/gpu", "GPU-2f1c",
                                     message="ECC error count exceeded threshold")
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: job.generation == 1, 20, "the device fault's decision")
            assert job.phase is JobPhase.RESTARTING
            assert [c.kind for c in s.commands(2)] == [pb.COMMAND_KIND_REPLACE]
            assert [c.kind for c in s.commands(0)] == [pb.COMMAND_KIND_RESTART]
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "pod deleted")
            await wait_until(lambda: unschedulable(s, "node-2"), 20, "node-2 cordoned")
            notes = (s.fake.get("nodes", "node-2") or {})["metadata"]["annotations"]
            assert notes["ftagent.io/cordon-evidence"] == "device-health"
            assert "GPU-2f1c" in notes["ftagent.io/fault"]
            entries = s.reg.timeline.entries("llm", NS, 0)
            assert any(e.kind == "fault" and "GPU-2f1c" in e.message and "ECC error" in
                       e.message and "reported Unhealthy by the kubelet" in e.message
                       for e in entries)
            assert job.restarts == 1
    run(body)


def test_unknown_health_and_a_healthy_device_change_nothing() -> None:
    async def body() -> None:
        async with cluster(pod_spec=GPU) as s:
            s.fake.set_device_health(NS, "llm-worker-1", "nvidia.com/gpu", "GPU-a", "Unknown")
            s.fake.set_device_health(NS, "llm-worker-3", "nvidia.com/gpu", "GPU-b", "Healthy")
            await wait_until(lambda: (p := s.cluster.pod_cache.get((NS, "llm-worker-3")))
                             is not None and "containerStatuses" in p.get("status", {}), 20,
                             "the watch to see the status")
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- nothing may follow: give it a chance
            job = s.reg.jobs[(NS, "llm")]
            assert job.generation == 0 and s.fake.count("delete", "pods") == 0
    run(body)


def test_the_api_server_refuses_a_device_the_container_does_not_hold() -> None:
    async def body() -> None:
        async with cluster(pod_spec=GPU) as s:
            with pytest.raises(Exception) as got:
                s.fake.set_device_health(NS, "llm-worker-1", "amd.com/gpu", "GPU-x")
            assert "must match one of the container's resource requests" in str(got.value)
            # and through the real client too: 422 Invalid
            from kubernetes import client
            api = client.CoreV1Api(s.fake.client())
            body_ = {"status": {"containerStatuses": [{
                "name": "trainer", "image": "t", "imageID": "", "ready": True,
                "restartCount": 0, "allocatedResourcesStatus": [
                    {"name": "claim:gpu", "resources": [{"resourceID": "d",
                                                         "health": "Unhealthy"}]}]}]}}
            with pytest.raises(ApiException) as err:
                api.patch_namespaced_pod_status("llm-worker-1", NS, body_)
            assert err.value.status == 422 and "resource claims" in str(err.value.body)
    run(body)


def test_device_health_of_another_jobs_pod_on_the_same_node_acts_on_nothing_of_this_job(
        ) -> None:
    async def body() -> None:
        async with cluster(pod_spec=GPU) as s:
            # another job's pod on node-1 (same namespace), labelled for ftagent
            s.fake.add_pod(NS, "x-0", labels={JOB_LABEL: "x"}, node="node-1",
                           owner={**OWNER, "uid": "other-uid", "name": "x"}, **GPU)
            s.fake.set_device_health(NS, "x-0", "nvidia.com/gpu", "GPU-9")
            await wait_until(lambda: "containerStatuses" in (s.cluster.pod_cache.get(
                (NS, "x-0")) or {}).get("status", {}), 20, "the watch to see it")
            job = s.reg.jobs[(NS, "llm")]
            # rank 1's agent claimed that pod as its own (no pod credential to stop it):
            # its status is still not this job's evidence
            s.cluster._device_health(job, job.ranks[1], s.cluster.pod_cache[(NS, "x-0")])
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- nothing may follow
            assert job.generation == 0
            assert s.fake.count("delete", "pods") == 0 and not unschedulable(s, "node-1")
    run(body)


def test_a_device_flapping_every_tick_is_decided_once() -> None:
    async def body() -> None:
        async with cluster(pod_spec=GPU) as s:
            job = s.reg.jobs[(NS, "llm")]
            for i in range(10):
                s.fake.set_device_health(NS, "llm-worker-0", "nvidia.com/gpu", "GPU-0",
                                         "Unhealthy" if i % 2 == 0 else "Healthy")
            await wait_until(lambda: job.generation == 1, 20, "the decision")
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "delete")
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- no second decision may follow
            assert job.generation == 1 and job.restarts == 1
            assert s.fake.count("delete", "pods") == 1
    run(body)


DRA: dict[str, Any] = {"containers": [{"name": "trainer", "image": "trainer:latest",
                                       "resources": {"claims": [{"name": "gpu",
                                                                 "request": "one"}]}}]}


def test_an_unhealthy_dra_device_is_tainted_not_its_node_cordoned() -> None:
    async def body() -> None:
        async with cluster(pod_spec=DRA) as s:
            s.fake.set_device_health(NS, "llm-worker-2", "claim:gpu/one",
                                     "gpu.nvidia.com/node-2/gpu-3", message="Xid 79")
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: job.generation == 1, 20, "the device fault's decision")
            await wait_until(lambda: s.fake.count("update", "devicetaintrules.resource.k8s.io")
                             >= 1, 20, "the device tainted (after its dry run)")
            (rule,) = s.fake.list("devicetaintrules.resource.k8s.io")
            assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com",
                                                      "pool": "node-2", "device": "gpu-3"}
            assert rule["spec"]["taint"] == {"key": "ftagent.io/fault", "value": "device",
                                             "effect": "NoSchedule"}
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "pod deleted")
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- no cordon may follow
            assert not unschedulable(s, "node-2") and s.fake.count("update", "nodes") == 0
    run(body)


def test_without_device_taint_rules_the_node_is_cordoned_instead() -> None:
    async def body() -> None:
        async with cluster(pod_spec=DRA) as s:
            s.fake.remove_resource("devicetaintrules.resource.k8s.io")  # an older cluster
            s.fake.set_device_health(NS, "llm-worker-1", "claim:gpu/one",
                                     "gpu.nvidia.com/node-1/gpu-0")
            await wait_until(lambda: unschedulable(s, "node-1"), 20, "node-1 cordoned")
            notes = (s.fake.get("nodes", "node-1") or {})["metadata"]["annotations"]
            assert notes["ftagent.io/cordon-evidence"] == "device-health"
    run(body)


def test_the_fake_refuses_a_device_taint_rule_the_real_server_refuses() -> None:
    from kubernetes import client

    from tests.kube_fake import FakeKube
    with FakeKube() as fake:
        api = client.ResourceV1Api(fake.client())
        bad: Any = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
                    "metadata": {"name": "x"},
                    "spec": {"taint": {"key": "k", "effect": "PreferNoSchedule"}}}
        with pytest.raises(ApiException) as err:
            api.create_device_taint_rule(bad)
        assert err.value.status == 422 and "spec.taint.effect" in str(err.value.body)
