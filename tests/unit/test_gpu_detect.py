"""The Xid table and the GPU detector (detect/gpu.py): pure, times from the observations."""

from __future__ import annotations

import pytest

from ftagent.detect.gpu import (
    XID_CATALOG,
    GpuAction,
    GpuDetector,
    classify,
    parse_xid_actions,
)
from ftagent.model import (
    SXID_UNKNOWN_DEVICE,
    FaultKind,
    GpuDevice,
    GpuEvent,
    GpuHealth,
    Progress,
    Scope,
    Severity,
)

DEV = GpuDevice(1, "GPU-11111111-2222-3333-4444-555555555555", "00000000:3B:00.0",
                "NVIDIA H100 80GB HBM3")


def det(**kw: object) -> GpuDetector:
    return GpuDetector(devices=lambda i: DEV if i == 1 else None, wall=lambda: 1000.0,
                       monotonic=lambda: 100.0, **kw)  # type: ignore[arg-type]


def xid(n: int, ts: float = 10.0, gpu: int = 1, source: str = "nvml", count: int = 1
        ) -> GpuEvent:
    return GpuEvent(gpu, "xid", xid=n, ts=ts, source=source, count=count)


@pytest.mark.parametrize(("n", "action"), [
    *((n, GpuAction.RESTART) for n in (13, 31, 43, 45, 68, 94)),
    *((n, GpuAction.RESET_GPU) for n in (48, 62, 64, 95, 109, 119, 120, 74, 144, 150)),
    *((n, GpuAction.REPLACE_NODE) for n in (79, 151, 160)),
    *((n, GpuAction.IGNORE) for n in (63, 92)),
])
def test_the_table_follows_the_catalog(n: int, action: GpuAction) -> None:
    assert classify(n).action is action
    assert XID_CATALOG[n].meaning


def test_unknown_xids_take_the_default_and_overrides_win() -> None:
    assert classify(9999).action is GpuAction.RESTART
    table, default = parse_xid_actions(["13=ignore", "default=reset_gpu", " 79 = restart "])
    assert classify(13, table, default).action is GpuAction.IGNORE
    assert classify(79, table, default).action is GpuAction.RESTART
    assert classify(9999, table, default).action is GpuAction.RESET_GPU
    for bad in ("13", "x=restart", "13=reboot", "123456=restart"):
        with pytest.raises(ValueError, match="13|x|123456"):
            parse_xid_actions([bad])


@pytest.mark.parametrize(("n", "severity", "scope"), [
    (13, Severity.ERROR, Scope.PROCESS), (95, Severity.FATAL, Scope.POD),
    (79, Severity.FATAL, Scope.NODE)])
def test_each_class_makes_the_fault_the_policy_expects(n: int, severity: Severity,
                                                       scope: Scope) -> None:
    (f,) = det().observe(xid(n))
    assert (f.kind, f.severity, f.scope) == (FaultKind.GPU, severity, scope)
    assert f.message.startswith("GPU 1 (NVIDIA H100 80GB HBM3, GPU-1111")
    assert f"Xid {n} (" in f.message
    ev = f.evidence
    assert ev["uuid"] == DEV.uuid and ev["pci_bus_id"] == DEV.pci_bus_id and ev["xid"] == n
    assert ev["action"] == classify(n).action.value and ev["recommended"]
    assert ev["first_seen_wall"] == pytest.approx(910.0)


def test_ignored_xids_are_counted_not_faults() -> None:
    d = det()
    assert d.observe(xid(63)) == [] and d.observe(xid(63, 11)) == []
    assert d.xid_counts() == {(1, 63): 2}
    assert d.healthy(1)


def test_a_flood_is_one_fault_per_episode_and_every_line_counts() -> None:
    d = det(quiet=60.0)
    faults = []
    for i in range(1000):
        faults += d.observe(xid(95, ts=10.0 + i * 0.01, source="kmsg", count=800))
    assert len(faults) == 1
    assert d.xid_counts() == {(1, 95): 800_000}
    assert not d.healthy(1)
    # quiet longer than the episode: the next occurrence is a new fault, counts go on
    (again,) = d.observe(xid(95, ts=200.0, source="kmsg"))
    assert again.evidence["occurrences"] == 1
    assert d.xid_counts() == {(1, 95): 800_001}


def test_the_same_xid_from_nvml_and_kmsg_is_one_fault_counted_once() -> None:
    d = det()
    (f,) = d.observe(xid(79, 10.0, source="nvml"))
    assert d.observe(xid(79, 10.002, source="kmsg")) == []
    assert d.xid_counts() == {(1, 79): 1}
    assert d.observe(xid(79, 10.5, source="kmsg")) == []  # kmsg saw a second one
    assert d.xid_counts() == {(1, 79): 2}
    assert f.evidence["seen_by"] == ["nvml"]


def test_gpu_lost_dbe_and_remap_failure_are_node_scope() -> None:
    d = det()
    (lost,) = d.observe(GpuEvent(1, "lost", ts=1.0, source="poll"))
    assert lost.scope is Scope.NODE and lost.severity is Severity.FATAL
    assert "GPU is lost" in lost.message
    assert d.observe(GpuEvent(1, "lost", ts=2.0, source="nvml")) == []
    (dbe,) = d.observe(GpuEvent(0, "ecc_dbe", ts=1.0))
    assert dbe.scope is Scope.NODE and dbe.message.startswith("GPU 0: ecc dbe")
    # the poll's counter rising for the same DBE is the same episode
    assert d.observe(GpuHealth(0, ecc_uncorrected=1, ts=2.0)) == []


def test_ecc_counter_increase_raises_and_a_steady_count_does_not() -> None:
    d = det()
    assert d.observe(GpuHealth(1, ecc_uncorrected=0, ts=1.0)) == []
    assert d.observe(GpuHealth(1, ecc_uncorrected=0, ts=6.0)) == []
    (f,) = d.observe(GpuHealth(1, ecc_uncorrected=2, ts=11.0))
    assert f.scope is Scope.NODE and "0 -> 2" in f.evidence["detail"]
    assert f.evidence["counters"]["ecc_uncorrected"] == 2
    assert d.observe(GpuHealth(1, ecc_uncorrected=2, ts=16.0)) == []


def test_remap_conditions_raise_once_while_they_hold() -> None:
    d = det()
    (f,) = d.observe(GpuHealth(1, remap_pending=True, ts=1.0))
    assert f.scope is Scope.NODE and f.evidence["action"] == "reset_gpu"
    assert d.observe(GpuHealth(1, remap_pending=True, ts=6.0)) == []
    assert d.observe(GpuHealth(1, remap_pending=False, ts=11.0)) == []
    assert len(d.observe(GpuHealth(1, remap_pending=True, ts=16.0))) == 1  # back again


def test_nvlink_with_a_remap_failure_replaces_the_node() -> None:
    d = det()
    (f,) = d.observe(GpuHealth(1, nvlink_down=(3,), ts=1.0))
    assert f.evidence["action"] == "reset_gpu" and "NVLink link 3" in f.message
    d2 = det()
    (fail,) = d2.observe(GpuHealth(1, remap_failure=True, ts=1.0))
    assert fail.evidence["action"] == "replace_node"
    (x74,) = d2.observe(xid(74, 2.0))
    assert x74.evidence["action"] == "replace_node"


def test_recovery_action_and_throttle(caplog: pytest.LogCaptureFixture) -> None:
    d = det()
    assert d.observe(GpuHealth(1, recovery_action=0, ts=1.0)) == []
    (f,) = d.observe(GpuHealth(1, recovery_action=2, ts=2.0))
    assert f.evidence["action"] == "replace_node" and "node reboot" in f.message
    with caplog.at_level("WARNING"):
        assert d.observe(GpuHealth(1, clock_event_reasons=0x40 | 0x4, ts=3.0)) == []
    assert "hw_thermal" in caplog.text and "sw_power" not in caplog.text
    assert d.slowdown(1) == 0x40


def test_sxid_fatal_replaces_non_fatal_is_ignored() -> None:
    d = det()
    assert d.observe(GpuEvent(-1, "sxid", xid=12028, detail="Non-fatal, Link 44", ts=1)) == []
    (f,) = d.observe(GpuEvent(-1, "sxid", xid=20034, detail="Fatal, Link 30 LTSSM", ts=1))
    assert f.scope is Scope.NODE and f.message.startswith("NVSwitch: SXid 20034")
    assert d.xid_counts() == {(-1, 12028): 1, (-1, 20034): 1}


def test_an_sxid_of_a_device_not_on_this_node_is_counted_never_node_fatal() -> None:
    """Issue 20: an SXid line naming an NVSwitch this host does not have was node-fatal
    (the node cordoned). It is counted; the same SXid from this node's switch still acts."""
    d = det()
    fatal = "nvidia-nvswitch0: Fatal, Link 30 LTSSM"
    assert d.observe(GpuEvent(-1, "sxid", xid=20034, detail=fatal, ts=1,
                              source=SXID_UNKNOWN_DEVICE)) == []
    assert d.xid_counts() == {(-1, 20034): 1}
    (f,) = d.observe(GpuEvent(-1, "sxid", xid=20034, detail=fatal, ts=2, source="kmsg"))
    assert f.scope is Scope.NODE


def test_other_observations_are_not_gpu_business() -> None:
    assert det().observe(Progress(step=1)) == []
    assert det().tick(1e9) == []
