"""Device health in pod status (kube/device_health.py): the pure rules."""

from __future__ import annotations

from typing import Any

from ftagent.kube.device_health import DeviceHealth, held, unhealthy
from ftagent.model import FaultKind, Scope, Severity


def pod(entries: list[dict[str, Any]], resources: dict[str, Any] | None = None,
        container: str = "trainer", uid: str = "u1") -> dict[str, Any]:
    res = resources if resources is not None else {"limits": {"nvidia.com/gpu": "2"}}
    return {"metadata": {"name": "p", "namespace": "ns", "uid": uid},
            "spec": {"nodeName": "n1", "containers": [{"name": "trainer", "resources": res}]},
            "status": {"containerStatuses": [{"name": container,
                                              "allocatedResourcesStatus": entries}]}}


def dev(rid: str, health: str = "Unhealthy", **kw: Any) -> dict[str, Any]:
    return {"resourceID": rid, "health": health, **kw}


def test_held_names_requests_limits_and_claims_as_the_status_spells_them() -> None:
    c = {"resources": {"requests": {"cpu": "1"}, "limits": {"nvidia.com/gpu": "1"},
                       "claims": [{"name": "gpus"}, {"name": "nics", "request": "rdma"}]}}
    assert held(c) == {"cpu", "nvidia.com/gpu", "claim:gpus", "claim:nics/rdma"}
    assert held({}) == set() and held({"resources": "x"}) == set()


def test_an_unhealthy_held_device_is_one_fatal_node_scope_fault() -> None:
    d = DeviceHealth()
    p = pod([{"name": "nvidia.com/gpu", "resources": [dev("GPU-a", "Healthy"),
                                                       dev("GPU-b", message="Xid 79")]}])
    faults, ignored = d.observe(p)
    assert ignored == [] and len(faults) == 1
    f = faults[0].fault
    assert (f.kind, f.severity, f.scope) == (FaultKind.NODE, Severity.FATAL, Scope.NODE)
    assert "GPU-b" in f.message and "Xid 79" in f.message and "GPU-a" not in f.message
    assert faults[0].node == "n1" and faults[0].uid == "u1"
    assert f.evidence["device_health"] is True
    # flapping: the same pod again (healthy, unhealthy, ...) is never a second fault
    for h in ("Healthy", "Unhealthy") * 50:
        p2 = pod([{"name": "nvidia.com/gpu", "resources": [dev("GPU-b", h)]}])
        assert d.observe(p2)[0] == []
    # a new pod (the replacement) is judged afresh
    assert len(d.observe(pod([{"name": "nvidia.com/gpu", "resources": [dev("GPU-c")]}],
                             uid="u2"))[0]) == 1


def test_unknown_is_not_unhealthy() -> None:
    assert unhealthy(pod([{"name": "nvidia.com/gpu", "resources": [dev("g", "Unknown")]}])) \
        == ([], [])


def test_a_device_the_container_does_not_hold_is_ignored_with_its_reason() -> None:
    d = DeviceHealth()
    p = pod([{"name": "amd.com/gpu", "resources": [dev("g")]},
             {"name": "claim:other", "resources": [dev("h")]}])
    faults, ignored = d.observe(p)
    assert faults == [] and len(ignored) == 2
    assert "does not hold 'amd.com/gpu'" in ignored[0]
    assert d.observe(p) == ([], [])  # said once
    # a status for a container the spec lacks (the API server does not check it)
    faults, ignored = DeviceHealth().observe(pod(
        [{"name": "nvidia.com/gpu", "resources": [dev("g")]}], container="ghost"))
    assert faults == [] and "not in the pod's spec" in ignored[0]


def test_a_dra_claim_the_container_holds_counts() -> None:
    res = {"claims": [{"name": "gpu", "request": "one"}]}
    bad, _ = unhealthy(pod([{"name": "claim:gpu/one", "resources": [dev("drv/pool/gpu-0")]}],
                           res))
    assert [b.device for b in bad] == ["drv/pool/gpu-0"]


def test_odd_shapes_are_not_known_never_an_exception() -> None:
    d = DeviceHealth()
    for junk in (None, 1, "x", {}, {"metadata": {"name": "p", "uid": "u"}},
                 {"metadata": {"name": "p", "uid": "u"}, "spec": {"containers": "x"},
                  "status": {"containerStatuses": [1, {"allocatedResourcesStatus": 3}]}},
                 pod([{"name": 5, "resources": [1, None, {"health": "Unhealthy"}]}])):
        assert d.observe(junk)[0] == []


def test_bounded_input_reads_a_bounded_prefix() -> None:
    many = [dev(f"g{i}", "Healthy") for i in range(100_000)] + [dev("late")]
    assert unhealthy(pod([{"name": "nvidia.com/gpu", "resources": many}])) == ([], [])


def test_a_terminating_pod_is_not_judged() -> None:
    p = pod([{"name": "nvidia.com/gpu", "resources": [dev("g")]}])
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert DeviceHealth().observe(p)[0] == []


def test_dra_devices_are_named_by_driver_pool_device_and_only_all_dra_taints() -> None:
    res = {"claims": [{"name": "gpu"}], "limits": {"nvidia.com/gpu": "1"}}
    dra_only = pod([{"name": "claim:gpu", "resources": [dev("gpu.nvidia.com/pool-a/gpu-1")]}],
                   res)
    f = DeviceHealth().observe(dra_only)[0][0].fault
    assert f.evidence["dra"] == [["gpu.nvidia.com", "pool-a", "gpu-1"]]
    mixed = pod([{"name": "claim:gpu", "resources": [dev("gpu.nvidia.com/pool-a/gpu-1")]},
                 {"name": "nvidia.com/gpu", "resources": [dev("GPU-9")]}], res)
    assert DeviceHealth().observe(mixed)[0][0].fault.evidence["dra"] == []
    odd = pod([{"name": "claim:gpu", "resources": [dev("a/b"), dev("a//c")]}], res)
    assert DeviceHealth().observe(odd)[0][0].fault.evidence["dra"] == []
