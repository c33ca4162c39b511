"""What the node agent sends, keeps local, and says in its NIC condition (pure parts)."""

from __future__ import annotations

from ftagent.cmd.node import parse, physical_links
from ftagent.config import NicConfig
from ftagent.detect.gpu import GpuDetector
from ftagent.detect.nic import NicDetector
from ftagent.model import Fault, FaultKind, GpuEvent, LinkEvent, Scope, Severity
from ftagent.node.agent import NicWatch, NodeAgent, reportable
from ftagent.node.reports import MAX_LASTING, MAX_PENDING, NodeReporter
from ftagent.sources.nic import InitialLink, NicSource, link_event, select_links


def gpu_faults(xid: int) -> list[Fault]:
    return GpuDetector().observe(GpuEvent(gpu=0, kind="xid", xid=xid, ts=1.0))


def test_fatal_gpu_faults_go_out_with_node_scope_application_xids_stay_local() -> None:
    (fatal,) = gpu_faults(79)
    sent = reportable(fatal)
    assert sent is not None and sent.scope is Scope.NODE and sent.id == fatal.id
    (reset,) = gpu_faults(95)
    assert reset.scope is Scope.POD and reportable(reset).scope is Scope.NODE  # type: ignore[union-attr]
    (app,) = gpu_faults(13)
    assert app.severity is Severity.ERROR and reportable(app) is None


def test_faults_are_queued_for_every_shard_and_bounded() -> None:
    reporter = NodeReporter(["a:1", "b:2"], "n1", "inst")
    agent = NodeAgent("n1", reporter=reporter)
    (fatal,) = gpu_faults(79)
    agent.on_fault(fatal)
    agent.on_fault(gpu_faults(13)[0])
    assert [list(s.pending) for s in reporter.shards] == [[fatal.id], [fatal.id]]
    assert agent.kept_local == 1
    for _ in range(MAX_PENDING + 5):
        reporter.report(gpu_faults(79)[0])
    assert all(len(s.pending) == MAX_PENDING and s.dropped == 6 for s in reporter.shards)


def test_what_still_holds_is_kept_for_later_pods_and_a_link_back_settles_it() -> None:
    reporter = NodeReporter(["a:1"], "n1", "inst")
    agent = NodeAgent("n1", reporter=reporter)
    (first,) = gpu_faults(79)
    agent.on_fault(first)
    (again,) = gpu_faults(79)  # the same GPU: the latest one is kept
    agent.on_fault(again)
    assert [m.id for m in reporter.lasting.values()] == [again.id]
    det = NicDetector(0.5, scope=Scope.NODE)
    det.observe(LinkEvent("eth0", True, True, ts=1.0))
    det.observe(LinkEvent("eth0", True, False, ts=2.0))
    (down,) = det.tick(3.0)
    agent.on_fault(down)
    assert "nic:eth0" in reporter.lasting
    (back,) = det.observe(LinkEvent("eth0", True, True, ts=4.0))
    assert back.evidence.get("recovered")
    agent.on_fault(back)
    assert list(reporter.lasting) == ["gpu:0"], "the link is back: nothing to send again"
    assert back.id in reporter.shards[0].pending  # the recovery itself is sent
    for i in range(MAX_LASTING + 3):
        reporter.report(first, lasting=f"k{i}")
    assert len(reporter.lasting) == MAX_LASTING


def test_nic_condition_follows_the_detector() -> None:
    det = NicDetector(0.5, scope=Scope.NODE)
    source = NicSource(NicConfig(nic=("eth0",)), {})
    agent = NodeAgent("n1", nic=NicWatch(source, det))
    assert agent.health() == []  # no link seen yet: no condition
    # what the source's first netlink dump does (the netns integration test runs it for real)
    source.selection = select_links(("eth0",), {}, [])
    source._update(2, link_event("eth0", 0x10003, index=2), None, lambda _: None)
    det.observe(LinkEvent("eth0", True, True, ts=1.0))
    (h,) = agent.health()
    assert h.healthy and h.reason == "LinksUp"
    det.observe(LinkEvent("eth0", True, False, ts=2.0))
    assert agent.health()[0].healthy, "within the grace: a flap, not a problem"
    (f,) = det.tick(3.0)
    assert f.kind is FaultKind.NIC and f.scope is Scope.NODE
    (h,) = agent.health()
    assert not h.healthy and h.reason == "CarrierLost" and h.message == "link eth0 lost carrier"


def test_flags_node_name_and_default_links(tmp_path: object) -> None:
    s = parse(["--arbiter", "a:1,b:2"], {"NODE_NAME": "gpu-7"})
    assert s.node.node == "gpu-7" and s.nic.nic_scope == "node" and s.node.metrics_port == 9432
    assert parse(["--node", "x"], {"NODE_NAME": "gpu-7"}).node.node == "x"
    import os
    from pathlib import Path

    root = Path(str(tmp_path))
    (root / "devices/pci0000:00/net/eth0").mkdir(parents=True)
    (root / "devices/virtual/net/veth1").mkdir(parents=True)
    (root / "net").mkdir()
    os.symlink(root / "devices/pci0000:00/net/eth0", root / "net/eth0")
    os.symlink(root / "devices/virtual/net/veth1", root / "net/veth1")
    assert physical_links(str(root / "net")) == ("eth0",)


def test_a_warned_outage_of_an_unnamed_link_neither_lasts_nor_fails_the_condition() -> None:
    """A link watched only as up at start, down while another such link is up, is a
    WARNING (detect/nic.py): sent for the record, kept for no later pod (no recovery will
    settle it) and no NIC condition of the node."""
    reporter = NodeReporter(["a:1"], "n1", "inst")
    det = NicDetector(0.5, scope=Scope.NODE, guessed=lambda _: True)
    source = NicSource(NicConfig(), {})
    agent = NodeAgent("n1", nic=NicWatch(source, det), reporter=reporter)
    source.selection = select_links((), {}, [InitialLink("eth0", True),
                                              InitialLink("veth1", True)])
    for i, dev in enumerate(("eth0", "veth1"), start=2):
        source._update(i, link_event(dev, 0x10003, index=i), None, lambda _: None)
        det.observe(LinkEvent(dev, True, True, ts=1.0))
    det.observe(LinkEvent("veth1", True, True, deleted=True, ts=2.0))
    (f,) = det.tick(3.0)
    assert f.severity is Severity.WARNING
    agent.on_fault(f)
    assert f.id in reporter.shards[0].pending and not reporter.lasting
    (h,) = agent.health()
    assert h.healthy, h.message
