"""DRA device taints on ResourceSlices (KEP-5055) as evidence, and ftagent's own device
taint staged (effect None, then NoSchedule) under the cordon breaker: the real
``kubernetes`` client against the fake API server (real HTTP, real watches of
ResourceSlices, ResourceClaims and DeviceTaintRules), a real Registry deciding."""

from __future__ import annotations

import asyncio
from typing import Any

from ftagent.kube.cluster import JOB_LABEL
from ftagent.v1 import ftagent_pb2 as pb
from tests.arbiter_helpers import wait_until
from tests.integration.test_kube_actions import NS, OWNER, cluster, run

RULES = "devicetaintrules.resource.k8s.io"
DRA: dict[str, Any] = {
    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
    "containers": [{"name": "trainer", "image": "trainer:latest",
                    "resources": {"claims": [{"name": "gpu"}]}}]}


def unschedulable(s: Any, node: str) -> bool:
    return bool(((s.fake.get("nodes", node) or {}).get("spec") or {}).get("unschedulable"))


def allocate(s: Any, world: int = 4) -> None:
    """Each rank's pod holds gpu-0 of its node's slice, through its own claim."""
    for r in range(world):
        s.fake.add_resource_slice(f"node-{r}", devices=("gpu-0", "gpu-1"))
        s.fake.allocate_claim(NS, f"llm-worker-{r}", ["gpu-0"], f"node-{r}")


def test_a_driver_taint_on_a_held_device_replaces_its_rank_and_taints_it_staged() -> None:
    async def body() -> None:
        async with cluster(pod_spec=DRA) as s:
            allocate(s)
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: len(s.cluster.dra._claims) == 4, 20, "claims watched")
            s.fake.taint_slice_device("node-2", "gpu-0", "gpu.nvidia.com/xid", "79")
            await wait_until(lambda: job.generation == 1, 20, "the taint's decision")
            assert [c.kind for c in s.commands(2)] == [pb.COMMAND_KIND_REPLACE]
            assert [c.kind for c in s.commands(0)] == [pb.COMMAND_KIND_RESTART]
            await wait_until(lambda: s.fake.count("update", RULES) >= 1, 20, "NoSchedule")
            (rule,) = s.fake.list(RULES)
            assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com",
                                                      "pool": "node-2", "device": "gpu-0"}
            assert rule["spec"]["taint"]["effect"] == "NoSchedule"
            created = [r.body for r in s.fake.requests if r.verb == "create" and
                       r.resource == RULES]
            assert [c["spec"]["taint"]["effect"] for c in created] == ["None"]  # dry run
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "pod deleted")
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- no cordon may follow
            assert not unschedulable(s, "node-2") and s.fake.count("update", "nodes") == 0
            entries = s.reg.timeline.entries("llm", NS, 0)
            assert any(e.kind == "fault" and "gpu.nvidia.com/node-2/gpu-0 tainted "
                       "gpu.nvidia.com/xid=79:NoSchedule" in e.message for e in entries)
            # the breaker holds the device (its rule watched back), not a node
            await wait_until(lambda: s.cluster.breaker.held(
                "device gpu.nvidia.com/node-2/gpu-0") is not None, 20, "held")
    run(body)


def test_a_taint_on_another_jobs_device_or_a_dry_run_acts_on_nothing() -> None:
    async def body() -> None:
        async with cluster(pod_spec=DRA) as s:
            allocate(s)
            # another job's pod on node-1 holds gpu-1 of that node
            s.fake.add_pod(NS, "x-0", labels={JOB_LABEL: "x"}, node="node-1",
                           owner={**OWNER, "uid": "other-uid", "name": "x"}, **DRA)
            s.fake.allocate_claim(NS, "x-0", ["gpu-1"], "node-1")
            # a claim naming node-3's gpu-1, reserved for another pod, that rank 3's pod
            # lists as its own (a status written by something else): not rank 3's device
            s.fake.allocate_claim(NS, "x-0", ["gpu-1"], "node-3", claim="forged")
            s.fake.patch("pods", "llm-worker-3", {"status": {"resourceClaimStatuses": [
                {"name": "gpu", "resourceClaimName": "llm-worker-3-gpu"},
                {"name": "other", "resourceClaimName": "forged"}]}}, NS,
                "application/strategic-merge-patch+json", "status")
            await wait_until(lambda: len(s.cluster.dra._claims) == 6, 20, "claims watched")
            s.fake.taint_slice_device("node-1", "gpu-1", "gpu.nvidia.com/xid", "48")
            s.fake.taint_slice_device("node-3", "gpu-1", "gpu.nvidia.com/xid", "48")
            s.fake.taint_slice_device("node-0", "gpu-0", "gpu.nvidia.com/xid", "13",
                                      effect="None")  # the driver's own dry run
            await wait_until(lambda: len(s.cluster.dra._slices) == 2, 20, "slices watched")
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- nothing may follow
            job = s.reg.jobs[(NS, "llm")]
            assert job.generation == 0 and s.fake.count("delete", "pods") == 0
            assert s.fake.count("create", RULES) == 0
    run(body)


def test_the_breaker_refuses_the_device_taint_and_the_pod_is_still_replaced() -> None:
    async def body() -> None:
        async with cluster(pod_spec=DRA, max_cordon_fraction=0.0) as s:
            allocate(s)
            await wait_until(lambda: len(s.cluster.dra._claims) == 4, 20, "claims watched")
            s.fake.taint_slice_device("node-1", "gpu-0", "gpu.nvidia.com/xid", "79",
                                      effect="NoExecute")
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: job.generation == 1, 20, "the taint's decision")
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "pod deleted")
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- no taint may follow
            assert s.fake.count("create", RULES) == 0 and not unschedulable(s, "node-1")
            entries = s.reg.timeline.entries("llm", NS, 0)
            assert any("device gpu.nvidia.com/node-1/gpu-0 not tainted: cordoning is off"
                       in e.message for e in entries)
    run(body)


def test_the_fakes_slices_claims_and_ftagents_rules_are_valid_kubernetes_1_37() -> None:
    import kubernetes_validate

    from ftagent.kube.device_taint import rule
    from tests.kube_fake import FakeKube
    with FakeKube() as fake:
        fake.add_node("node-0")
        fake.add_pod(NS, "p", node="node-0", **DRA)
        fake.add_resource_slice("node-0", devices=("gpu-0",))
        fake.taint_slice_device("node-0", "gpu-0", "gpu.nvidia.com/xid", "79")
        fake.allocate_claim(NS, "p", ["gpu-0"], "node-0")
        objs = [*fake.list("resourceslices.resource.k8s.io"),
                *fake.list("resourceclaims.resource.k8s.io", NS),
                *(rule("gpu.nvidia.com", "node-0", "gpu-0", "why", "f", "j", effect=e)
                  for e in ("None", "NoSchedule"))]
        for o in objs:
            kubernetes_validate.validate(o, "1.37", strict=True)


def test_a_device_tainted_before_its_claim_is_seen_is_acted_on_when_the_claim_comes(
        ) -> None:
    async def body() -> None:
        async with cluster(pod_spec=DRA) as s:
            s.fake.add_resource_slice("node-3", devices=("gpu-0",))
            s.fake.taint_slice_device("node-3", "gpu-0", "gpu.nvidia.com/xid", "79")
            await wait_until(lambda: len(s.cluster.dra._slices) == 1, 20, "slice watched")
            job = s.reg.jobs[(NS, "llm")]
            assert job.generation == 0
            s.fake.allocate_claim(NS, "llm-worker-3", ["gpu-0"], "node-3")
            await wait_until(lambda: job.generation == 1, 20, "the taint's decision")
            assert [c.kind for c in s.commands(3)] == [pb.COMMAND_KIND_REPLACE]
    run(body)


def test_the_fake_refuses_a_slice_taint_the_real_server_refuses() -> None:
    import pytest

    from tests.kube_fake import FakeKube
    from tests.kube_fake.errors import ApiError
    with FakeKube() as fake:
        fake.add_resource_slice("node-0")
        with pytest.raises(ApiError) as err:
            fake.taint_slice_device("node-0", "gpu-0", "k", effect="PreferNoSchedule")
        assert err.value.code == 422 and "spec.devices[0].taints[0].effect" in str(err.value)


def test_a_device_taint_the_api_server_failed_is_not_held_by_the_breaker() -> None:
    """A rule never written (500) does not keep a breaker slot: the cluster's one slot
    (8 nodes, --max-cordon-fraction 0.1) is free again for the next fault."""
    async def body() -> None:
        async with cluster(pod_spec=DRA) as s:
            allocate(s)
            s.fake.fail("create", RULES, 500, times=None)
            await wait_until(lambda: len(s.cluster.dra._claims) == 4, 20, "claims watched")
            s.fake.taint_slice_device("node-2", "gpu-0", "gpu.nvidia.com/xid", "79")
            job = s.reg.jobs[(NS, "llm")]
            await wait_until(lambda: job.generation == 1, 20, "the taint's decision")
            await wait_until(lambda: s.fake.count("create", RULES) >= 1, 20, "tried")
            await wait_until(lambda: s.cluster.breaker.count() == 0, 20, "slot released")
    run(body)
