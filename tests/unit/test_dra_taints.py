"""kube/dra.py: DRA device taints on ResourceSlices mapped to the pods that hold them."""

from __future__ import annotations

from typing import Any

from ftagent.kube.dra import DraTaints, claim_of, pod_claims, slice_taints
from ftagent.model import Scope


def slice_(node: str = "node-1", taints: dict[str, list[dict[str, Any]]] | None = None
           ) -> dict[str, Any]:
    return {"metadata": {"name": f"{node}-gpu"},
            "spec": {"driver": "gpu.nvidia.com", "pool": {"name": node}, "nodeName": node,
                     "devices": [{"name": d, "taints": t}
                                 for d, t in (taints or {}).items()]}}


def claim(name: str, uid: str, devices: list[str], node: str = "node-1",
          ns: str = "train") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": d}
                for d in devices]}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": uid}]}}


def pod(uid: str = "u1", claims: tuple[str, ...] = ("c1",)) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "train", "uid": uid},
            "spec": {"nodeName": "node-1"},
            "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": c}
                                                 for c in claims]}}


XID = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}


def test_only_acting_taints_not_ftagents_own_count() -> None:
    got = slice_taints(slice_(taints={
        "gpu-0": [XID], "gpu-1": [{**XID, "effect": "None"}],
        "gpu-2": [{**XID, "effect": "Sometime"}],
        "gpu-3": [{"key": "ftagent.io/fault", "value": "device", "effect": "NoSchedule"}],
        "gpu-4": [{**XID, "effect": "NoExecute"}]}))
    assert set(got) == {("gpu.nvidia.com", "node-1", "gpu-0"),
                        ("gpu.nvidia.com", "node-1", "gpu-4")}
    assert str(got[("gpu.nvidia.com", "node-1", "gpu-0")]) == "gpu.nvidia.com/xid=79:NoSchedule"


def test_a_held_tainted_device_is_one_node_scope_fault_per_pod() -> None:
    d = DraTaints()
    d.on_claim("ADDED", claim("c1", "u1", ["gpu-0"]))
    assert d.observe(pod()) == []  # nothing tainted yet
    assert d.on_slice("ADDED", slice_(taints={"gpu-0": [XID]}))
    (cf,) = d.observe(pod())
    assert cf.fault.scope is Scope.NODE and cf.uid == "u1" and cf.node == "node-1"
    assert cf.fault.evidence["dra"] == [["gpu.nvidia.com", "node-1", "gpu-0"]]
    assert cf.fault.evidence["dra_taint"] is True
    assert d.observe(pod()) == []  # once per pod
    assert len(d.observe(pod(uid="u2"))) == 0  # the claim is not reserved for u2


def test_a_claim_reserved_for_another_pod_or_another_namespace_is_not_held() -> None:
    d = DraTaints()
    d.on_slice("ADDED", slice_(taints={"gpu-0": [XID]}))
    d.on_claim("ADDED", claim("c1", "someone-else", ["gpu-0"]))
    d.on_claim("ADDED", claim("c2", "u1", ["gpu-0"], ns="other"))
    assert d.observe(pod(claims=("c1", "c2"))) == []
    # the slice gone (or untainted): nothing either
    d.on_claim("ADDED", claim("c3", "u1", ["gpu-0"]))
    d.on_slice("DELETED", slice_())
    assert d.observe(pod(claims=("c3",))) == []


class _Read(dict):  # type: ignore[type-arg]
    """A mapping that counts the reads made of it (``get``, ``[]``), all instances
    together: how much of a hostile object the parser looked at, counted, not timed."""

    reads = 0

    def get(self, key: Any, default: Any = None) -> Any:
        _Read.reads += 1
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        _Read.reads += 1
        return super().__getitem__(key)


def test_garbage_is_bounded_and_ignored() -> None:
    """5,000 devices of 1,000 taints each: the first 1,024 devices are read (MAX_DEVICES),
    and of each only up to its first acting taint. Counted reads, not a wall-clock bound
    (that one took 3.7 s once under a loaded machine's test run, stop 44)."""
    taint = _Read(XID)
    junk: Any = {"metadata": {"name": "s"}, "spec": {"driver": "d", "pool": {"name": "p"},
                 "devices": [_Read(name=f"g{i}", taints=[taint] * 1000) for i in range(5000)]
                 + [None, 7, {"name": 3}]}}
    _Read.reads = 0
    got = slice_taints(junk)
    assert len(got) == 1024
    # per device: its name (twice) and taints, then one taint's key, effect and value
    assert _Read.reads <= 1024 * 6, _Read.reads
    assert slice_taints({"spec": "x"}) == {} and slice_taints(None) == {}
    assert claim_of({"status": {"reservedFor": "x", "allocation": [1]}}).devices == ()
    assert pod_claims({"spec": {"resourceClaims": [{"name": "a", "resourceClaimName": "c"},
                                                   {"name": "b"}, 5]}}) == ["c"]
