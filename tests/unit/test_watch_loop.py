"""The one watch loop (ftagent/watch/): sources -> pure detectors -> sinks, the registry of
parts, and the pod agent, node agent and gpu-check all standing on it.

Sources here are tiny async functions that emit scripted observations; the detectors are
the real ones (NIC debounce, Xid table). Waits are on events the sinks set, never sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ftagent.config import ConfigError, GpuConfig, NicConfig
from ftagent.detect.gpu import GpuDetector
from ftagent.detect.nic import NicDetector
from ftagent.model import Fault, FaultKind, GpuEvent, LinkEvent, Observation, Scope, Severity
from ftagent.node.agent import NicWatch, NodeAgent
from ftagent.node.reports import NodeReporter
from ftagent.sources.nic import NicSource
from ftagent.watch import registry
from ftagent.watch.context import WatchContext
from ftagent.watch.loop import Detector, Source, WatchLoop

WAIT = 10.0  # seconds a test waits for what must happen (a loaded CI machine)


def link(ts: float, carrier: bool, dev: str = "eth0") -> LinkEvent:
    return LinkEvent(ifname=dev, admin_up=True, carrier=carrier, ts=ts, operstate="X", index=2)


class Script:
    """A source that emits its observations, then stays (as a real source does)."""

    def __init__(self, *obs: Observation, fail: Exception | None = None) -> None:
        self.obs = obs
        self.fail = fail

    async def run(self, emit: Callable[[Observation], None]) -> None:
        for o in self.obs:
            emit(o)
        if self.fail is not None:
            raise self.fail
        await asyncio.Event().wait()


@dataclass
class Probe:
    """A part as a new source file would write it: sources, detectors, a collector."""

    srcs: Sequence[Source]
    dets: Sequence[Detector] = ()
    name: str = "probe"
    seen: list[Observation] = field(default_factory=list)

    def sources(self) -> Sequence[Source]:
        return self.srcs

    def detectors(self) -> Sequence[Detector]:
        return self.dets

    def collector(self, labels: Mapping[str, str]) -> Collector:
        seen = self.seen

        class Seen(Collector):
            def collect(self) -> Any:
                g = GaugeMetricFamily("ftagent_probe_seen", "observations", labels=list(labels))
                g.add_metric(list(labels.values()), len(seen))
                yield g

        return Seen()


class Count(Detector):
    """Records what it is shown; a fault per GpuEvent."""

    def __init__(self, seen: list[Observation]) -> None:
        self.seen = seen

    def observe(self, obs: Observation) -> list[Fault]:
        self.seen.append(obs)
        return [Fault(FaultKind.GPU, "probe")] if isinstance(obs, GpuEvent) else []

    def tick(self, now: float) -> list[Fault]:
        return []


def test_observers_then_detectors_then_the_fault_sink_in_order() -> None:
    order: list[str] = []
    seen: list[Observation] = []
    xid = GpuEvent(gpu=0, kind="xid", xid=79, ts=1.0)
    loop = WatchLoop([Probe([Script()], [Count(seen), GpuDetector()])],
                     lambda f: order.append(f"fault {f.message[:9]}"),
                     observers=[lambda o: order.append(f"obs {type(o).__name__}")])
    loop.emit(xid)
    assert order[0] == "obs GpuEvent" and seen == [xid]
    assert order[1:] == ["fault probe", "fault GPU 0: Xi"], order  # detectors in part order
    assert loop.faults == 2


def test_run_starts_every_source_and_an_async_sink_gets_each_fault() -> None:
    async def main() -> list[Fault]:
        got: list[Fault] = []
        done = asyncio.Event()

        async def sink(f: Fault) -> None:  # the pod agent's raise_fault is a coroutine
            await asyncio.sleep(0)
            got.append(f)
            if len(got) == 2:
                done.set()

        parts = [Probe([Script(GpuEvent(gpu=0, kind="xid", xid=79, ts=1.0))],
                       [GpuDetector()]),
                 Probe([Script(), Script(GpuEvent(gpu=1, kind="xid", xid=48, ts=1.0))],
                       [GpuDetector()])]
        loop = WatchLoop(parts, sink, tick_seconds=3600)
        task = asyncio.create_task(loop.run())
        await asyncio.wait_for(done.wait(), WAIT)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return got

    got = asyncio.run(main())
    # each part's detector sees every observation: two GPU detectors, two Xids
    assert sorted(f.evidence["gpu"] for f in got) == [0, 0, 1, 1]


def test_a_failing_source_is_one_error_and_the_others_go_on() -> None:
    async def main() -> tuple[list[str], list[Fault]]:
        errors: list[str] = []
        faults: list[Fault] = []
        done = asyncio.Event()

        def sink(f: Fault) -> None:
            faults.append(f)
            done.set()

        det = NicDetector(0.0, scope=Scope.POD)
        loop = WatchLoop([Probe([Script(fail=OSError("no netlink")),
                                 Script(link(1.0, True), link(2.0, False))], [det])],
                         sink, on_error=lambda name, e: errors.append(f"{name}: {e}"),
                         tick_seconds=3600)
        task = asyncio.create_task(loop.run())
        await asyncio.wait_for(done.wait(), WAIT)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return errors, faults

    errors, faults = asyncio.run(main())
    assert errors == ["Script: no netlink"]
    assert [f.kind for f in faults] == [FaultKind.NIC]


def test_a_link_grace_fires_at_its_deadline_not_at_the_next_tick() -> None:
    """No periodic tick at all (an hour): the NIC detector's next_deadline arms a timer."""

    async def main() -> float:
        done = asyncio.Event()
        det = NicDetector(0.05, scope=Scope.NODE)
        loop = WatchLoop([NicWatch(NicSource(NicConfig(nic=("eth0",)), {}), det)],
                         lambda f: done.set(), tick_seconds=3600)
        now = time.monotonic()
        loop.emit(link(now - 1.0, True))
        loop.emit(link(now, False))
        await asyncio.wait_for(done.wait(), WAIT)
        return time.monotonic() - now

    assert asyncio.run(main()) < WAIT


def test_the_node_agent_reports_a_link_down_at_its_grace_without_its_tick() -> None:
    """The node agent stands on the same loop: its emit arms the grace timer (before, a
    link's outage waited for the node's next 0.25 s tick; here no tick runs at all)."""

    class Node(NodeAgent):
        done: asyncio.Event

        def on_fault(self, f: Fault) -> None:
            super().on_fault(f)
            self.done.set()

    async def main() -> tuple[list[str], NodeReporter]:
        det = NicDetector(0.05, scope=Scope.NODE)
        reporter = NodeReporter(["a:1"], "n1", "inst")
        agent = Node("n1", nic=NicWatch(NicSource(NicConfig(nic=("eth0",)), {}), det),
                     reporter=reporter)
        agent.done = asyncio.Event()
        now = time.monotonic()
        agent.emit(link(now - 1.0, True))
        agent.emit(link(now, False))
        await asyncio.wait_for(agent.done.wait(), WAIT)
        return [f.message for f in agent.faults], reporter

    (message,), reporter = asyncio.run(main())
    assert "eth0" in message and len(reporter.shards[0].pending) == 1


def test_adding_a_source_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new part registered by name: built for every agent, its collector served, its
    faults through the node agent's sinks -- no other file edited."""
    seen: list[Observation] = []
    monkeypatch.setitem(registry.FACTORIES, "probe",
                        lambda ctx: Probe([Script()], [Count(seen)], seen=seen))
    ctx = WatchContext(GpuConfig(gpu_backend="none"), NicConfig(nic=("eth0",)))
    metrics = CollectorRegistry()
    loop = registry.assemble(ctx, lambda f: None, metrics=metrics, labels={"node": "n1"})
    assert [p.name for p in loop.parts] == ["nic", "probe"]  # --gpu-backend none: no GPU part
    agent = NodeAgent("n1", parts=loop.parts)
    agent.emit(GpuEvent(gpu=0, kind="xid", xid=13, ts=1.0))
    assert len(seen) == 1 and [f.message for f in agent.faults] == ["probe"]
    assert agent.kept_local == 1  # not node-scoped (severity ERROR): the node keeps it
    assert 'ftagent_probe_seen{node="n1"} 1.0' in generate_latest(metrics).decode()


def test_a_factory_s_bad_setting_is_a_config_error() -> None:
    ctx = WatchContext(GpuConfig(gpu_backend="simulated:/nonexistent/timeline.txt"))
    with pytest.raises(ConfigError, match="--gpu-backend"):
        registry.build(ctx, ["gpu"])
    ctx = WatchContext(GpuConfig(gpu_backend="none", gpu_xid_action=("79=explode",)))
    assert registry.build(ctx, ["gpu"]) == []  # off: its flags are not read


def test_the_nic_part_takes_its_scope_and_environment_from_the_context() -> None:
    pod = registry.build(WatchContext(nic=NicConfig(), trainer_environ={
        "NCCL_IB_HCA": "mlx5_0"}), ["nic"])[0]
    node = registry.build(WatchContext(nic=NicConfig(nic_scope="node")), ["nic"])[0]
    assert isinstance(pod, NicWatch) and isinstance(node, NicWatch)
    assert pod.detector.scope is Scope.POD and node.detector.scope is Scope.NODE
    assert pod.rdma is not None and pod.rdma.hca is not None and node.rdma is not None \
        and node.rdma.hca is None
    assert [type(s).__name__ for s in pod.sources()] == ["NicSource", "RdmaSource"]


def test_gpu_part_s_severity_reaches_the_node_sinks() -> None:
    """A fatal Xid through the node agent's loop goes out with scope NODE."""
    reporter = NodeReporter(["a:1"], "n1", "inst")
    agent = NodeAgent("n1", parts=[Probe([Script()], [GpuDetector()])], reporter=reporter)
    agent.emit(GpuEvent(gpu=0, kind="xid", xid=79, ts=1.0))
    (f,) = agent.faults
    assert f.severity is Severity.FATAL and reporter.shards[0].pending
